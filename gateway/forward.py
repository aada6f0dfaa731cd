"""Forwarding one generation to a worker pair and streaming back what the decode worker says.

Before the first token a request may be retried on another worker: a decode worker that
refuses the reservation for capacity (KV_FULL) or cannot be reached, a prefill worker that
cannot be reached, a transfer that broke (on another prefill worker if there is one, else
on the same).  While no prefill worker is up (one restarting) the request waits, as it does
for KV room.  After a token was streamed there is no retry: the client gets an error.
Cancelling the iterator (the client went away) cancels the `Generate` call, so the decode
worker frees the pages at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc

from engine.params import SamplingParams
from gateway.cache_view import PrefixKeys
from gateway.routing import Worker, WorkerPool
from proto import worker_pb2 as wpb
from worker.convert import params_to_proto, prefill_request
from worker.types import ErrorCode, Role

STATUS = {ErrorCode.INVALID_REQUEST: 400, ErrorCode.PROMPT_TOO_LONG: 400, ErrorCode.KV_FULL: 503,
          ErrorCode.UNAVAILABLE: 503, ErrorCode.NO_WORKER: 503, ErrorCode.TIMEOUT: 408, ErrorCode.INTERNAL: 500}
UNKNOWN_STATUS = 502                  # any other code: the worker side failed the request
UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN}
CAPACITY_POLL_S = 0.05
# before the first token, these wait (up to the queue timeout) for a worker to have room or to
# come back (Ray restarts a dead one at a new address) rather than fail the request
WAIT_FOR = frozenset({ErrorCode.KV_FULL, ErrorCode.NO_WORKER, ErrorCode.PREFILL_UNAVAILABLE,
                      ErrorCode.DECODE_UNAVAILABLE})


class ForwardError(Exception):
    """A request that failed, with the code and HTTP status the client gets."""

    def __init__(self, code: ErrorCode, message: str, status: int | None = None):
        super().__init__(f"{code.value}: {message}")
        self.code, self.message = code, message
        self.status = status or STATUS.get(code, UNKNOWN_STATUS)

    @classmethod
    def from_proto(cls, error: wpb.Error, prefix: str = "") -> ForwardError:
        """A worker's Error message.  A code this gateway does not know (a newer worker) is
        answered as INTERNAL with status 502, the worker's code kept in the message."""
        try:
            return cls(ErrorCode(error.code), prefix + error.message)
        except ValueError:
            return cls(ErrorCode.INTERNAL, f"{prefix}{error.code}: {error.message}", UNKNOWN_STATUS)


class _Retry(Exception):
    def __init__(self, error: ForwardError):
        super().__init__(error)
        self.error = error


@dataclass(frozen=True)
class Prompt:
    """What the workers get of a request's prompt besides its tokens: its cache salt (the
    request's `cache_salt`, "" for none) and its page keys for prefix routing (None: route by
    load alone)."""
    cache_salt: str = ""
    keys: PrefixKeys | None = None


async def forward(pool: WorkerPool, request_id: str, tenant: str, ids: list[int], params: SamplingParams,
                  timeout_s: float, max_attempts: int, capacity_wait_s: float = 30.0, prompt: Prompt = Prompt()
                  ) -> AsyncIterator[wpb.GenerateResponse]:
    """Yields Tokens messages and a final Finish; raises ForwardError.

    When every decode worker is full (KV_FULL) or none is ready, the request waits for room
    (up to `capacity_wait_s`) instead of failing; other failures before the first token are
    retried on another worker up to `max_attempts` times."""
    tried: set[str] = set()
    full: set[str] = set()               # workers that refused for capacity: worth asking again
    broke: set[str] = set()              # prefill workers whose push broke: a last resort
    last = ForwardError(ErrorCode.NO_WORKER, "no worker can take the request now")
    deadline = time.monotonic() + capacity_wait_s
    attempt = failures = 0
    while failures < max_attempts:
        decode = pool.pick_decode(len(ids) + params.max_tokens, tried, prompt.keys)
        prefill = None
        if decode is not None and decode.role == Role.DECODE:
            prefill = (pool.pick_prefill(tried | broke, prompt.keys, len(ids))
                       or pool.pick_prefill(tried, prompt.keys, len(ids)))
            if prefill is None:               # none up (one restarting?): wait, as for KV room
                decode = None
                if last.code != ErrorCode.NO_WORKER:
                    last = ForwardError(ErrorCode.NO_WORKER, "no prefill worker is available" +
                                        (f" (before: {last.code}: {last.message})" if attempt else ""))
        if decode is None:
            if last.code not in WAIT_FOR or time.monotonic() > deadline:
                break
            tried -= full
            full.clear()
            await asyncio.sleep(CAPACITY_POLL_S)
            continue
        attempt += 1
        try:
            async for msg in _attempt(decode, prefill, f"{request_id}.{attempt}", tenant, ids, params,
                                      prompt.cache_salt, timeout_s, tried, broke):
                yield msg
            return
        except _Retry as e:
            last = e.error
            if last.code == ErrorCode.KV_FULL:
                full.add(decode.address)
            else:
                failures += 1
    raise last


async def _attempt(decode: Worker, prefill: Worker | None, rid: str, tenant: str, ids: list[int],
                   params: SamplingParams, salt: str, timeout_s: float, tried: set[str], broke: set[str]
                   ) -> AsyncIterator[wpb.GenerateResponse]:
    """One try on one worker pair: yields what the decode worker streams; raises _Retry when
    another try may succeed (nothing was streamed yet), ForwardError when none may."""
    assert decode.decode_stub is not None
    call = decode.decode_stub.Generate(wpb.GenerateRequest(
        request_id=rid, tenant=tenant, prompt_token_ids=ids, params=params_to_proto(params),
        timeout_s=timeout_s, cache_salt=salt), timeout=timeout_s)
    decode.outstanding += 1
    prefill_failure: list[ForwardError] = []
    task: asyncio.Task[None] | None = None
    streamed: list[bool] = [False]    # tokens arrived: the transfer committed, prefill is done
    try:
        first = await _read(call, decode, False, tried, prefill_failure)
        if first.WhichOneof("kind") == "error":
            err = ForwardError.from_proto(first.error)
            if err.code == ErrorCode.KV_FULL:
                tried.add(decode.address)
                raise _Retry(err)
            raise err
        decode.succeeded()
        if prefill is not None:
            # with the request's salt and the reservation's cache boundary (frames start after it)
            req = prefill_request(rid, tenant, ids, params, first.reservation, salt)
            task = asyncio.create_task(_prefill(prefill, call, req, timeout_s, prefill_failure, tried, streamed))
        while True:
            msg = await _read(call, decode, streamed[0], tried, prefill_failure)
            kind = msg.WhichOneof("kind")
            if kind == "error":
                err = prefill_failure[0] if prefill_failure else ForwardError.from_proto(msg.error)
                if not streamed[0] and msg.error.code == ErrorCode.TRANSFER_FAILED and prefill is not None:
                    # the push broke before any token: try again, not on a prefill worker that died
                    (tried if err.code == ErrorCode.PREFILL_UNAVAILABLE else broke).add(prefill.address)
                    raise _Retry(err)
                raise err
            streamed[0] = streamed[0] or kind == "tokens"
            yield msg
            if kind == "finish":
                return
    finally:
        decode.outstanding -= 1
        call.cancel()
        if task is not None and not task.done():
            task.cancel()


async def _read(call: Any, decode: Worker, streamed: bool, tried: set[str],
                prefill_failure: list[ForwardError]) -> wpb.GenerateResponse:
    """The decode stream's next message; a broken stream becomes _Retry (before the first
    token) or ForwardError."""
    try:
        msg = await call.read()
    except asyncio.CancelledError:
        # grpc.aio raises CancelledError in read() when the call was cancelled or its channel
        # closed on this side; only a cancellation of this task itself may propagate
        if cancelling():
            raise
        _raise_prefill_failure(prefill_failure, streamed, decode, tried)
        if not streamed:
            tried.add(decode.address)
            raise _Retry(ForwardError(ErrorCode.DECODE_UNAVAILABLE, f"{decode.address}: the call was cut")) from None
        raise ForwardError(ErrorCode.DECODE_FAILED, f"{decode.address}: the stream was cut") from None
    except grpc.aio.AioRpcError as e:
        _raise_prefill_failure(prefill_failure, streamed, decode, tried)
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise ForwardError(ErrorCode.TIMEOUT, "the request timeout passed") from None
        if e.code() in UNREACHABLE and not streamed:
            decode.failed()
            tried.add(decode.address)
            raise _Retry(ForwardError(ErrorCode.DECODE_UNAVAILABLE, f"{decode.address}: {e.code().name}")) from None
        raise ForwardError(ErrorCode.DECODE_FAILED, f"{decode.address}: {e.code().name} {e.details()}") from None
    if msg is grpc.aio.EOF:
        raise ForwardError(ErrorCode.DECODE_FAILED, f"{decode.address} ended the stream without a final message")
    return msg


def _raise_prefill_failure(failure: list[ForwardError], streamed: bool, decode: Worker, tried: set[str]) -> None:
    """The decode call broke because its prefill failed: that failure is the request's, unless
    no token went out and another try may succeed: the prefill worker could not be reached (try
    another), or its push to this decode worker was refused or broke (TRANSFER_FAILED: try
    another decode worker, e.g. when this one's receiver is at its stream cap)."""
    if failure:
        err = failure[0]
        if not streamed and err.code == ErrorCode.PREFILL_UNAVAILABLE:
            raise _Retry(err) from None
        if not streamed and err.code == ErrorCode.TRANSFER_FAILED:
            tried.add(decode.address)
            raise _Retry(err) from None
        raise err from None


async def _prefill(prefill: Worker, call: Any, req: wpb.PrefillRequest, timeout_s: float,
                   failure: list[ForwardError], tried: set[str], streamed: list[bool]) -> None:
    """Runs the Prefill call `req` that fills the decode worker's reservation; a failure goes
    into `failure` (and cancels the decode call when no token was streamed yet)."""
    queued = len(req.prompt_token_ids)
    prefill.outstanding += 1
    prefill.queued_tokens += queued
    try:
        assert prefill.prefill_stub is not None
        reply = await prefill.prefill_stub.Prefill(req, timeout=timeout_s)
        if reply.ok:
            prefill.succeeded()
            return
        failure.append(ForwardError.from_proto(reply.error, "prefill: "))
    except asyncio.CancelledError:
        if cancelling():
            raise                     # the request ended: nothing to report
        tried.add(prefill.address)    # its channel was closed: the worker left the registry
        failure.append(ForwardError(ErrorCode.PREFILL_UNAVAILABLE, f"{prefill.address}: the call was cut"))
    except grpc.aio.AioRpcError as e:
        prefill.failed()
        tried.add(prefill.address)
        failure.append(ForwardError(ErrorCode.PREFILL_UNAVAILABLE, f"{prefill.address}: {e.code().name}"))
    finally:
        prefill.outstanding -= 1
        prefill.queued_tokens -= queued
    if not streamed[0]:           # a committed transfer decodes on without its prefill worker
        call.cancel()             # otherwise the decode worker frees the reservation at once


def cancelling() -> bool:
    """Whether the running task itself is being cancelled (not just a call it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
