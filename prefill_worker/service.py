"""The `PrefillService` gRPC servicer."""

from __future__ import annotations

from typing import Iterator

import grpc

from engine.errors import ErrorCode
from kv_transfer.auth import Verifier
from prefill_worker.engine import PrefillEngine
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc
from worker.cache_events import CacheEventStreams
from worker.convert import prompt_logprobs_to_proto
from worker.drain import drain_reply
from worker.handoff import PrefillOrder
from worker.stats import LoopWatch, health, stats
from worker.types import Role, WorkerError

POLL_S = 0.5


class PrefillServicer(wpb_grpc.PrefillServiceServicer):
    def __init__(self, engine: PrefillEngine, auth: Verifier | None = None, watch: LoopWatch | None = None) -> None:
        self.engine = engine
        self.auth = auth                  # its refusals are counted in Stats
        self.watch = watch                # the worker loop's: Health is not ready while it is stalled
        self.cache_events = CacheEventStreams(engine.pool.events, lambda: engine.closing)

    def Prefill(self, request: wpb.PrefillRequest, context: grpc.ServicerContext) -> wpb.PrefillReply:
        """Prefill, push the pages and the commit to the decode worker; reply once the push was
        acknowledged (with the prompt's logprobs when asked), or with a coded error.  A
        prefill-only order (max_tokens 0) pushes nothing: the reply carries its logprobs."""
        try:
            job = self.engine.submit(PrefillOrder.from_proto(request))
        except WorkerError as e:
            return wpb.PrefillReply(ok=False, error=e.to_proto())
        while not job.done.wait(POLL_S):
            if not context.is_active():
                self.engine.cancel(request.request_id, "the Prefill call was cancelled")
                job.done.wait(POLL_S * 10)
                return wpb.PrefillReply(ok=False, error=wpb.Error(code=ErrorCode.CANCELLED.value,
                                                                    message="cancelled"))
        if job.error is not None:
            return wpb.PrefillReply(ok=False, error=job.error.to_proto(), frames=job.frames)
        reply = wpb.PrefillReply(ok=True, first_token_id=job.first_token, first_logprob=job.first_logprob,
                                 frames=job.frames, cached_tokens=job.req.num_cached_tokens)
        if job.req.params.prompt_logprobs is not None:
            reply.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(job.req.prompt_logprobs))
        return reply

    def Health(self, request: wpb.HealthRequest, context: grpc.ServicerContext) -> wpb.HealthReply:
        """Not ready while the worker loop has not finished a step within its deadline."""
        return health(self.engine.core, Role.PREFILL, self.watch.stalled_s() if self.watch else None,
                      draining=self.engine.draining)

    def Stats(self, request: wpb.StatsRequest, context: grpc.ServicerContext) -> wpb.StatsReply:
        e = self.engine
        s = e.core.scheduler
        return stats(e.core, Role.PREFILL, running=len(s.running), waiting=len(s.waiting),
                     waiting_tokens=e.queued_tokens, accepted=e.counts["pushed"],
                     finished=e.counts["pushed"] + e.counts["prefilled_only"], failed=e.counts["failed"],
                     unauthenticated=self.auth.refused if self.auth else 0, cache=e.cache,
                     draining=e.draining, drained=e.counts["drained"])

    def Drain(self, request: wpb.DrainRequest, context: grpc.ServicerContext) -> wpb.DrainReply:
        """Stop admitting, let queued and running prefills finish for `grace_s`, end the rest
        with DRAINING (worker/drain.py); replies when none is left.  `undo`: admit again."""
        try:
            return drain_reply([self.engine], request)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise                         # not reached: abort raises

    def CacheEvents(self, request: wpb.CacheEventsRequest, context: grpc.ServicerContext
                    ) -> Iterator[wpb.CacheEventBatch]:
        """This worker's prefix-cache changes (worker/cache_events.py)."""
        return self.cache_events.stream(context)


def add_to_server(servicer: PrefillServicer, server: grpc.Server) -> None:
    wpb_grpc.add_PrefillServiceServicer_to_server(servicer, server)
