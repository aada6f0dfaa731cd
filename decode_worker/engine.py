"""The decode side of a worker: reservations, imports through the transfer receiver, and
the continuous-batching loop.  It shares the engine (`LLM`: model, pool, runner) and one
lock with a colocated prefill engine, if any.

A request's life here:

    reserve()  pages for prompt + max_tokens, a receiver reservation   -> Reservation event
    commit     (receiver callback) first token from prefill; joins the batch
    step()     one decode token per running request; Tokens events; Finish at a stop
    any end    (finish, abort, failed or expired transfer): receiver.release, then pool.free
"""

from __future__ import annotations

import queue
import secrets
import threading
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from decode_worker.messages import WorkerError, check_prompt, finish_to_proto, logprobs_to_proto
from engine import LLM
from engine.kv_pool import PoolExhausted
from engine.request import Request
from engine.scheduler import Scheduler
from engine.sampling import SamplingParams
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import Reservation
from proto import worker_pb2 as wpb


@dataclass
class DecodeRequest:
    req: Request
    tenant: str
    reservation: Reservation
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)   # GenerateResponse
    done: bool = False
    reserved_pages: int = 0


class DecodeEngine:
    def __init__(self, llm: LLM, secret: bytes, transfer_timeout_s: float, lock: threading.RLock,
                 faults=None):
        self.llm, self.pool, self.lock = llm, llm.pool, lock
        self.scheduler = Scheduler(llm.pool, llm.config.max_num_seqs, llm.config.max_prefill_tokens)
        self.receiver = TransferReceiver(llm.pool, secret, transfer_timeout_s,
                                         on_failed=lambda r: self._post("failed", r.request_id, r.transfer_id),
                                         on_committed=lambda r: self._post("commit", r.request_id, r.transfer_id),
                                         faults=faults)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.requests: dict[str, DecodeRequest] = {}
        self.closing = False
        self.counts: Counter[str] = Counter()

    # ---- called from RPC threads -------------------------------------------------
    def reserve(self, request_id: str, tenant: str, ids: list[int], params: SamplingParams,
                timeout_s: float | None = None) -> DecodeRequest:
        """Check the request, reserve its pages and open its transfer.  Raises WorkerError
        (INVALID_REQUEST, PROMPT_TOO_LONG, KV_FULL) having reserved nothing."""
        llm = self.llm
        if self.closing:
            raise WorkerError("UNAVAILABLE", "the worker is shutting down")
        if timeout_s is not None and timeout_s <= 0:
            raise WorkerError("INVALID_REQUEST", f"timeout_s={timeout_s} must be > 0")
        if params.seed is None:
            params = replace(params, seed=secrets.randbits(63))   # prefill gets it with the reservation
        check_prompt(ids, params, llm.model_config.vocab_size, llm.max_model_len, self.pool.capacity_tokens)
        with self.lock:
            if request_id in self.requests or self.pool.has(request_id):
                raise WorkerError("INVALID_REQUEST", f"request id {request_id!r} is already in use")
            try:
                self.pool.allocate(request_id, self.pool.pages_for(len(ids) + params.max_tokens))
            except PoolExhausted as e:
                raise WorkerError("KV_FULL", str(e)) from None
            try:
                res = self.receiver.reserve(request_id, tenant, len(ids), timeout_s)
            except ValueError as e:
                self.pool.free(request_id)            # nothing stays reserved
                raise WorkerError("INVALID_REQUEST", str(e)) from None
            req = Request(request_id=request_id, prompt_token_ids=list(ids), params=params,
                          generator=decode_generator(params), stopper=llm.stop_checker(params))
            dreq = self.requests[request_id] = DecodeRequest(req, tenant, res)
            dreq.reserved_pages = len(self.pool.page_table(request_id))
            self.counts["reserved"] += 1
        return dreq

    def abort(self, request_id: str, code: str = "ABORTED", message: str = "request aborted") -> bool:
        """End a request wherever it is (cancelled stream, Abort RPC).  Returns whether it was live."""
        with self.lock:
            live = request_id in self.requests and not self.requests[request_id].done
        if live:
            self._post("abort", request_id, code, message)
        return live

    def _post(self, *item) -> None:
        """Hand an event to the loop's thread (receiver callbacks, aborts) and wake it."""
        self._inbox.put(item)
        self.wake.set()

    # ---- the loop's side -----------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty()

    def step(self) -> bool:
        """Handle commits, failures and aborts, then one decode step.  Returns whether it did work."""
        self.receiver.expire()
        did = self._drain()
        with self.lock:
            batch = self.scheduler.schedule()
        if batch is None:
            return did
        try:
            output = self.llm.runner.run(batch)
        except BaseException as e:
            for req in list(batch.requests):
                self._end(req.request_id, error=WorkerError("INTERNAL", f"decode step failed: {e!r}"))
            raise
        for req, token, lp in zip(batch.requests, output.tokens, output.logprobs):
            self._emit_token(req, token, lp)
        return True

    def _drain(self) -> bool:
        did = False
        while not self._inbox.empty():
            item = self._inbox.get()
            did = True
            dreq = self.requests.get(item[1])
            if dreq is None or dreq.done:
                continue
            if item[0] in ("commit", "failed") and item[2] != dreq.reservation.transfer_id:
                continue                      # about an earlier request that had this id
            if item[0] == "commit":
                self._admit(dreq)
            elif item[0] == "failed":
                r = dreq.reservation
                self._end(item[1], error=WorkerError("TRANSFER_FAILED", f"{r.reason.value}: {r.detail}"))
            else:
                self._end(item[1], error=WorkerError(item[2], item[3]))
        return did

    def _admit(self, dreq: DecodeRequest) -> None:
        """The transfer committed: the prompt's KV is in place; the first token came with it."""
        res, req = dreq.reservation, dreq.req
        assert res.state.value == "COMMITTED", f"{req.request_id}: admitted with transfer {res.state}"
        lp = None
        if req.params.logprobs is not None:
            lp = {res.first_token_id: res.first_logprob, **res.first_top}
        with self.lock:
            self.scheduler.add_prefilled(req)
        self._emit_token(req, res.first_token_id, lp)

    def _emit_token(self, req: Request, token: int, lp) -> None:
        req.output_token_ids.append(token)
        if lp is not None:
            req.logprobs.append(lp)
        reason = req.stopper.append(token, req.num_tokens)
        dreq = self.requests[req.request_id]
        msg = wpb.Tokens(token_ids=[token], text=req.stopper.delta())
        if lp is not None:
            msg.logprobs.append(logprobs_to_proto(token, lp))
        dreq.events.put(wpb.GenerateResponse(tokens=msg))
        if reason is not None:
            req.finish_reason = reason
            self._end(req.request_id)

    def _end(self, request_id: str, error: WorkerError | None = None) -> None:
        """Finish or fail a request: release its transfer (waits for in-flight writes), then
        its pages, then tell the stream."""
        dreq = self.requests.get(request_id)
        if dreq is None or dreq.done:
            return
        req = dreq.req
        with self.lock:
            self.receiver.release(dreq.reservation.transfer_id)
            if not self.scheduler.remove(req, req.finish_reason or "abort"):
                self.pool.free(request_id)       # reserved, not admitted yet
            dreq.done = True
            del self.requests[request_id]
        if error is not None:
            self.counts["failed"] += 1
            dreq.events.put(wpb.GenerateResponse(error=error.to_proto()))
            return
        self.counts["finished"] += 1
        dreq.events.put(wpb.GenerateResponse(finish=finish_to_proto(
            req.finish_reason, req.stopper.matched_stop, len(req.prompt_token_ids),
            len(req.output_token_ids))))

    def shutdown(self, message: str = "worker shutting down") -> None:
        """End every live request with an explicit error and release all their pages."""
        for rid in list(self.requests):
            self._end(rid, error=WorkerError("UNAVAILABLE", message))


def decode_generator(params: SamplingParams) -> torch.Generator:
    """The request's generator in the state it has after prefill drew the first token: the
    same seed, and one draw taken when the request samples (so seeded sampling continues the
    stream a single-process `LLM` would produce)."""
    g = torch.Generator().manual_seed(params.seed)
    if not params.greedy:
        torch.rand((), generator=g)
    return g
