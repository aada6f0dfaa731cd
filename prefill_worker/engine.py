"""The prefill side of a worker: a queue of prompts, batched and chunked prefill, first-token
sampling, and a `Pusher` per request that sends its pages while later layers still compute.

    submit() -> PrefillJob (a future)   queued; pages reserved for the prompt when admitted
    step()    one prefill step: for every request whose last chunk is in it, its pusher gets
              each layer group as soon as the forward pass has written it, then the commit
    pusher    reports when the push has been acknowledged or has failed; the loop then frees
              the request's pages (every page ownership change happens on the loop's thread,
              never while a forward pass may still write the pages)
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from decode_worker.messages import WorkerError, check_prompt
from engine import LLM
from engine.request import Request
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from kv_transfer.sender import TransferTicket
from kv_transfer.transport import TransportConfig
from prefill_worker.pusher import Pusher


@dataclass
class PrefillJob:
    req: Request                  # req.request_id: the pool owner of the prefill pages
    request_id: str               # the request's id (what the ownership tag binds)
    tenant: str
    endpoint: str
    transfer_id: bytes
    done: threading.Event = field(default_factory=threading.Event)
    error: WorkerError | None = None
    first_token: int = -1
    first_logprob: float = 0.0
    frames: int = 0
    pusher: Pusher | None = None


class PrefillEngine:
    def __init__(self, llm: LLM, secret: bytes, lock: threading.RLock, layer_group: int = 2,
                 transport: TransportConfig | None = None, faults=None, owner_suffix: str = ""):
        self.llm, self.pool, self.lock = llm, llm.pool, lock
        self.secret, self.layer_group = secret, layer_group
        self.transport = transport or TransportConfig()
        self.faults = faults                  # kv_transfer.faults.FaultInjector in chaos runs
        self.owner_suffix = owner_suffix      # colocated: prefill pages share the decode's pool
        self.scheduler = Scheduler(llm.pool, llm.config.max_num_seqs, llm.config.max_prefill_tokens,
                                   reserve_output=False)
        self.jobs: dict[str, PrefillJob] = {}
        self.closing = False
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()     # pushes ended, cancels
        self.wake = threading.Event()
        self.counts: Counter[str] = Counter()

    def submit(self, request_id: str, tenant: str, ids: list[int], params: SamplingParams,
               endpoint: str, transfer_id: bytes) -> PrefillJob:
        """Queue a prompt.  Raises WorkerError (INVALID_REQUEST, PROMPT_TOO_LONG) queuing nothing."""
        llm = self.llm
        if self.closing:
            raise WorkerError("UNAVAILABLE", "the worker is shutting down")
        check_prompt(ids, params, llm.model_config.vocab_size, llm.max_model_len,
                     self.pool.capacity_tokens, reserve_output=False)
        if params.seed is None:
            raise WorkerError("INVALID_REQUEST", "prefill needs the seed the decode worker's reservation gave")
        owner = request_id + self.owner_suffix
        req = Request(request_id=owner, prompt_token_ids=list(ids), params=params,
                      generator=torch.Generator().manual_seed(params.seed))
        job = PrefillJob(req, request_id, tenant, endpoint, transfer_id)
        with self.lock:
            if owner in self.jobs:
                raise WorkerError("INVALID_REQUEST", f"request id {request_id!r} is already being prefilled")
            self.jobs[owner] = job
            self.scheduler.add(req)
            self.counts["submitted"] += 1
        self.wake.set()
        return job

    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty()

    @property
    def queued_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) - r.num_computed for r in
                   list(self.scheduler.waiting) + list(self.scheduler.running))

    def step(self) -> bool:
        did = self._drain()
        with self.lock:
            batch = self.scheduler.schedule()
        if batch is None:
            return did
        last = [r for r, s in zip(batch.requests, batch.samples()) if s]   # last chunk in this step
        for req in last:
            self._start_push(self.jobs[req.request_id])
        groups = _GroupNotifier([self.jobs[r.request_id].pusher for r in last], self.layer_group,
                                len(self.llm.model.layers), self.pool.kv.device)
        try:
            output = self.llm.runner.run(batch, on_layer=groups if last else None)
        except BaseException as e:
            with self.lock:               # never schedule them again; pages freed at their ends
                for req in batch.requests:
                    if req in self.scheduler.running and self.jobs[req.request_id].pusher is not None:
                        self.scheduler.detach(req)
            for req in batch.requests:
                self._fail_before_push(req, WorkerError("INTERNAL", f"prefill step failed: {e!r}"))
            raise
        for req, token, lp in zip(batch.requests, output.tokens, output.logprobs):
            job = self.jobs.get(req.request_id)
            if token < 0 or job is None or job.done.is_set() or req not in self.scheduler.running:
                continue
            job.first_token = token
            job.first_logprob = lp[token] if lp else 0.0
            with self.lock:
                self.scheduler.detach(req)
            top = {t: v for t, v in lp.items() if t != token} if lp else None
            job.pusher.commit(token, job.first_logprob, top)
        return True

    def _start_push(self, job: PrefillJob) -> None:
        req = job.req
        ticket = TransferTicket(job.transfer_id, job.request_id, job.tenant)
        if req.params.logprobs is None:      # the first token's logprob travels in the commit
            req.params = _with_logprobs(req.params)
        job.pusher = Pusher(ticket, job.endpoint, self.secret, self.pool, self.pool.page_table(req.request_id),
                            len(req.prompt_token_ids), self.transport,
                            on_done=lambda err, frames: self._pushed(job, err, frames), faults=self.faults)

    def _pushed(self, job: PrefillJob, error: str | None, frames: int) -> None:
        """(Pusher thread) the push ended, acknowledged or failed."""
        self._inbox.put(("pushed", job, error, frames))
        self.wake.set()

    def cancel(self, request_id: str, why: str) -> None:
        """(RPC thread) the caller gave up: drop the job wherever it is."""
        self._inbox.put(("cancel", request_id + self.owner_suffix, why))
        self.wake.set()

    def _drain(self) -> bool:
        did = False
        while not self._inbox.empty():
            item = self._inbox.get()
            did = True
            if item[0] == "pushed":
                _, job, error, frames = item
                job.frames = frames
                self._finish(job, WorkerError("TRANSFER_FAILED", error) if error else None)
            else:
                job = self.jobs.get(item[1])
                if job is None:
                    continue
                if job.pusher is not None:
                    job.pusher.cancel(item[2])          # its "pushed" report finishes the job
                else:
                    self._finish(job, WorkerError("CANCELLED", item[2]))
        return did

    def _finish(self, job: PrefillJob, error: WorkerError | None) -> None:
        """Free the job's prefill pages and answer its caller (on the loop's thread)."""
        if job.done.is_set():
            return
        with self.lock:
            if not self.scheduler.remove(job.req):
                self.pool.free(job.req.request_id)
            self.jobs.pop(job.req.request_id, None)
        job.error = error
        self.counts["failed" if error else "pushed"] += 1
        job.done.set()

    def _fail_before_push(self, req: Request, error: WorkerError) -> None:
        job = self.jobs.get(req.request_id)
        if job is not None and job.pusher is not None:
            job.pusher.cancel(error.message)
        elif job is not None:
            self._finish(job, error)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """(The loop stopped) cancel every job and wait, bounded, for their pushers to end."""
        for job in list(self.jobs.values()):
            self.cancel(job.request_id, "worker shutting down")
        end = time.monotonic() + timeout_s
        while True:
            self._drain()
            if not self.jobs or time.monotonic() > end:
                return
            self.wake.wait(0.01)
            self.wake.clear()


def _with_logprobs(params: SamplingParams) -> SamplingParams:
    return replace(params, logprobs=0)


class _GroupNotifier:
    """The forward pass's per-layer hook: every `group` layers (and after the last), tell each
    pusher that those layers are in the pool (with a CUDA event to wait on, on a GPU)."""

    def __init__(self, pushers: list[Pusher], group: int, num_layers: int, device: torch.device):
        self.pushers, self.group, self.num_layers = pushers, group, num_layers
        self.cuda = device.type == "cuda"
        self.start = 0

    def __call__(self, layer: int) -> None:
        if (layer + 1) % self.group and layer + 1 != self.num_layers:
            return
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        for p in self.pushers:
            p.layers(self.start, layer + 1, event)
        self.start = layer + 1
