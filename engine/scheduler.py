"""Continuous batching: a waiting queue, a running batch, and page reservations.

Each step is either a prefill step (admit waiting requests, compute their prompts,
chunked when long) or a decode step (one token for every running request).  A
request's pages are reserved for prompt + max_tokens when it is admitted, so no
request is ever evicted mid-stream; requests join and leave the running batch at
every step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.kv_pool import PagePool
from engine.request import Request, Status


@dataclass
class ScheduledBatch:
    requests: list[Request]
    num_new_tokens: list[int]     # tokens each request adds to the cache this step
    is_prefill: bool

    def samples(self) -> list[bool]:
        """Whether each request produces a token this step (its last prompt chunk, or decode)."""
        return [not r.prefilling or r.num_computed + n >= len(r.prompt_token_ids)
                for r, n in zip(self.requests, self.num_new_tokens)]


class Scheduler:
    """The one scheduler of a pool.  A hand-off request (prefill for another worker) reserves
    pages for its prompt only; every other request for prompt + max_tokens."""

    def __init__(self, pool: PagePool, max_num_seqs: int, max_prefill_tokens: int):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.ready: deque[Request] = deque()     # prefilled elsewhere, pages held: decode only
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def add_prefilled(self, req: Request) -> None:
        """A request whose prompt KV is already in its pages (imported by a decode worker):
        it joins the running batch at the next decode step with room for it."""
        req.num_computed = len(req.prompt_token_ids)
        self.ready.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.ready)

    def schedule(self) -> ScheduledBatch | None:
        """Pick this step's batch: unfinished prefills and new admissions first, else decode."""
        prefill = self._schedule_prefill()
        if prefill is not None:
            return prefill
        while self.ready and len(self.running) < self.max_num_seqs:
            req = self.ready.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
        if self.running:
            return ScheduledBatch(list(self.running), [1] * len(self.running), is_prefill=False)
        return None

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.max_prefill_tokens
        reqs, counts = [], []
        for req in self.running:
            if req.prefilling and budget > 0:
                n = min(budget, len(req.prompt_token_ids) - req.num_computed)
                reqs.append(req)
                counts.append(n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            need = self.pool.pages_for(req.reserved_tokens)
            if need > self.pool.num_free:
                break  # first come, first served: wait for pages to be freed
            self.waiting.popleft()
            self.pool.allocate(req.request_id, need)
            req.status = Status.RUNNING
            self.running.append(req)
            n = min(budget, len(req.prompt_token_ids))
            reqs.append(req)
            counts.append(n)
            budget -= n
        return ScheduledBatch(reqs, counts, is_prefill=True) if reqs else None

    def finish(self, req: Request, reason: str) -> None:
        """End a running or ready request and hand its pages back to the pool."""
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        else:
            self.ready.remove(req)
        self.pool.free(req.request_id)

    def detach(self, req: Request) -> None:
        """Take a request out of the batch, keeping its pages (a hand-off: the prefill side
        exports them and frees them once the push has ended)."""
        req.status = Status.FINISHED
        req.finish_reason = "handoff"
        self.running.remove(req)

    def remove(self, req: Request, reason: str = "abort") -> bool:
        """Drop a request wherever it is (finishing it with `reason` if it runs), freeing any
        pages it holds.  Returns whether it was here."""
        for queue in (self.waiting, self.ready):
            if req in queue:
                queue.remove(req)
                self.pool.free(req.request_id)
                req.status = Status.FINISHED
                return True
        if req in self.running:
            self.finish(req, reason)
            return True
        return False

    def abort_all(self) -> None:
        """Drop every request, returning all their pages (used when a step fails)."""
        for req in list(self.running):
            self.finish(req, "abort")
        for req in self.ready:
            self.pool.free(req.request_id)
        self.waiting.clear()
        self.ready.clear()
