"""One decode stream of a choice: picking a worker pair, its tries before the first token, and
reading what the decode worker says (gateway/migration.py continues a stream that broke).

Before the stream's first token the request may be retried on another worker: a decode worker
that refuses the reservation for capacity (KV_FULL) or because it drains (DRAINING: never asked
again for this choice), or that cannot be reached, a prefill worker that cannot be reached or
drains, a transfer that broke (on another prefill worker if there is one, else on the same).
While no prefill worker is up (one restarting) the request waits, as it does for KV room.  After
a token a broken stream raises `StreamBroken` with its cause; the caller migrates it.
Cancelling the iterator (the client went away) cancels the `Generate` call, so the decode
worker frees the pages at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any, AsyncIterator

import grpc

from engine.errors import ErrorCode
from gateway.choice import Choice, ForwardError, StreamBroken
from gateway.routing import Worker
from proto import worker_pb2 as wpb
from worker.convert import params_to_proto, prefill_request
from worker.types import Role

# a stream that ends with one of these statuses broke (the worker died, its connection was
# reset, its server stopped): before a token the request is tried again, after one the choice
# migrates (cause "lost")
LOST = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL}
# after a token, a worker's Error with one of these codes migrates the choice, with this cause
MIGRATE_ON = {ErrorCode.DRAINING.value: "drain", ErrorCode.UNAVAILABLE.value: "drain",
              ErrorCode.INTERNAL.value: "error"}
# before a token, a worker that says so is not asked again for this choice
LEAVING = frozenset({ErrorCode.DRAINING, ErrorCode.UNAVAILABLE})
CAPACITY_POLL_S = 0.05
# before the first token, these wait (up to the queue timeout) for a worker to have room or to
# come back (Ray restarts a dead one at a new address) rather than fail the request
WAIT_FOR = frozenset({ErrorCode.KV_FULL, ErrorCode.NO_WORKER, ErrorCode.PREFILL_UNAVAILABLE,
                      ErrorCode.DECODE_UNAVAILABLE, ErrorCode.DRAINING, ErrorCode.UNAVAILABLE})


class _Retry(Exception):
    def __init__(self, error: ForwardError):
        super().__init__(error)
        self.error = error


async def stream(c: Choice, exclude: set[str]) -> AsyncIterator[wpb.GenerateResponse]:
    """Yields the Tokens messages and the final Finish of one decode stream of `c` (continuing
    `c.generated` when there are any), trying other workers than `exclude` before its first
    token: waiting up to `c.capacity_wait_s` for room or a worker, up to `c.max_attempts`
    failures.  Raises ForwardError, or StreamBroken after the stream's first token."""
    tried = set(exclude) | c.leaving
    full: set[str] = set()               # workers that refused for capacity: worth asking again
    broke: set[str] = set()              # prefill workers whose push broke: a last resort
    last = ForwardError(ErrorCode.NO_WORKER, "no worker can take the request now")
    wait_until = time.monotonic() + c.capacity_wait_s
    waiting_since: float | None = None   # when no worker could be picked, since the last pick
    failures = 0
    while failures < c.max_attempts:
        c.remaining_s()
        decode, prefill, last = _pick(c, tried, broke, last)
        if decode is None:
            # a migrating choice waits for a worker after any failure another try may mend (its
            # new worker died during the re-prefill: Ray starts it again at a new address)
            if (last.code not in WAIT_FOR and not c.generated) or time.monotonic() > wait_until:
                break
            waiting_since = waiting_since or time.monotonic()
            tried -= full | (_answered_since(c, tried, waiting_since) - c.leaving)
            full.clear()
            await asyncio.sleep(CAPACITY_POLL_S)
            continue
        waiting_since = None
        try:
            async for msg in _attempt(c, decode, prefill, tried, broke):
                yield msg
            return
        except _Retry as e:
            last = e.error
            if last.code == ErrorCode.KV_FULL:
                full.add(decode.address)
            elif last.code not in LEAVING:
                failures += 1
    raise last


def _answered_since(c: Choice, addresses: set[str], since: float) -> set[str]:
    """Those of `addresses` whose Health answered after `since`: a worker that failed a try and
    is up again (restarted at the same address) may be tried again while the choice waits."""
    return {w.address for w in c.pool.workers if w.address in addresses and w.answered_at > since}


def _pick(c: Choice, tried: set[str], broke: set[str], last: ForwardError
          ) -> tuple[Worker | None, Worker | None, ForwardError]:
    """A decode worker and (unless it is colocated) a prefill worker, or (None, None, why)."""
    decode = c.pool.pick_decode(c.need_tokens, tried, c.prompt.keys)
    if decode is None or decode.role != Role.DECODE:
        return decode, None, last
    prompt_tokens = len(c.ids) + len(c.generated)
    prefill = (c.pool.pick_prefill(tried | broke, c.prompt.keys, prompt_tokens)
               or c.pool.pick_prefill(tried, c.prompt.keys, prompt_tokens))
    if prefill is None:                      # none up (one restarting?): wait, as for KV room
        if last.code != ErrorCode.NO_WORKER:
            last = ForwardError(ErrorCode.NO_WORKER, f"no prefill worker is available (before: {last.code}: "
                                f"{last.message})")
        return None, None, last
    return decode, prefill, last


async def _attempt(c: Choice, decode: Worker, prefill: Worker | None, tried: set[str], broke: set[str]
                   ) -> AsyncIterator[wpb.GenerateResponse]:
    """One try on one worker pair: yields what the decode worker streams after its reservation;
    raises _Retry when another try may succeed (nothing was streamed yet), StreamBroken when the
    stream broke after a token, ForwardError when no try may succeed."""
    assert decode.decode_stub is not None
    timeout_s = c.remaining_s()
    c.attempts += 1
    rid = f"{c.request_id}.{c.attempts}"
    # a migrated choice continues the sampler of the reservation that gave its first token
    params = c.params if c.seed is None else replace(c.params, seed=c.seed)
    call = decode.decode_stub.Generate(wpb.GenerateRequest(
        request_id=rid, tenant=c.tenant, prompt_token_ids=c.ids, params=params_to_proto(params),
        timeout_s=timeout_s, cache_salt=c.prompt.cache_salt, generated_token_ids=c.generated), timeout=timeout_s)
    decode.outstanding += 1
    prefill_failure: list[ForwardError] = []
    task: asyncio.Task[None] | None = None
    streamed: list[bool] = [False]    # tokens arrived: the transfer committed, prefill is done
    try:
        first = await _read(call, decode, False, tried, prefill_failure)
        kind = first.WhichOneof("kind")
        if kind == "error":
            _refused(c, ForwardError.from_proto(first.error), decode, tried)
        decode.succeeded()
        if kind == "finish":          # a migrated choice whose generated tokens already end it
            yield first
            return
        res = first.reservation
        if c.seed is not None and res.seed != c.seed:
            raise ForwardError(ErrorCode.INTERNAL, f"{decode.address} resumed with seed {res.seed}, not {c.seed}")
        if prefill is not None:
            # with the request's salt and the reservation's cache boundary (frames start after it)
            req = prefill_request(rid, c.tenant, c.ids, params, res, c.prompt.cache_salt, c.generated)
            task = asyncio.create_task(_prefill(c, prefill, call, req, timeout_s, prefill_failure, tried,
                                                streamed))
        elif c.generated:             # colocated: it prefills what its cache does not hold
            c.observer.recomputed(max(0, len(c.ids) + len(c.generated) - res.cached_tokens))
        while True:
            msg = await _read(call, decode, streamed[0], tried, prefill_failure)
            kind = msg.WhichOneof("kind")
            if kind == "error":
                _failed(c, msg.error, prefill_failure, streamed[0], decode, prefill, tried, broke)
            if kind == "tokens":
                if c.seed is None:
                    c.seed, c.cached_tokens = res.seed, min(res.cached_tokens, len(c.ids))
                streamed[0] = True
                c.generated += msg.tokens.token_ids
            yield msg
            if kind == "finish":
                return
    finally:
        decode.outstanding -= 1
        call.cancel()
        if task is not None and not task.done():
            task.cancel()


def _refused(c: Choice, err: ForwardError, decode: Worker, tried: set[str]) -> None:
    """The decode worker refused the reservation: retry elsewhere or fail; always raises."""
    if err.code == ErrorCode.KV_FULL:
        tried.add(decode.address)
        raise _Retry(err)
    if err.code in LEAVING:
        tried.add(decode.address)
        c.leaving.add(decode.address)
        raise _Retry(err)
    raise err


def _failed(c: Choice, error: wpb.Error, prefill_failure: list[ForwardError], streamed: bool, decode: Worker,
            prefill: Worker | None, tried: set[str], broke: set[str]) -> None:
    """The decode worker ended the stream with `error`: migrate (after a token), retry or
    fail; always raises."""
    err = prefill_failure[0] if prefill_failure else ForwardError.from_proto(error)
    if streamed:
        cause = MIGRATE_ON.get(error.code)
        if cause is not None:
            raise StreamBroken(cause, ForwardError.from_proto(error), decode.address)
        raise err
    own = ForwardError.from_proto(error)
    if own.code in LEAVING:
        # it drains or stops (the push it cut may have failed first): another worker, never this one
        _refused(c, own, decode, tried)
    if error.code == ErrorCode.TRANSFER_FAILED and prefill is not None:
        # the push broke before any token: try again, not on a prefill worker that died
        (tried if err.code == ErrorCode.PREFILL_UNAVAILABLE else broke).add(prefill.address)
        raise _Retry(err)
    raise err


async def _read(call: Any, decode: Worker, streamed: bool, tried: set[str],
                prefill_failure: list[ForwardError]) -> wpb.GenerateResponse:
    """The decode stream's next message; a broken stream becomes _Retry (before the first
    token), StreamBroken (after it: cause "lost") or ForwardError."""
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
        raise _lost(decode, "the stream was cut") from None
    except grpc.aio.AioRpcError as e:
        _raise_prefill_failure(prefill_failure, streamed, decode, tried)
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise ForwardError(ErrorCode.TIMEOUT, "the request timeout passed") from None
        if e.code() in LOST:
            decode.failed()
            if streamed:
                raise _lost(decode, f"{e.code().name} {e.details()}") from None
            tried.add(decode.address)
            raise _Retry(ForwardError(ErrorCode.DECODE_UNAVAILABLE, f"{decode.address}: {e.code().name}")) from None
        raise ForwardError(ErrorCode.DECODE_FAILED, f"{decode.address}: {e.code().name} {e.details()}") from None
    if msg is grpc.aio.EOF:
        if streamed:
            raise _lost(decode, "the stream ended without a final message")
        tried.add(decode.address)
        raise _Retry(ForwardError(ErrorCode.DECODE_UNAVAILABLE, f"{decode.address} ended the stream without a "
                                  "final message"))
    return msg


def _lost(decode: Worker, why: str) -> StreamBroken:
    return StreamBroken("lost", ForwardError(ErrorCode.DECODE_FAILED, f"{decode.address}: {why}"), decode.address)


def _raise_prefill_failure(failure: list[ForwardError], streamed: bool, decode: Worker, tried: set[str]) -> None:
    """The decode call broke because its prefill failed: that failure is the request's, unless
    no token went out and another try may succeed: the prefill worker could not be reached or
    drains (try another), or its push to this decode worker was refused or broke
    (TRANSFER_FAILED: try another decode worker, e.g. when this one's receiver is at its stream
    cap)."""
    if failure:
        err = failure[0]
        if not streamed and err.code in (ErrorCode.PREFILL_UNAVAILABLE, *LEAVING):
            raise _Retry(err) from None
        if not streamed and err.code == ErrorCode.TRANSFER_FAILED:
            tried.add(decode.address)
            raise _Retry(err) from None
        raise err from None


async def _prefill(c: Choice, prefill: Worker, call: Any, req: wpb.PrefillRequest, timeout_s: float,
                   failure: list[ForwardError], tried: set[str], streamed: list[bool]) -> None:
    """Runs the Prefill call `req` that fills the decode worker's reservation; a failure goes
    into `failure` (and cancels the decode call when no token was streamed yet)."""
    queued = len(req.prompt_token_ids) + len(req.generated_token_ids)
    prefill.outstanding += 1
    prefill.queued_tokens += queued
    try:
        assert prefill.prefill_stub is not None
        reply = await prefill.prefill_stub.Prefill(req, timeout=timeout_s)
        if reply.ok:
            prefill.succeeded()
            if req.generated_token_ids:
                c.observer.recomputed(max(0, queued - reply.cached_tokens))
            return
        err = ForwardError.from_proto(reply.error, "prefill: ")
        if err.code in LEAVING:
            tried.add(prefill.address)
            c.leaving.add(prefill.address)
        failure.append(err)
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
