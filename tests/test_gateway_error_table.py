"""The error table (issue 33, item 2): every `ErrorCode` has one entry in gateway/errors.py
saying what the gateway does with a failure of that code (another pair, wait, give up before
the first token; migrate after it, and why), its HTTP status and its public message; and every
consumer reads it.  Each code is walked through the table and through the consumers: an
attempt whose decode worker answers with it (gateway/attempt.py), the picker that counts the
attempt (gateway/forward.py), a resumed stream that fails with it (gateway/migration.py).  No
other gateway module keeps a set of codes.  Fakes stand in for the workers' calls: nothing
here waits on time."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import time
from pathlib import Path

import grpc
import pytest

from engine.errors import ErrorCode
from engine.params import SamplingParams
from gateway.attempt import Attempt
from gateway.choice import Choice
from gateway.errors import (
    CODES,
    ERRORS,
    LOST_STATUSES,
    Cause,
    ForwardError,
    Next,
    call_error,
    policy,
    public,
    public_message,
)
from gateway.forward import Picker
from gateway.migration import resume_failed
from gateway.outcome import Broken, Failed, Finished, Retry
from gateway.route import Route
from gateway.routing import WorkerPool
from proto import worker_pb2 as wpb
from worker.types import Role

GATEWAY = Path(__file__).resolve().parent.parent / "gateway"
RESERVED = wpb.GenerateResponse(reservation=wpb.Reservation(seed=7))
TOKEN = wpb.GenerateResponse(tokens=wpb.Tokens(text="a", token_ids=[5]))
FINISH = wpb.GenerateResponse(finish=wpb.Finish(finish_reason="stop"))


def error(code: ErrorCode) -> wpb.GenerateResponse:
    return wpb.GenerateResponse(error=wpb.Error(code=code.value, message="scripted"))


def rpc_error(status: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(status, grpc.aio.Metadata(), grpc.aio.Metadata(), "scripted")


# ---- the table --------------------------------------------------------------------------------------
def test_every_error_code_has_one_entry_whose_columns_agree():
    assert set(CODES) == set(ErrorCode)
    for code in ErrorCode:
        p = policy(code)
        assert p.code is code and p.public is public(code) is ERRORS[code.value.lower()], code
        assert ForwardError(code, "m").status == p.status
        if p.message is None:                      # the client's fault: the worker's words are shown
            assert p.status == 400 and not p.retryable and public_message(code, "why", "r1") == "why"
        else:
            assert public_message(code, "10.0.0.1:5 broke", "r1") == f"{p.message} (request id r1)"
        if p.own:
            assert p.before_token is Next.GIVE_UP and p.migrates is None and not p.no_room
        if p.no_room or p.before_token is not Next.GIVE_UP:
            assert p.retryable and p.status >= 500, code
        assert p.counts == (p.before_token not in (Next.WAIT, Next.LEAVE))
        if p.excludes_decode:                      # read only where a prefill failure is retried
            assert p.before_token is Next.RETRY, code
    assert {p.migrates for p in CODES.values()} - {None} == set(Cause)


def test_the_tables_sets_are_the_gateways_behaviour():
    """What the nine tables of four files said before (issue 33), now read off the one."""
    def codes(pred) -> set[ErrorCode]:
        return {c for c in ErrorCode if pred(policy(c))}
    E = ErrorCode
    assert codes(lambda p: p.before_token is Next.WAIT) == {E.KV_FULL}
    assert codes(lambda p: p.before_token is Next.LEAVE) == {E.DRAINING, E.UNAVAILABLE}
    assert codes(lambda p: p.before_token is Next.RETRY) == {E.PREFILL_UNAVAILABLE, E.DECODE_UNAVAILABLE,
                                                             E.TRANSFER_FAILED}
    assert codes(lambda p: p.no_room) == {E.KV_FULL, E.NO_WORKER, E.PREFILL_UNAVAILABLE, E.DECODE_UNAVAILABLE,
                                          E.DRAINING, E.UNAVAILABLE}
    assert {c: p.migrates for c, p in CODES.items() if p.migrates} == {
        E.DRAINING: Cause.DRAIN, E.UNAVAILABLE: Cause.DRAIN, E.INTERNAL: Cause.ERROR, E.DECODE_UNAVAILABLE: Cause.LOST}
    assert codes(lambda p: p.own) == {E.TIMEOUT, E.CANCELLED, E.ABORTED}
    assert codes(lambda p: p.excludes_decode) == {E.TRANSFER_FAILED}
    assert codes(lambda p: p.message is None) == {E.INVALID_REQUEST, E.PROMPT_TOO_LONG}


def test_a_broken_calls_grpc_status_has_its_code():
    for status in grpc.StatusCode:
        want = (ErrorCode.TIMEOUT if status == grpc.StatusCode.DEADLINE_EXCEEDED else
                ErrorCode.DECODE_UNAVAILABLE if status in LOST_STATUSES else ErrorCode.DECODE_FAILED)
        assert call_error(status) == want, status
    assert {s.name for s in LOST_STATUSES} == {"UNAVAILABLE", "UNKNOWN", "CANCELLED", "INTERNAL"}


def test_no_other_gateway_module_keeps_a_set_of_codes():
    """Consumers ask the table; a literal set, tuple or dict of two or more ErrorCodes (or gRPC
    statuses) anywhere else in the gateway is a second table."""
    for path in sorted(GATEWAY.glob("*.py")):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None) \
                if isinstance(node, (ast.Set, ast.Tuple, ast.List)) else None
            named = [ast.unparse(x) for x in items or () if isinstance(x, ast.Attribute)
                     and {"ErrorCode", "StatusCode"} & set(ast.unparse(x).split("."))]
            assert len(named) < 2, f"{path.name}:{node.lineno}: {named}: read gateway/errors.py instead"


# ---- an attempt, with fake calls --------------------------------------------------------------------
class FakeCall:
    """A Generate call that answers with `script` (an exception is raised), then EOF."""

    def __init__(self, script: list[object]) -> None:
        self.script = list(script)

    async def read(self) -> object:
        await asyncio.sleep(0)
        while self.script and isinstance(self.script[0], float):    # a pause: other tasks run
            await asyncio.sleep(self.script.pop(0))
        if not self.script:
            return grpc.aio.EOF
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        pass


class FakeDecode:
    def __init__(self, script: list[object]) -> None:
        self.script = script

    def Generate(self, request: wpb.GenerateRequest, timeout: float) -> FakeCall:
        return FakeCall(self.script)


class FakePrefill:
    def __init__(self, reply: wpb.PrefillReply | None = None) -> None:
        self.reply = reply or wpb.PrefillReply(ok=True)

    async def Prefill(self, request: wpb.PrefillRequest, timeout: float) -> wpb.PrefillReply:
        return self.reply


def route() -> Route:
    pool = WorkerPool(("127.0.0.1:1",), ("127.0.0.1:2",), (), b"")
    return Route(pool, "r", "acme", time.monotonic() + 30, 3, capacity_wait_s=30.0, max_migrations=3)


def attempt(script: list[object], prefill_reply: wpb.PrefillReply | None = None) -> Attempt:
    """One attempt of a fresh choice whose decode worker answers with `script` (a float: a pause
    of that many seconds) and its prefill worker with `prefill_reply` (ok), run to its end."""
    r = route()
    (decode,), (prefill,) = r.pool.of(Role.DECODE), r.pool.of(Role.PREFILL)
    decode.decode_stub, prefill.prefill_stub = FakeDecode(script), FakePrefill(prefill_reply)
    a = Attempt(Choice(0, [1, 2, 3], SamplingParams(max_tokens=4)), r, decode, prefill, 30.0)

    async def run() -> None:
        async for _ in a.run():
            pass
    asyncio.run(run())
    assert decode.outstanding == 0 and prefill.outstanding == 0 and prefill.queued_tokens == 0
    return a


@pytest.mark.parametrize("code", list(ErrorCode))
def test_a_refused_reservation_does_what_the_table_says(code):
    a = attempt([error(code)])
    step = policy(code).before_token
    if step in (Next.WAIT, Next.LEAVE):
        assert isinstance(a.outcome, Retry) and a.outcome.error.code == code
        assert a.outcome.exclude == {a.decode.address}
        assert (a.decode.address in a.choice.leaving) == (step is Next.LEAVE)
    else:
        assert isinstance(a.outcome, Failed) and a.outcome.error.code == code
        assert a.outcome.error.status == policy(code).status


@pytest.mark.parametrize("code", list(ErrorCode))
def test_a_failure_after_the_reservation_does_what_the_table_says(code):
    a = attempt([RESERVED, error(code)])
    assert a.prefill is not None
    step, out = policy(code).before_token, a.outcome
    if step is Next.LEAVE:
        assert isinstance(out, Retry) and out.exclude == {a.decode.address} and a.decode.address in a.choice.leaving
    elif step is Next.RETRY:                       # the push broke: the prefill worker only as a last resort
        assert isinstance(out, Retry) and out.last_resort == a.prefill.address and not out.exclude
    else:
        assert isinstance(out, Failed) and out.error.code == code


@pytest.mark.parametrize("code", list(ErrorCode))
def test_a_failure_after_a_token_migrates_when_the_table_says(code):
    a = attempt([RESERVED, TOKEN, error(code)])
    assert a.choice.token_ids == [5] and a.choice.seed == 7
    cause = policy(code).migrates
    if cause is not None:
        assert isinstance(a.outcome, Broken) and a.outcome.cause == cause and a.outcome.address == a.decode.address
    else:
        assert isinstance(a.outcome, Failed) and a.outcome.error.code == code


@pytest.mark.parametrize("status", [s for s in grpc.StatusCode if s != grpc.StatusCode.OK])
def test_a_broken_call_does_what_its_code_says(status):
    code = call_error(status)
    before, after = attempt([rpc_error(status)]), attempt([RESERVED, TOKEN, rpc_error(status)])
    if code == ErrorCode.DECODE_UNAVAILABLE:
        assert isinstance(before.outcome, Retry) and before.outcome.error.code == code
        assert before.outcome.exclude == {before.decode.address} and before.decode.failures == 1
        assert isinstance(after.outcome, Broken) and after.outcome.cause == policy(code).migrates == Cause.LOST
    else:
        for a in (before, after):
            assert isinstance(a.outcome, Failed) and a.outcome.error.code == code


def test_a_stream_that_ends_without_a_final_message_is_lost():
    assert isinstance(attempt([]).outcome, Retry)
    assert isinstance(attempt([RESERVED, TOKEN]).outcome, Broken)
    done = attempt([RESERVED, TOKEN, FINISH])
    assert isinstance(done.outcome, Finished) and done.choice.finish_reason == "stop"


def test_a_prefill_failure_after_a_token_does_not_stop_the_migration():
    """A decode worker dies after its first token while the prefill's reply is still on its way:
    the prefill answers TRANSFER_FAILED (the commit's acknowledgement was lost with the worker),
    but the transfer had committed, so the stream's break decides and the choice migrates."""
    late = wpb.PrefillReply(ok=False, error=wpb.Error(code="TRANSFER_FAILED", message="the push broke"))
    for end in (rpc_error(grpc.StatusCode.UNAVAILABLE), error(ErrorCode.DRAINING)):
        a = attempt([RESERVED, TOKEN, 0.05, end], late)
        assert a.prefill_error is not None and a.prefill_error.code == ErrorCode.TRANSFER_FAILED
        assert isinstance(a.outcome, Broken), a.outcome
    before = attempt([RESERVED, 0.05, rpc_error(grpc.StatusCode.UNAVAILABLE)], late)
    assert isinstance(before.outcome, Retry) and before.outcome.error.code == ErrorCode.TRANSFER_FAILED


@pytest.mark.parametrize("code", list(ErrorCode))
def test_a_prefill_failure_before_a_token_does_what_the_table_says(code):
    """The Prefill call answers `code` and the decode call is cut for it: another pair when the
    table says RETRY or LEAVE (never this decode worker again when it says excludes_decode: its
    receiver refused the push), else the request fails with the prefill's error."""
    failed = wpb.PrefillReply(ok=False, error=wpb.Error(code=code.value, message="scripted"))
    a = attempt([RESERVED, 0.05, rpc_error(grpc.StatusCode.CANCELLED)], failed)
    p, out = policy(code), a.outcome
    assert a.prefill is not None and a.prefill_error is not None and a.prefill_error.code == code
    if p.before_token in (Next.RETRY, Next.LEAVE):
        assert isinstance(out, Retry) and out.error.code == code
        assert (a.decode.address in out.exclude) == p.excludes_decode
        assert (a.prefill.address in out.exclude) == (p.before_token is Next.LEAVE)
    else:
        assert isinstance(out, Failed) and out.error.code == code


def test_an_unknown_code_fails_as_internal_and_never_migrates():
    unknown = wpb.GenerateResponse(error=wpb.Error(code="FROM_A_NEWER_WORKER", message="m"))
    for script in ([unknown], [RESERVED, unknown], [RESERVED, TOKEN, unknown]):
        out = attempt(script).outcome
        assert isinstance(out, Failed) and out.error.code == ErrorCode.INTERNAL and out.error.status == 502


# ---- the picker and the migration read it too -----------------------------------------------------
@pytest.mark.parametrize("code", list(ErrorCode))
def test_a_retry_counts_as_the_table_says(code):
    r = route()
    (decode,) = r.pool.of(Role.DECODE)
    picker = Picker(Choice(0, [1], SamplingParams(max_tokens=2)), r)
    picker.retry(decode, Retry(ForwardError(code, "m"), frozenset({"x"})))
    assert picker.tried == {"x"} and picker.last.code == code
    assert picker.full == ({decode.address} if policy(code).before_token is Next.WAIT else set())
    assert picker.failures == int(policy(code).counts)


@pytest.mark.parametrize("code", [c for c in ErrorCode if policy(c).before_token in (Next.RETRY, Next.WAIT)])
def test_with_no_pair_left_a_fresh_stream_waits_as_the_table_says(code):
    """The only decode worker failed the attempt: a fresh stream waits for one (up to
    capacity_wait_s) after a failure that says the cluster has no worker or room now, or after a
    broken push (its decode worker may be restarting: chaos kill_decode_twice lost a request so
    when both decode workers were down); after any other it fails at once with that failure."""
    r = dataclasses.replace(route(), capacity_wait_s=0.2)
    (decode,) = r.pool.of(Role.DECODE)
    picker = Picker(Choice(0, [1], SamplingParams(max_tokens=2)), r)
    picker.retry(decode, Retry(ForwardError(code, "m"), frozenset({decode.address})))
    with pytest.raises(ForwardError) as raised:
        asyncio.run(picker.pair())
    assert raised.value.code == code
    waits = policy(code).no_room or policy(code).excludes_decode
    assert (picker.waiting_since is not None) == waits, "waited" if not waits else "failed at once"


@pytest.mark.parametrize("code", list(ErrorCode))
def test_a_resumed_stream_fails_as_the_table_says(code):
    choice, e = Choice(0, [1], SamplingParams(max_tokens=2)), ForwardError(code, "m")
    got = resume_failed(choice, route(), e)
    if policy(code).own:
        assert got is e
    else:
        assert got.code == ErrorCode.MIGRATION_FAILED
        assert got.status == (503 if policy(code).no_room else 502)
        assert ("(no_worker)" if policy(code).no_room else "(refused)") in got.message
