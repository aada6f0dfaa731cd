"""The decode role of a worker: reservations, imports through the transfer receiver, and the
tokens of the continuous-batching loop streamed to each request's caller.  It shares the
worker's `EngineCore` (model, pool, the one scheduler) and lock with a colocated prefill role.

A request's life here:

    reserve()    pages for prompt + max_tokens, the leading ones shared from the prefix cache
                 when its tenant's salted keys match; a receiver reservation for the rest
                 (frames only for the pages after the cached prefix)       -> Reservation event
    commit       (receiver callback, posted) the transfer is released, the received prompt
                 pages are published to the cache, and the request joins the core with
                 prefill's first token                                     -> Tokens event
    after_run    the core's token path appended a token                    -> Tokens; Finish at a stop
                 (a stop check past its budget: the core freed the pages)  -> Error INVALID_REQUEST
                 (a token its grammar refuses, e.g. a first token from a
                 prefill peer that ignored it: pages freed, never streamed) -> Error INTERNAL
    any failure  (abort, failed or expired transfer, failed step, a drain's end): receiver.release,
                 then the pages are freed (a transfer that never committed publishes nothing)
                                                                           -> Error event

A migrated request (`GenerateOrder.generated_token_ids`: the tokens it streamed before) is
reserved for the KV of its prompt and those tokens, with its stop checks replayed over them and
its generator past their draws, so the stream continues as if never broken; when they already
end it, reserve() returns its Finish and reserves nothing.  While draining (worker/drain.py), reserve() refuses with
DRAINING.
"""

from __future__ import annotations

import hmac
import math
import secrets
import threading

from decode_worker.requests import Abort, Committed, DecodeRequest, InboxItem, TransferFailed, decode_generator
from engine.core import EngineCore, TokenEvent
from engine.errors import ErrorCode
from engine.kv_pool import PoolExhausted
from engine.request import Request
from engine.scheduler import ScheduledBatch
from kv_transfer.frame import prompt_digest
from kv_transfer.hooks import TransferHooks
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import State
from proto import worker_pb2 as wpb
from worker.checks import check_request_id, new_request, request_salt
from worker.config import MAX_REQUEST_TIMEOUT_S
from worker.convert import finish_to_proto, logprobs_to_proto
from worker.handoff import GenerateOrder
from worker.role import RoleEngine
from worker.types import WorkerError


class DecodeEngine(RoleEngine[InboxItem]):
    """The decode role (worker/role.py): it releases a request it ends itself, after its
    transfer's `TransferReceiver.release`, admitted or not."""

    def __init__(self, core: EngineCore, secret: bytes, transfer_timeout_s: float, lock: threading.RLock,
                 wake: threading.Event, max_timeout_s: float = MAX_REQUEST_TIMEOUT_S):
        super().__init__(core, lock, wake)
        self.max_timeout_s = max_timeout_s    # a caller's timeout_s above this is clamped to it
        self.secret = secret                  # salts each tenant's prefix cache keys
        self.receiver = TransferReceiver(core.pool, secret, transfer_timeout_s,
                                         on_failed=lambda r: self._post(TransferFailed(r.request_id, r.transfer_id)),
                                         on_committed=lambda r: self._post(Committed(r.request_id, r.transfer_id)))
        self.requests: dict[str, DecodeRequest] = {}

    def install_hooks(self, hooks: TransferHooks) -> None:
        """Route every later frame this worker receives through `hooks.receiver`."""
        self.receiver.install_hooks(hooks.receiver)

    # ---- called from RPC threads -------------------------------------------------
    def reserve(self, order: GenerateOrder) -> DecodeRequest | wpb.Finish:
        """Check the order, reserve its pages and open its transfer.  The longest prefix of
        whole prompt pages cached under the request's salt (its tenant and `cache_salt`) is
        shared, not transferred: `reservation.cached_tokens`.  `order.timeout_s` (None: the
        receiver's transfer timeout) is how long the reservation waits for a frame; above
        `max_timeout_s` (infinity included) it is clamped to it.

        `order.generated_token_ids` (a migrated request, with `params.seed` its first
        reservation's): the tokens it streamed before.  The transfer carries the KV of the
        prompt and them (its digest binds the boundary), the stop checks replay them and the
        stream goes on after them.  When they already end the request, returns its Finish,
        reserving nothing.

        Raises WorkerError (INVALID_REQUEST, PROMPT_TOO_LONG, KV_FULL, DRAINING, UNAVAILABLE)
        having reserved nothing."""
        self._check_admitting()
        timeout_s = self._timeout(order.timeout_s)
        check_request_id(order.request_id)
        order = self._seeded(order)
        req = new_request(self.core, order.request_id, list(order.prompt_token_ids), order.params,
                          generator=decode_generator(order.params, len(order.generated_token_ids)),
                          salt=request_salt(self.secret, order.tenant, order.cache_salt),
                          generated=order.generated_token_ids)
        if req.finish_reason is not None:         # the generated tokens already end it
            return self._finished_already(req)
        digest = prompt_digest(req.prompt_token_ids, req.resumed)   # ids checked by new_request; hashed
        with self.lock:                                             # outside the lock
            dreq = self._reserve(order, req, digest, timeout_s)
        self.cache.count(req.num_prompt_tokens, dreq.cached_prompt_tokens)   # the prompt's lookups only
        return dreq

    def _timeout(self, timeout_s: float | None) -> float | None:
        """The reservation's timeout: None (the receiver's), or the caller's clamped to
        `max_timeout_s`; raises WorkerError(INVALID_REQUEST) unless it is > 0."""
        if timeout_s is None:
            return None
        if math.isnan(timeout_s) or timeout_s <= 0:
            raise WorkerError(ErrorCode.INVALID_REQUEST, f"timeout_s={timeout_s} must be > 0")
        return min(timeout_s, self.max_timeout_s)

    @staticmethod
    def _seeded(order: GenerateOrder) -> GenerateOrder:
        """The order with its sampler's seed: a new one for a first reservation (prefill gets it
        with the reservation); raises WorkerError(INVALID_REQUEST) for a resumed request
        without its first reservation's."""
        if order.params.seed is not None:
            return order
        if order.generated_token_ids:
            raise WorkerError(ErrorCode.INVALID_REQUEST,
                              "a resumed request (generated tokens) needs the seed of its first reservation")
        return order.with_seed(secrets.randbits(63))

    def _finished_already(self, req: Request) -> wpb.Finish:
        """The Finish of a migrated request its generated tokens already end (nothing reserved)."""
        assert req.stopper is not None and req.finish_reason is not None
        with self.lock:
            self.counts["finished"] += 1
        return finish_to_proto(req.finish_reason, req.stopper.matched_stop, req.num_prompt_tokens,
                               req.num_completion_tokens)

    def _reserve(self, order: GenerateOrder, req: Request, digest: bytes, timeout_s: float | None) -> DecodeRequest:
        """(Under the lock.)  Reserve the pages of `req` (its cached prefix shared) and the
        receiver's transfer into them, and record the request.  Raises WorkerError (DRAINING,
        INVALID_REQUEST, KV_FULL) having reserved nothing."""
        self._check_admitting()               # under the lock: a drain admits nothing after it began
        rid = order.request_id
        if rid in self.requests or self.pool.has(rid):
            raise WorkerError(ErrorCode.INVALID_REQUEST, f"request id {rid!r} is already in use")
        try:
            cached = self.core.allocate_for(req, req.max_total_tokens)
        except PoolExhausted as e:
            raise WorkerError(ErrorCode.KV_FULL, str(e)) from None
        try:       # the transfer carries the KV of prompt + generated
            res = self.receiver.reserve(rid, order.tenant, len(req.prompt_token_ids), digest, timeout_s,
                                        cached_tokens=cached)
        except ValueError as e:
            self.core.release(req)            # nothing stays reserved, nothing is published
            raise WorkerError(ErrorCode.INVALID_REQUEST, str(e)) from None
        dreq = self.requests[rid] = DecodeRequest(order, req, res, reserved_pages=len(self.pool.page_table(rid)))
        self.counts["reserved"] += 1
        return dreq

    def abort(self, request_id: str, code: ErrorCode = ErrorCode.ABORTED, message: str = "request aborted",
              transfer_id: bytes | None = None) -> bool:
        """End a request wherever it is (cancelled stream, Abort RPC).  With `transfer_id` (an
        outside caller) only if it is the request's reservation's, compared in constant time.
        Returns whether it was live (and the id matched); changes nothing otherwise."""
        with self.lock:
            dreq = self.requests.get(request_id)
            live = dreq is not None and not dreq.done and (
                transfer_id is None or hmac.compare_digest(transfer_id, dreq.reservation.transfer_id))
        if live:
            self._post(Abort(request_id, code, message))
        return live

    # ---- draining (worker/drain.py) ------------------------------------------------
    def live(self) -> list[str]:
        """Requests reserved here and not ended (waiting for their transfer, or decoding)."""
        with self.lock:
            return [rid for rid, d in self.requests.items() if not d.done]

    def end_live(self, code: ErrorCode, message: str) -> int:
        """End every live request with `code` (on the loop's thread: its transfer released, its
        pages freed, committed or not).  Returns how many it asked to end."""
        return sum(self.abort(rid, code, message) for rid in self.live())

    # ---- the loop's side (RoleEngine) ------------------------------------------------
    def handle_inbox(self) -> bool:
        """Expire idle transfers (their failures are posted), then handle commits, failures
        and aborts."""
        self.receiver.expire()
        return super().handle_inbox()

    def _handle(self, item: InboxItem) -> None:
        dreq = self.requests.get(item.request_id)
        if dreq is None or dreq.done:
            return
        if isinstance(item, (Committed, TransferFailed)) and item.transfer_id != dreq.reservation.transfer_id:
            return                            # about an earlier request that had this id
        if isinstance(item, Committed):
            self._admit(dreq)
        elif isinstance(item, TransferFailed):
            r = dreq.reservation
            reason = r.reason.value if r.reason is not None else "failed"
            self._end(dreq, WorkerError(ErrorCode.TRANSFER_FAILED, f"{reason}: {r.detail}"))
        else:
            self._end(dreq, WorkerError(item.code, item.message))

    def after_run(self, events: list[TokenEvent]) -> None:
        for event in events:
            dreq = self.requests.get(event.req.request_id)
            if dreq is not None and dreq.req is event.req:
                self._stream(dreq, event)

    def fail(self, batch: ScheduledBatch, error: BaseException) -> None:
        for req in batch.requests:
            dreq = self.requests.get(req.request_id)
            if dreq is not None and dreq.req is req:
                self._end(dreq, WorkerError(ErrorCode.INTERNAL, f"decode step failed: {error!r}"))

    def shutdown(self, message: str = "worker shutting down") -> None:
        """End every live request with an explicit error and release all their pages."""
        for dreq in list(self.requests.values()):
            self._end(dreq, WorkerError(ErrorCode.UNAVAILABLE, message))

    # ---- internals -----------------------------------------------------------------
    def _admit(self, dreq: DecodeRequest) -> None:
        """The transfer committed: the prompt's KV is in place; the first token came with it.
        The transfer is over, so its reservation is released (no write can still land) and the
        request's pages belong to the core's token path from here on."""
        res, req = dreq.reservation, dreq.req
        assert res.state == State.COMMITTED, f"{req.request_id}: admitted with transfer {res.state}"
        assert res.first_token_id is not None and res.first_logprob is not None
        lp: dict[int, float] | None = None
        if req.params.logprobs is not None:
            lp = {res.first_token_id: res.first_logprob, **res.first_top}
        with self.lock:
            self.receiver.release(res.transfer_id)
            event = self.core.add_prefilled(req, res.first_token_id, lp)
        self._stream(dreq, event)

    def _stream(self, dreq: DecodeRequest, event: TokenEvent) -> None:
        """Send the token (and the text that became safe to show) to the caller; the finish
        with the usage when the token path ended the request (its pages are already free), or
        the error when its stop check ran past the budget (nothing more of it is sent)."""
        req = dreq.req
        assert req.stopper is not None
        if event.finish_reason == "error":
            assert req.stopper.error is not None
            # the grammar refused a token (the first one came from the prefill peer): a fault on
            # the serving side, never the client's; the grammar past one of its limits (a schema
            # whose recursion cannot end) and a stop check past its budget: the client's
            g = req.guide
            refused = g is not None and g.error is not None and not g.grammar_fault
            code = ErrorCode.INTERNAL if refused else ErrorCode.INVALID_REQUEST
            self._ended(dreq, WorkerError(code, req.stopper.error))
            return
        msg = wpb.Tokens(token_ids=[event.token], text=req.stopper.delta())
        if event.logprobs is not None:
            msg.logprobs.append(logprobs_to_proto(event.token, event.logprobs))
        dreq.events.put(wpb.GenerateResponse(tokens=msg))
        if event.finish_reason is None:
            return
        with self.lock:
            dreq.done = True
            del self.requests[req.request_id]
        self.counts["finished"] += 1
        dreq.events.put(wpb.GenerateResponse(finish=finish_to_proto(
            event.finish_reason, req.stopper.matched_stop, req.num_prompt_tokens,
            req.num_completion_tokens, dreq.cached_prompt_tokens)))

    def _end(self, dreq: DecodeRequest, error: WorkerError) -> None:
        """Fail a request: release its transfer (waits for in-flight writes), then its pages,
        then tell the stream."""
        if dreq.done:
            return
        req = dreq.req
        with self.lock:
            self.receiver.release(dreq.reservation.transfer_id)
            self.core.release(req)      # admitted: publishes what it computed; reserved: nothing
            self._ended(dreq, error)

    def _ended(self, dreq: DecodeRequest, error: WorkerError) -> None:
        """The request's pages are free: forget it and send its error."""
        with self.lock:
            dreq.done = True
            del self.requests[dreq.req.request_id]
        self._count_failed(error)
        dreq.events.put(wpb.GenerateResponse(error=error.to_proto()))
