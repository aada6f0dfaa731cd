"""The prefill role of a worker: a queue of prompts (hand-off requests of the worker's
`EngineCore`, batched and chunked by its scheduler), first-token sampling, and a `Pusher` per
request that sends its pages while later layers still compute.

    submit(order) -> PrefillJob (a future)  queued; pages reserved for the prompt when admitted,
                the leading ones shared from this worker's prefix cache (salted with the tenant
                and the request's cache_salt) and not computed again
    before_run  for every request whose last chunk is in the batch, start its pusher (pages
                after the decode worker's `cached_tokens`); the forward pass's layer hook hands
                it each layer group as soon as it is written
    after_run   the token path detached the request after its first token (pages kept):
                the pusher commits with it
    handle_inbox  a push ended (acknowledged or failed): the request's pages are released here,
                on the loop's thread, never while a forward pass may still write them

A migrated request's prompt comes with the tokens it generated before: their KV is computed
and pushed with the prompt's, and the token sampled is the next one (the seed's generator past
their draws).  While draining (worker/drain.py) submit() refuses with DRAINING; a drain's end
cancels the jobs left (their callers get DRAINING).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from engine.core import EngineCore, LayerHook, TokenEvent
from engine.errors import ErrorCode
from engine.request import Request
from engine.scheduler import ScheduledBatch
from kv_transfer.hooks import TransferHooks
from kv_transfer.sender import TransferTicket
from kv_transfer.transport import TransportConfig
from prefill_worker.pusher import Pusher, PushPlan
from worker.checks import check_cached_tokens, check_request_id, new_request, request_salt
from worker.handoff import PrefillOrder
from worker.role import RoleEngine
from worker.types import WorkerError


@dataclass
class PrefillJob:
    order: PrefillOrder
    req: Request                  # req.request_id: the pool owner of the prefill pages
    done: threading.Event = field(default_factory=threading.Event)
    error: WorkerError | None = None
    first_token: int = -1
    first_logprob: float = 0.0
    frames: int = 0
    pusher: Pusher | None = None
    cancelled: ErrorCode | None = None     # the code it ends with once its cancelled push has ended

    @property
    def request_id(self) -> str:
        """The client's request id (the order's)."""
        return self.order.request_id


@dataclass(frozen=True)
class Pushed:
    """(pusher thread) the push of `job` ended: `error` None when acknowledged."""
    job: PrefillJob
    error: str | None
    frames: int


@dataclass(frozen=True)
class CancelJob:
    """(RPC thread) the caller gave up on the job of pool owner `owner` (or a drain ends it:
    `code` DRAINING)."""
    owner: str
    why: str
    code: ErrorCode | None = None          # None: CANCELLED (a push under way: TRANSFER_FAILED)


class PrefillEngine(RoleEngine[Pushed | CancelJob]):
    """The prefill role (worker/role.py): it releases a job's pages once its push has ended."""

    def __init__(self, core: EngineCore, secret: bytes, lock: threading.RLock, wake: threading.Event,
                 peers: Callable[[str], bool], layer_group: int, transport: TransportConfig | None = None,
                 owner_suffix: str = ""):
        """`peers(endpoint)`: whether a push to that decode endpoint is allowed (worker/peers.py);
        `layer_group`: a push sends every that many layers as they are computed
        (WorkerSettings.layer_group)."""
        super().__init__(core, lock, wake)
        self.peers = peers
        self.secret, self.layer_group = secret, layer_group
        self.transport = transport or TransportConfig()
        self.hooks = TransferHooks()          # the sender's hooks (install_hooks)
        self.owner_suffix = owner_suffix      # colocated: prefill pages share the decode's pool
        self.jobs: dict[str, PrefillJob] = {}   # by pool owner (request id + owner_suffix)

    def install_hooks(self, hooks: TransferHooks) -> None:
        """Send every later push through `hooks.sender` (kv_transfer.hooks)."""
        self.hooks = hooks

    # ---- called from RPC threads -------------------------------------------------
    def submit(self, order: PrefillOrder) -> PrefillJob:
        """Queue the order's prompt.  Its pages found in this worker's prefix cache (salted
        with the tenant and `order.cache_salt`) are not computed again; the push sends the pages
        after the decode worker's `order.cached_tokens` (a multiple of the page size, below the
        prompt's length).  `order.generated_token_ids` (a migrated request): the tokens it
        generated before; their KV is computed and pushed with the prompt's (the order's digest
        binds the boundary) and the token sampled is the next one, with the seed's generator
        past their draws.  Raises WorkerError (INVALID_REQUEST, PROMPT_TOO_LONG, UNKNOWN_PEER,
        DRAINING, UNAVAILABLE) queuing nothing."""
        core = self.core
        self._check_admitting()
        self._check_order(order)
        salt = request_salt(self.secret, order.tenant, order.cache_salt)
        owner = order.request_id + self.owner_suffix
        # its generator: the seed's, past the generated tokens' draws
        req = new_request(core, owner, list(order.prompt_token_ids), order.params, handoff=True, salt=salt,
                          generated=order.generated_token_ids)
        check_cached_tokens(order.cached_tokens, len(req.prompt_token_ids), self.pool.page_size)
        job = PrefillJob(order, req)
        with self.lock:
            self._check_admitting()               # under the lock: a drain admits nothing after it began
            if owner in self.jobs:
                raise WorkerError(ErrorCode.INVALID_REQUEST,
                                  f"request id {order.request_id!r} is already being prefilled")
            self.jobs[owner] = job
            core.add(req)
            self.counts["submitted"] += 1
        self.wake.set()
        return job

    def _check_order(self, order: PrefillOrder) -> None:
        """Raises WorkerError (INVALID_REQUEST, UNKNOWN_PEER) for a bad request id, a decode
        endpoint not of this deployment, or an order without the reservation's seed."""
        check_request_id(order.request_id)
        if order.params.prefill_only:       # the prompt's logprobs only: nothing is pushed anywhere
            if order.decode_endpoint or order.transfer_id or order.generated_token_ids:
                raise WorkerError(ErrorCode.INVALID_REQUEST, "a prefill-only order (max_tokens 0) has no decode "
                                  "endpoint, transfer or generated tokens")
            return
        endpoint = order.decode_endpoint
        if not self.peers(endpoint):
            self.counts["unknown_peer"] += 1
            raise WorkerError(ErrorCode.UNKNOWN_PEER, f"decode endpoint {endpoint[:200]!r} is not a decode worker "
                              "of this deployment: prefill pushes only to the registry's (or --decode-peer) endpoints")
        if order.params.seed is None:
            raise WorkerError(ErrorCode.INVALID_REQUEST, "prefill needs the seed the decode worker's reservation gave")

    def cancel(self, request_id: str, why: str) -> None:
        """The caller gave up: drop the job wherever it is."""
        self._post(CancelJob(request_id + self.owner_suffix, why))

    # ---- draining (worker/drain.py) ------------------------------------------------
    def live(self) -> list[str]:
        """The request ids of its jobs not ended (queued, prefilling or pushing)."""
        with self.lock:
            return [job.request_id for job in self.jobs.values()]

    def end_live(self, code: ErrorCode, message: str) -> int:
        """End every job with `code` (a push under way is cancelled first; its pages are freed
        once it has ended).  Returns how many it asked to end."""
        with self.lock:
            owners = list(self.jobs)
        for owner in owners:
            self._post(CancelJob(owner, message, code))
        return len(owners)

    @property
    def queued_tokens(self) -> int:
        return sum(len(j.req.prompt_token_ids) - j.req.num_computed for j in list(self.jobs.values())
                   if j.pusher is None)

    # ---- the loop's side (RoleEngine) ------------------------------------------------
    def _handle(self, item: Pushed | CancelJob) -> None:
        """A push ended (its job finishes), or a caller gave up (a job not pushing yet finishes;
        a push under way is cancelled, and its Pushed report finishes the job)."""
        if isinstance(item, Pushed):
            item.job.frames = item.frames
            code = item.job.cancelled or ErrorCode.TRANSFER_FAILED
            self._finish(item.job, WorkerError(code, item.error) if item.error else None)
            return
        job = self.jobs.get(item.owner)
        if job is None:
            return
        if job.pusher is not None:
            job.cancelled = job.cancelled or item.code
            job.pusher.cancel(item.why)
        else:
            self._finish(job, WorkerError(item.code or ErrorCode.CANCELLED, item.why))

    def before_run(self, batch: ScheduledBatch) -> LayerHook | None:
        """Start the push of every job whose last prompt chunk is in this batch."""
        last = [self.jobs[r.request_id] for r, s in zip(batch.requests, batch.samples())
                if s and r.request_id in self.jobs and self.jobs[r.request_id].req is r
                and not r.params.prefill_only]
        for job in last:
            self._start_push(job)
        if not last:
            return None
        return _GroupNotifier([j.pusher for j in last if j.pusher is not None], self.layer_group,
                              len(self.core.model.layers), self.pool.kv.device)

    def after_run(self, events: list[TokenEvent]) -> None:
        """The first token of a finished prompt: the pusher commits with it (a prefill-only order
        ends here: its pages go back)."""
        for event in events:
            job = self.jobs.get(event.req.request_id)
            if job is None or job.req is not event.req:
                continue
            if event.token < 0:                  # a prefill-only order: its prompt is computed
                self._finish(job, None)
                continue
            if job.pusher is None:
                continue
            job.first_token = event.token
            lp = event.logprobs
            job.first_logprob = lp[event.token] if lp else 0.0
            top = {t: v for t, v in lp.items() if t != event.token} if lp else None
            job.pusher.commit(event.token, job.first_logprob, top)

    def fail(self, batch: ScheduledBatch, error: BaseException) -> None:
        """Never schedule this role's requests of the batch again; pages are freed at their ends."""
        werr = WorkerError(ErrorCode.INTERNAL, f"prefill step failed: {error!r}")
        for req in batch.requests:
            job = self.jobs.get(req.request_id)
            if job is None or job.req is not req:
                continue
            if job.pusher is not None:
                with self.lock:                     # pages kept until the push has ended
                    self.core.detach(req)
                job.pusher.cancel(werr.message)
            else:
                self._finish(job, werr)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """(The loop stopped) cancel every job and wait, bounded, for their pushers to end."""
        for job in list(self.jobs.values()):
            self.cancel(job.request_id, "worker shutting down")
        end = time.monotonic() + timeout_s
        while True:
            self.handle_inbox()
            if not self.jobs or time.monotonic() > end:
                return
            self.wake.wait(0.01)
            self.wake.clear()

    # ---- internals -----------------------------------------------------------------
    def _start_push(self, job: PrefillJob) -> None:
        req, order = job.req, job.order
        ticket = TransferTicket(order.transfer_id, order.request_id, order.tenant, order.digest)
        if req.params.logprobs is None:      # the first token's logprob travels in the commit
            req.params = replace(req.params, logprobs=0)
        prompt = req.num_prompt_tokens           # the prompt's lookups, not a migrated request's generated
        self.cache.count(prompt, min(req.num_cached_tokens, prompt))
        plan = PushPlan(ticket, order.decode_endpoint, self.secret, self.pool, self.pool.page_table(req.request_id),
                        len(req.prompt_token_ids), self.transport, self.hooks.sender,
                        cached_tokens=order.cached_tokens)
        job.pusher = Pusher(plan, on_done=lambda err, frames: self._post(Pushed(job, err, frames)))

    def _finish(self, job: PrefillJob, error: WorkerError | None) -> None:
        """Release the job's prefill pages and answer its caller (on the loop's thread)."""
        if job.done.is_set():
            return
        with self.lock:
            self.core.release(job.req)          # queued, running or detached after its push
            self.jobs.pop(job.req.request_id, None)
        job.error = error
        if error is None:
            self.counts["prefilled_only" if job.req.params.prefill_only else "pushed"] += 1
        else:
            self._count_failed(error)
        job.done.set()


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
