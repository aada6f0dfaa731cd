"""The `DecodeService` gRPC servicer (also the colocated worker's, which prefills itself)."""

from __future__ import annotations

import queue
import threading
from typing import Iterator, Protocol

import grpc

from decode_worker.engine import DecodeEngine
from decode_worker.requests import DecodeRequest
from engine.errors import ErrorCode
from engine.request import Request
from kv_transfer.auth import Verifier
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc
from worker.cache_events import CacheEventStreams
from worker.convert import finish_to_proto, prompt_logprobs_to_proto
from worker.drain import Drainable, drain_reply
from worker.handoff import GenerateOrder, PrefillOrder
from worker.stats import LoopWatch, health, stats
from worker.types import Role, WorkerError

POLL_S = 0.5     # how often a stream waiting for tokens checks that its client is still there


class LocalJob(Protocol):
    """A local prefill's job, as far as this servicer reads it: when it is done, its request (the
    prompt logprobs it computed) and its failure."""
    done: threading.Event
    req: Request
    error: WorkerError | None


class LocalPrefill(Drainable, Protocol):
    """A prefill role in the same process (colocated): it fills this worker's reservations (and
    drains with it)."""

    def submit(self, order: PrefillOrder) -> LocalJob:
        """Queue the order's prompt and a migrated request's generated tokens (pushing the pages
        after `order.cached_tokens`); raises WorkerError having queued nothing."""
        ...

    def cancel(self, request_id: str, why: str) -> None:
        """Drop the request's prefill wherever it is."""
        ...


class DecodeServicer(wpb_grpc.DecodeServiceServicer):
    def __init__(self, engine: DecodeEngine, transfer_endpoint: str, role: Role = Role.DECODE,
                 prefill: LocalPrefill | None = None, auth: Verifier | None = None,
                 watch: LoopWatch | None = None):
        self.engine, self.endpoint, self.role = engine, transfer_endpoint, role
        self.prefill = prefill
        self.auth = auth                  # its refusals are counted in Stats
        self.watch = watch                # the worker loop's: Health is not ready while it is stalled
        self.cache_events = CacheEventStreams(engine.pool.events, lambda: engine.closing)

    def Generate(self, request: wpb.GenerateRequest, context: grpc.ServicerContext
                 ) -> Iterator[wpb.GenerateResponse]:
        """Reserve for the request (worker.handoff.GenerateOrder), answer with the reservation,
        then stream its tokens and its Finish, or one Error.  A cancelled stream ends the request."""
        try:
            order = GenerateOrder.from_proto(request)
            if order.params.prefill_only:
                yield from self._prefill_only(order, context)
                return
            dreq = self.engine.reserve(order)
        except WorkerError as e:
            yield wpb.GenerateResponse(error=e.to_proto())
            return
        if isinstance(dreq, wpb.Finish):  # a migrated request its generated tokens already ended
            yield wpb.GenerateResponse(finish=dreq)
            return
        rid = dreq.order.request_id

        def cancel() -> None:
            self.engine.abort(rid, ErrorCode.CANCELLED, "the Generate stream was cancelled")
        if not context.add_callback(cancel):
            cancel()                      # the stream already ended
            return
        reservation = self._reservation(dreq)
        yield wpb.GenerateResponse(reservation=reservation)
        job = self._prefill_here(self.prefill, dreq, reservation) if self.prefill is not None else None
        wants_prompt = job is not None and order.params.prompt_logprobs is not None
        for msg in self._events(dreq, context):
            if wants_prompt and msg.WhichOneof("kind") == "tokens":
                assert job is not None
                wants_prompt = False
                if (prompt := _prompt_of(job, context)) is not None:
                    yield prompt
            yield msg

    def _prefill_only(self, order: GenerateOrder, context: grpc.ServicerContext) -> Iterator[wpb.GenerateResponse]:
        """(Colocated) max_tokens 0: the local prefill role computes the prompt's logprobs; no
        reservation, nothing decoded.  Streams them, then a Finish ("length", no token).  Raises
        WorkerError (a decode worker without a prefill role: the caller sends these to a prefill
        worker's Prefill)."""
        if self.prefill is None:
            raise WorkerError(ErrorCode.INVALID_REQUEST, "max_tokens 0 only prefills: this decode worker has no "
                              "prefill role (send it to a prefill worker's Prefill)")
        job = self.prefill.submit(order.prefill_only_order())
        if (prompt := _prompt_of(job, context)) is None:
            if job.error is not None:
                yield wpb.GenerateResponse(error=job.error.to_proto())
            else:
                self.prefill.cancel(order.request_id, "the Generate stream was cancelled")
            return
        yield prompt
        yield wpb.GenerateResponse(finish=finish_to_proto("length", None, job.req.num_prompt_tokens, 0))

    def _reservation(self, dreq: DecodeRequest) -> wpb.Reservation:
        """The reservation's answer: where to push its pages, with which seed, from which token."""
        res = dreq.reservation
        return wpb.Reservation(
            transfer_id=res.transfer_id, transfer_endpoint=self.endpoint, prompt_tokens=dreq.req.num_prompt_tokens,
            reserved_pages=dreq.reserved_pages, seed=dreq.req.params.seed, cached_tokens=res.cached_tokens)

    @staticmethod
    def _events(dreq: DecodeRequest, context: grpc.ServicerContext) -> Iterator[wpb.GenerateResponse]:
        """The request's tokens, then its Finish or Error; stops early when the client has gone."""
        while True:
            try:
                msg = dreq.events.get(timeout=POLL_S)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            yield msg
            if msg.WhichOneof("kind") in ("finish", "error"):
                return

    def _prefill_here(self, prefill: LocalPrefill, dreq: DecodeRequest, reservation: wpb.Reservation
                      ) -> LocalJob | None:
        """(Colocated) fill this reservation with the local prefill role: the reservation's order
        as a caller would send it in a Prefill call (`GenerateOrder.prefill_order`), its params
        taken as they are (checked once, when the Generate call was read)."""
        try:
            return prefill.submit(dreq.order.prefill_order(reservation))
        except WorkerError as e:
            self.engine.abort(dreq.order.request_id, e.code, e.message)
            return None

    def Abort(self, request: wpb.AbortRequest, context: grpc.ServicerContext) -> wpb.AbortReply:
        """End the request only if the caller names its reservation's transfer id too (a
        request id alone is guessable); otherwise found=False and nothing changes."""
        found = self.engine.abort(request.request_id, ErrorCode.ABORTED, "aborted by the caller",
                                  transfer_id=request.transfer_id)
        if found and self.prefill is not None:
            self.prefill.cancel(request.request_id, "aborted by the caller")
        return wpb.AbortReply(found=found)

    def Health(self, request: wpb.HealthRequest, context: grpc.ServicerContext) -> wpb.HealthReply:
        """Not ready while the worker loop has not finished a step within its deadline."""
        return health(self.engine.core, self.role, self.watch.stalled_s() if self.watch else None,
                      draining=self.engine.draining)

    def Stats(self, request: wpb.StatsRequest, context: grpc.ServicerContext) -> wpb.StatsReply:
        e = self.engine
        r = e.receiver
        waiting = sum(1 for d in list(e.requests.values()) if not d.reservation.terminal)
        decoding = sum(not r.handoff for r in list(e.core.scheduler.running))   # not a colocated prefill
        return stats(e.core, self.role, running=decoding, waiting=waiting,
                     accepted=r.accepted_frames, refused=dict(r.refused),
                     finished=e.counts["finished"], failed=e.counts["failed"],
                     unauthenticated=self.auth.refused if self.auth else 0,
                     cache=e.cache, transfer_bytes=r.accepted_bytes, draining=e.draining,
                     drained=e.counts["drained"])

    def Drain(self, request: wpb.DrainRequest, context: grpc.ServicerContext) -> wpb.DrainReply:
        """Stop admitting, let live requests finish for `grace_s`, end the rest with DRAINING
        (worker/drain.py); replies when none is left.  `undo`: admit again.  A colocated
        worker drains its prefill role with it."""
        engines: list[Drainable] = [self.engine] if self.prefill is None else [self.prefill, self.engine]
        try:
            return drain_reply(engines, request)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise                         # not reached: abort raises

    def CacheEvents(self, request: wpb.CacheEventsRequest, context: grpc.ServicerContext
                    ) -> Iterator[wpb.CacheEventBatch]:
        """This worker's prefix-cache changes (worker/cache_events.py); a colocated worker's
        one pool serves both roles."""
        return self.cache_events.stream(context)


def _prompt_of(job: LocalJob, context: grpc.ServicerContext) -> wpb.GenerateResponse | None:
    """The local prefill job's prompt logprobs once it is done (its push acknowledged); None when
    it failed (the stream's own error follows) or the client left first."""
    while not job.done.wait(POLL_S):
        if not context.is_active():
            return None
    if job.error is not None:
        return None
    return wpb.GenerateResponse(prompt=prompt_logprobs_to_proto(job.req.prompt_logprobs))


def add_to_server(servicer: DecodeServicer, server: grpc.Server) -> None:
    wpb_grpc.add_DecodeServiceServicer_to_server(servicer, server)
