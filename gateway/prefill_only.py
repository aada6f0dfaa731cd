"""A prefill-only choice (max_tokens 0: /v1/completions' echo, or prompt logprobs with
nothing generated) on a prefill worker: one Prefill call with no decode worker behind it.  The
worker computes the prompt, answers with its logprobs and pushes nothing; no decode worker
reserves anything.  (On a colocated worker the same choice is a Generate call that answers the
logprobs and a Finish: gateway/attempt.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from engine.errors import ErrorCode
from gateway.choice import Choice
from gateway.errors import ForwardError, Next
from gateway.outcome import Failed, Finished, Outcome, Retry
from gateway.route import Route
from gateway.routing import Worker
from proto import worker_pb2 as wpb
from worker.handoff import GenerateOrder


class PrefillOnlyAttempt:
    """One try of a prefill-only `choice` on the prefill worker `prefill`; `run()` yields nothing
    (no token is generated) and sets `outcome`: Finished with the prompt's logprobs in the
    choice and its Finish ("length", no completion token), Retry on another worker, or Failed."""

    def __init__(self, choice: Choice, route: Route, prefill: Worker, timeout_s: float):
        choice.attempts += 1
        self.choice, self.route, self.timeout_s = choice, route, timeout_s
        self.decode = prefill                    # the worker the picker hears about
        self.order = GenerateOrder(
            request_id=f"{route.choice_id(choice)}.{choice.attempts}", tenant=route.tenant,
            prompt_token_ids=tuple(choice.prompt_ids), generated_token_ids=(), params=choice.params,
            cache_salt=choice.prompt.cache_salt, timeout_s=timeout_s).prefill_only_order()
        self.outcome: Outcome = Failed(ForwardError(ErrorCode.INTERNAL, "the attempt did not end"))

    async def run(self) -> AsyncIterator[wpb.GenerateResponse]:
        self.outcome = await self._call()
        return
        yield                                    # an async generator, like Attempt.run

    async def _call(self) -> Outcome:
        worker = self.decode
        assert worker.prefill_stub is not None
        queued = len(self.choice.prompt_ids)
        worker.outstanding += 1
        worker.queued_tokens += queued
        try:
            reply = await worker.prefill_stub.Prefill(self.order.to_proto(), timeout=self.timeout_s)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise                            # the request ended
            return Retry(ForwardError(ErrorCode.PREFILL_UNAVAILABLE, f"{worker.address}: the call was cut"),
                         frozenset({worker.address}))
        except grpc.aio.AioRpcError as e:
            worker.failed()
            return Retry(ForwardError(ErrorCode.PREFILL_UNAVAILABLE, f"{worker.address}: {e.code().name}"),
                         frozenset({worker.address}))
        finally:
            worker.outstanding -= 1
            worker.queued_tokens -= queued
        if not reply.ok:
            err = ForwardError.from_proto(reply.error, "prefill: ")
            if err.policy.before_token is Next.LEAVE:
                self.choice.leaving.add(worker.address)
            if err.policy.before_token in (Next.RETRY, Next.LEAVE, Next.WAIT):
                return Retry(err, frozenset({worker.address}))
            return Failed(err)
        worker.succeeded()
        self.choice.keep_prompt_logprobs(reply.prompt_logprobs)
        if self.choice.awaits_prompt_logprobs:
            return Failed(ForwardError(ErrorCode.INTERNAL, f"{worker.address} answered without the prompt logprobs"))
        self.choice.end(wpb.Finish(finish_reason="length", prompt_tokens=len(self.choice.prompt_ids),
                                   completion_tokens=0, cached_tokens=0))
        return Finished()
