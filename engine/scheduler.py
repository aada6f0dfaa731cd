"""Continuous batching: a waiting queue, a running batch, and page reservations.

Each step is either a prefill step (admit waiting requests, compute their prompts,
chunked when long) or a decode step (one token for every running request).  A
request's pages are reserved for prompt + max_tokens when it is admitted (a hand-off
request, prefilled for another worker: its prompt only), so no request is ever evicted
mid-stream; requests join and leave the running batch at every step.

Hand-off requests and the rest have `max_num_seqs` slots each: a worker that prefills for
others and decodes its own (colocated) never lets one kind hold the other's places.  With
`interleave`, a prefill step is followed by a decode step whenever there is decoding to do,
so arriving prompts cannot starve the running streams (a colocated worker); without it
prefill always goes first (the single-process engine, a prefill worker, a decode worker).

Prefix cache: admission (`allocate`) gives a request the longest cached prefix of its prompt
(never its last token) and starts its prefill after it; `publish` turns its full computed
pages into cached ones, once when its prompt is complete and again when it ends, before its
pages are released (every path out of the scheduler but `abort_all`, a failed step).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.kv_pool import PagePool, PoolExhausted
from engine.prefix_cache import max_cached_pages, page_keys
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

    def __init__(self, pool: PagePool, max_num_seqs: int, max_prefill_tokens: int, interleave: bool = False):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.interleave = interleave
        self._last_was_prefill = False
        self.waiting: deque[Request] = deque()
        self.ready: deque[Request] = deque()     # prefilled elsewhere, pages held: decode only
        self.running: list[Request] = []
        self.cache_query_tokens = 0              # prompt tokens looked up at admission
        self.cache_hit_tokens = 0                # of those, found cached

    def allocate(self, req: Request, reserved_tokens: int) -> int:
        """Give `req` (holding no pages) pages for `reserved_tokens`: the longest cached prefix of
        its prompt (salted with `req.cache_salt`, never its last token), then private pages.
        Sets `num_computed` and `num_cached_tokens` to the cached tokens and returns them.
        Raises PoolExhausted (ValueError if it holds pages), changing nothing."""
        size = self.pool.page_size
        prompt = req.prompt_token_ids
        # a request that asks for its prompt's logprobs computes every prompt token: no cached prefix
        keys = page_keys(req.cache_salt, prompt[:max_cached_pages(len(prompt), size) * size], size) \
            if self.pool.enable_prefix_cache and req.params.prompt_logprobs is None else []
        cached = self.pool.allocate_prefixed(req.request_id, self.pool.pages_for(reserved_tokens),
                                             keys, req.cache_salt) * size
        req.num_computed = req.num_cached_tokens = cached
        self.cache_query_tokens += len(prompt)
        self.cache_hit_tokens += cached
        return cached

    def publish(self, req: Request) -> int:
        """Publish every full page of `req`'s computed tokens into the prefix cache (pages
        already cached, or whose content another page holds, are skipped).  Returns how many."""
        if not self.pool.enable_prefix_cache or not self.pool.has(req.request_id):
            return 0
        size = self.pool.page_size
        full = req.num_computed // size * size
        tokens = [req.token_at(i) for i in range(full)]
        return self.pool.publish(req.request_id, page_keys(req.cache_salt, tokens, size), req.cache_salt)

    def _release(self, req: Request) -> None:
        """Publish its computed pages, then hand all its pages back to the pool."""
        self.publish(req)
        self.pool.free(req.request_id)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def add_prefilled(self, req: Request) -> None:
        """A request whose prompt KV is already in its pages (imported by a decode worker):
        it joins the running batch at the next decode step with room for it."""
        req.num_computed = len(req.prompt_token_ids)
        self.publish(req)
        self.ready.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.ready)

    def schedule(self) -> ScheduledBatch | None:
        """Pick this step's batch: unfinished prefills and new admissions first, else decode
        (with `interleave`, decode first right after a prefill step)."""
        batch = None
        if self.interleave and self._last_was_prefill:
            batch = self._schedule_decode()
        batch = batch or self._schedule_prefill() or self._schedule_decode()
        self._last_was_prefill = batch is not None and batch.is_prefill
        return batch

    def _slots(self, handoff: bool) -> int:
        """Running requests of one kind (hand-off or not): each kind has max_num_seqs places."""
        return sum(r.handoff == handoff for r in self.running)

    def _schedule_decode(self) -> ScheduledBatch | None:
        while self.ready and self._slots(False) < self.max_num_seqs:
            req = self.ready.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
        decoding = [r for r in self.running if not r.prefilling]
        if decoding:
            return ScheduledBatch(decoding, [1] * len(decoding), is_prefill=False)
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
        while self.waiting and budget > 0 and self._slots(self.waiting[0].handoff) < self.max_num_seqs:
            req = self.waiting[0]
            try:
                self.allocate(req, req.reserved_tokens)
            except PoolExhausted:
                break  # first come, first served: wait for pages to be freed
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            n = min(budget, len(req.prompt_token_ids) - req.num_computed)
            reqs.append(req)
            counts.append(n)
            budget -= n
        return ScheduledBatch(reqs, counts, is_prefill=True) if reqs else None

    def finish(self, req: Request, reason: str, publish: bool = True) -> None:
        """End a running or ready request and hand its pages back to the pool (publishing its
        computed pages first, unless `publish` is False)."""
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        else:
            self.ready.remove(req)
        if publish:
            self._release(req)
        else:
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
                self._release(req)
                req.status = Status.FINISHED
                return True
        if req in self.running:
            self.finish(req, reason)
            return True
        return False

    def abort_all(self) -> None:
        """Drop every request, returning all their pages (used when a step fails: nothing is
        published, the pages' contents are not trusted)."""
        for req in list(self.running):
            self.finish(req, "abort", publish=False)
        for req in self.ready:
            self.pool.free(req.request_id)
        self.waiting.clear()
        self.ready.clear()
