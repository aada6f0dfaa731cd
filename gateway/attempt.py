"""One attempt of a choice on one worker pair (`Attempt`); how it ended is an `Outcome`
(gateway/outcome.py).

`Generate` on the decode worker reserves room for the prompt (and a migrated choice's tokens
so far); unless that worker is colocated, `Prefill` on the prefill worker fills the
reservation.  What the decode worker streams is recorded in the choice and passed on.  The
attempt ends `Finished`, or with a failure the error table sorts (gateway/errors.py): before
the first token `Retry` (another pair may succeed) or `Failed`; after it `Broken` (the choice
migrates, gateway/migration.py) or `Failed`.  Cancelling the iterator (the client went away)
cancels both calls, so the decode worker frees the pages at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from engine.errors import ErrorCode
from gateway.choice import Choice
from gateway.errors import ForwardError, Next, call_error, policy
from gateway.outcome import Broken, Failed, Finished, Outcome, Retry
from gateway.route import Route
from gateway.routing import Worker
from proto import worker_pb2 as wpb
from worker.handoff import GenerateOrder


class Attempt:
    """One try of `choice` on `decode` and (unless it is colocated) `prefill`, within
    `timeout_s`.  `run()` yields what the decode worker streams; when it returns, `outcome`
    says how the attempt ended."""

    def __init__(self, choice: Choice, route: Route, decode: Worker, prefill: Worker | None, timeout_s: float):
        choice.attempts += 1
        self.choice, self.route, self.decode, self.prefill = choice, route, decode, prefill
        self.timeout_s = timeout_s
        # each attempt its own request id; a migrated choice continues the sampler of the
        # reservation that gave its first token
        order = GenerateOrder(
            request_id=f"{route.choice_id(choice)}.{choice.attempts}", tenant=route.tenant,
            prompt_token_ids=tuple(choice.prompt_ids), generated_token_ids=tuple(choice.token_ids),
            params=choice.attempt_params(), cache_salt=choice.prompt.cache_salt, timeout_s=timeout_s)
        self.order = order if choice.seed is None else order.with_seed(choice.seed)
        self.streamed = False                    # a token arrived: the transfer committed, prefill is done
        self.prefill_error: ForwardError | None = None
        self.exclude: set[str] = set()           # workers not to ask again for this stream
        self.last_resort: str | None = None
        self.outcome: Outcome = Failed(ForwardError(ErrorCode.INTERNAL, "the attempt did not end"))
        self._prefill_task: asyncio.Task[None] | None = None

    async def run(self) -> AsyncIterator[wpb.GenerateResponse]:
        """Yields each Tokens message and the final Finish of the decode stream, recording them in
        the choice first; sets `outcome` before it returns."""
        assert self.decode.decode_stub is not None
        call = self.decode.decode_stub.Generate(self.order.to_proto(), timeout=self.timeout_s)
        self.decode.outstanding += 1
        try:
            async for msg in self._stream(call):
                yield msg
        finally:
            self.decode.outstanding -= 1
            call.cancel()
            if self._prefill_task is not None and not self._prefill_task.done():
                self._prefill_task.cancel()

    async def _stream(self, call: Any) -> AsyncIterator[wpb.GenerateResponse]:
        """The decode stream's first message: a reservation (then its tokens), a refusal, or the
        Finish of a migrated choice whose generated tokens already end it."""
        first = await self._read(call)
        while not isinstance(first, Outcome) and first.WhichOneof("kind") == "prompt":
            self.choice.keep_prompt_logprobs(first.prompt)   # a colocated prefill-only: then its Finish
            first = await self._read(call)
        if isinstance(first, Outcome):
            self.outcome = first
            return
        kind = first.WhichOneof("kind")
        if kind == "error":
            self.outcome = self._refused(ForwardError.from_proto(first.error))
            return
        self.decode.succeeded()
        if kind == "finish":
            self._end(first.finish)
            yield first
            return
        if (failed := self._reserved(call, first.reservation)) is not None:
            self.outcome = failed
            return
        async for msg in self._tokens(call, first.reservation):
            yield msg

    async def _tokens(self, call: Any, res: wpb.Reservation) -> AsyncIterator[wpb.GenerateResponse]:
        """The stream after the reservation `res`: its tokens, until the Finish or a failure."""
        while True:
            msg = await self._read(call)
            if isinstance(msg, Outcome):
                self.outcome = msg
                return
            kind = msg.WhichOneof("kind")
            if kind == "error":
                self.outcome = self._failed(msg.error)
                return
            if kind == "prompt":
                self.choice.keep_prompt_logprobs(msg.prompt)
                continue
            if kind == "tokens":
                if self.choice.awaits_prompt_logprobs and (missing := await self._prompt_logprobs()) is not None:
                    self.outcome = missing
                    return
                self.choice.keep_reservation(res)
                self.streamed = True
                self.choice.add(msg.tokens)
                yield msg
            elif kind == "finish":
                self._end(msg.finish)
                yield msg
                return

    async def _prompt_logprobs(self) -> Outcome | None:
        """Before the first token of a choice that asked for prompt logprobs: they come with the
        Prefill reply (sent once the commit was acknowledged, so about when the first token is),
        awaited here; None once they are in.  A reply that failed or lacked them fails the
        request: a response without what it asked for would be a wrong 200 (DESIGN I8)."""
        if self._prefill_task is not None:
            await asyncio.shield(self._prefill_task)
        if not self.choice.awaits_prompt_logprobs:
            return None
        why = self.prefill_error.message if self.prefill_error is not None else "no prompt logprobs came"
        return Failed(ForwardError(ErrorCode.INTERNAL, f"the prompt logprobs were lost: {why}"))

    def _end(self, finish: wpb.Finish) -> None:
        self.choice.end(finish)
        self.outcome = Finished()

    def _reserved(self, call: Any, res: wpb.Reservation) -> Outcome | None:
        """The decode worker reserved room: start the prefill that fills it (None), or fail."""
        c = self.choice
        if c.seed is not None and res.seed != c.seed:
            return Failed(ForwardError(ErrorCode.INTERNAL, f"{self.decode.address} resumed with seed {res.seed}, "
                                       f"not {c.seed}"))
        if self.prefill is not None:
            # the order's request, with the reservation's seed and cache boundary (frames start after it)
            req = self.order.prefill_order(res).to_proto()
            self._prefill_task = asyncio.create_task(self._prefill(call, req))
        elif c.token_ids:             # colocated: it prefills what its cache does not hold
            self.route.observer.recomputed(max(0, len(c.prompt_ids) + len(c.token_ids) - res.cached_tokens))
        return None

    def _retry(self, error: ForwardError) -> Retry:
        return Retry(error, frozenset(self.exclude), self.last_resort)

    def _refused(self, err: ForwardError) -> Outcome:
        """The decode worker refused the reservation, or left it: another pair when it has no
        room now or is going away, else the request fails."""
        step = err.policy.before_token
        if step not in (Next.WAIT, Next.LEAVE):
            return Failed(err)
        self.exclude.add(self.decode.address)
        if step is Next.LEAVE:
            self.choice.leaving.add(self.decode.address)
        return self._retry(err)

    def _failed(self, error: wpb.Error) -> Outcome:
        """The decode worker ended the stream with `error`: after a token the choice migrates or
        fails; before one another pair may succeed, or the request fails (with the prefill's
        failure, when there was one: the decode worker's error follows from it)."""
        own = ForwardError.from_proto(error)
        if self.streamed:                        # the transfer committed: a prefill failure is not the cause
            if own.code != error.code:           # a code this gateway does not know: never migrated
                return Failed(own)
            return self._after_token(own.code, own, own)
        err = self.prefill_error or own
        if own.policy.before_token is Next.LEAVE:
            # it drains or stops (the push it cut may have failed first): another worker, never this one
            return self._refused(own)
        if own.policy.before_token is Next.RETRY and self.prefill is not None:
            # its push broke (TRANSFER_FAILED) before any token: try again; the prefill worker, unless
            # it is excluded already (unreachable, leaving), only as a last resort
            if self.prefill.address not in self.exclude:
                self.last_resort = self.prefill.address
            return self._retry(err)
        return Failed(err)

    def _after_token(self, code: ErrorCode, broke: ForwardError, failure: ForwardError) -> Outcome:
        """A failure of `code` after a token: the choice migrates when the table says so (with
        `broke`), else the request fails with `failure`."""
        cause = policy(code).migrates
        return Broken(cause, broke, self.decode.address) if cause is not None else Failed(failure)

    async def _read(self, call: Any) -> wpb.GenerateResponse | Outcome:
        """The decode stream's next message, or the outcome of a stream that broke."""
        try:
            msg = await call.read()
        except asyncio.CancelledError:
            # grpc.aio raises CancelledError in read() when the call was cancelled or its channel
            # closed on this side; only a cancellation of this task itself may propagate
            if cancelling():
                raise
            return self._prefill_failed() or self._lost(f"{self.decode.address}: the call was cut",
                                                        "the stream was cut")
        except grpc.aio.AioRpcError as e:
            return self._prefill_failed() or self._call_failed(e)
        if msg is grpc.aio.EOF:
            return self._lost(f"{self.decode.address} ended the stream without a final message",
                              "the stream ended without a final message")
        return msg

    def _call_failed(self, e: grpc.aio.AioRpcError) -> Outcome:
        """The decode call broke with a gRPC status (gateway/errors.py LOST_STATUSES)."""
        code, name, address = call_error(e.code()), e.code().name, self.decode.address
        if code == ErrorCode.DECODE_UNAVAILABLE:
            self.decode.failed()
            return self._lost(f"{address}: {name}", f"{name} {e.details()}")
        detail = "the request timeout passed" if code == ErrorCode.TIMEOUT else f"{address}: {name} {e.details()}"
        return Failed(ForwardError(code, detail))

    def _lost(self, message: str, why: str) -> Outcome:
        """The stream broke without the worker saying why (DECODE_UNAVAILABLE, `message`): another
        pair before a token; after one, what the table says of it (a migration)."""
        if self.streamed:
            broke = ForwardError(ErrorCode.DECODE_FAILED, f"{self.decode.address}: {why}")
            return self._after_token(ErrorCode.DECODE_UNAVAILABLE, broke, broke)
        self.exclude.add(self.decode.address)
        return self._retry(ForwardError(ErrorCode.DECODE_UNAVAILABLE, message))

    def _prefill_failed(self) -> Outcome | None:
        """None when the prefill did not fail, or failed after a token went out: the transfer had
        committed (its reply may still fail, when the commit's acknowledgement is lost with the
        decode worker), so the stream's own break decides.  Else the decode call broke because of
        it, and that failure is the request's, unless another pair may succeed: the prefill
        worker could not be reached or is going away (it is excluded: try another), or its push
        to this decode worker was refused or broke (the table's `excludes_decode`: try another
        decode worker, e.g. when this one's receiver is at its stream cap)."""
        err = self.prefill_error
        if err is None or self.streamed:
            return None
        if err.policy.before_token not in (Next.RETRY, Next.LEAVE):
            return Failed(err)
        if err.policy.excludes_decode:
            self.exclude.add(self.decode.address)
        return self._retry(err)

    async def _prefill(self, call: Any, req: wpb.PrefillRequest) -> None:
        """Runs the Prefill call `req` that fills the decode worker's reservation; a failure goes
        into `prefill_error` and, when no token was streamed yet, cancels the decode call (a
        committed transfer decodes on without its prefill worker)."""
        prefill = self.prefill
        assert prefill is not None and prefill.prefill_stub is not None
        queued = len(req.prompt_token_ids) + len(req.generated_token_ids)
        prefill.outstanding += 1
        prefill.queued_tokens += queued
        try:
            self.prefill_error = await self._call_prefill(prefill, req, queued)
        finally:
            prefill.outstanding -= 1
            prefill.queued_tokens -= queued
        if self.prefill_error is not None and not self.streamed:
            call.cancel()             # the decode worker frees the reservation at once

    async def _call_prefill(self, prefill: Worker, req: wpb.PrefillRequest, queued: int) -> ForwardError | None:
        """The Prefill call's failure, None when it succeeded."""
        assert prefill.prefill_stub is not None
        try:
            reply = await prefill.prefill_stub.Prefill(req, timeout=self.timeout_s)
        except asyncio.CancelledError:
            if cancelling():
                raise                 # the request ended: nothing to report
            self.exclude.add(prefill.address)    # its channel was closed: the worker left the registry
            return ForwardError(ErrorCode.PREFILL_UNAVAILABLE, f"{prefill.address}: the call was cut")
        except grpc.aio.AioRpcError as e:
            prefill.failed()
            self.exclude.add(prefill.address)
            return ForwardError(ErrorCode.PREFILL_UNAVAILABLE, f"{prefill.address}: {e.code().name}")
        if reply.ok:
            prefill.succeeded()
            if reply.HasField("prompt_logprobs"):
                self.choice.keep_prompt_logprobs(reply.prompt_logprobs)
            if req.generated_token_ids:
                self.route.observer.recomputed(max(0, queued - reply.cached_tokens))
            return None
        err = ForwardError.from_proto(reply.error, "prefill: ")
        if err.policy.before_token is Next.LEAVE:
            self.exclude.add(prefill.address)
            self.choice.leaving.add(prefill.address)
        return err


def cancelling() -> bool:
    """Whether the running task itself is being cancelled (not just a call it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
