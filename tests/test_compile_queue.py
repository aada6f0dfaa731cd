"""The gateway's structured-output compilations (gateway/compile_queue.py, gateway/structured.py
StructuredOutputs): a request without a constraint never waits for a grammar thread; the time
budget starts when a compilation starts, not while it waits; the queue is bounded in all and per
tenant (429 with Retry-After, naming the limit); tenants take turns; a request that leaves while
waiting frees its place.  The compilations are held by a stand-in for the compiler's check, so
what waits for what is decided by the test, not by the machine's speed."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from engine.config import SHIPPED_MODEL, ModelConfig
from engine.constraint import Constraint
from engine.tokenizer import Tokenizer
from gateway.admission import Rejected
from gateway.chat import OutputSettings
from gateway.compile_queue import Busy, CompileQueue
from gateway.config import GatewayConfig
from gateway.protocol import ChatCompletionRequest
from gateway.structured import StructuredOutputs

MSG = [{"role": "user", "content": "hi"}]
SETTINGS = OutputSettings()


def body(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=MSG, **kw)


class Held:
    """Stands in for GrammarCompiler.check: a regex whose pattern starts with "held" waits until
    released; every check is recorded in order."""

    def __init__(self) -> None:
        self.release, self.seen = threading.Event(), []

    def __call__(self, c: Constraint) -> None:
        self.seen.append(c.spec)
        if c.spec.startswith("held"):
            assert self.release.wait(30)


@pytest.fixture
def structured() -> Iterator[tuple[StructuredOutputs, Held]]:
    tok = Tokenizer(SHIPPED_MODEL)
    so = StructuredOutputs(tok, ModelConfig.from_path(SHIPPED_MODEL), timeout_s=30, threads=1,
                           max_pending=4, tenant_max_pending=2)
    held = Held()
    so.compiler.check = held          # type: ignore[union-attr,method-assign]
    try:
        yield so, held
    finally:
        held.release.set()
        so.close()


async def started(so: StructuredOutputs, n: int) -> None:
    """Until `n` compilations are pending (the event loop has queued them)."""
    for _ in range(1000):
        if so.queue.pending >= n:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"{so.queue.pending} pending, expected {n}")


def test_a_request_without_a_constraint_never_waits_for_a_thread(structured):
    so, held = structured

    async def main():
        busy = asyncio.create_task(so.constraint(body(guided_regex="held-1"), SETTINGS, "a"))
        await started(so, 1)
        for plain in (body(), body(response_format={"type": "text"}), body(tools=[{"function": {"name": "f"}}],
                                                                           tool_choice="none")):
            assert await asyncio.wait_for(so.constraint(plain, SETTINGS, "b"), 10) is None
        assert so.queue.pending == 1
        held.release.set()
        assert (await busy).spec == "held-1"

    asyncio.run(main())


def test_the_budget_starts_when_the_compilation_starts(structured):
    """The second request waits for the only thread longer than its budget: it is compiled, not
    refused; the first, held past the budget, is refused with grammar_timeout."""
    so, held = structured
    so.timeout_s = 0.3

    async def main():
        first = asyncio.create_task(so.constraint(body(guided_regex="held-1"), SETTINGS, "a"))
        await started(so, 1)
        second = asyncio.create_task(so.constraint(body(guided_regex="quick"), SETTINGS, "b"))
        with pytest.raises(Rejected) as e:
            await first
        assert e.value.reason == "grammar_timeout"
        await asyncio.sleep(0.5)      # the second waits on past its budget while the thread is held
        assert not second.done()
        held.release.set()
        assert (await second).spec == "quick"

    asyncio.run(main())


def test_the_queue_is_bounded_per_tenant_and_in_all(structured):
    so, held = structured

    async def main():
        tasks = [asyncio.create_task(so.constraint(body(guided_regex=f"held-{t}{i}"), SETTINGS, t))
                 for t, i in (("a", 1), ("a", 2), ("b", 1), ("c", 1))]
        await started(so, 4)
        with pytest.raises(Busy) as e:
            await so.constraint(body(guided_regex="x"), SETTINGS, "a")
        assert e.value.status == 429 and e.value.reason == "grammar_tenant_limit"
        assert "at most 2" in e.value.message and "grammar_tenant_max_pending" in e.value.message
        assert e.value.headers == {"Retry-After": "1"}
        # full: a newcomer gets the newest waiting place of the largest holder (a: 2), once
        d = asyncio.create_task(so.constraint(body(guided_regex="held-d1"), SETTINGS, "d"))
        with pytest.raises(Busy) as e:
            await tasks[1]
        assert e.value.reason == "grammar_queue_full" and "holds the most" in e.value.message
        await started(so, 4)
        with pytest.raises(Busy) as e:            # now no one holds more than one beyond a newcomer
            await so.constraint(body(guided_regex="x"), SETTINGS, "e")
        assert e.value.reason == "grammar_queue_full" and "grammar_max_pending=4" in e.value.message
        held.release.set()
        assert [(await t).spec for t in (tasks[0], *tasks[2:], d)] == ["held-a1", "held-b1", "held-c1", "held-d1"]
        assert so.queue.pending == 0
        assert (await so.constraint(body(guided_regex="x"), SETTINGS, "a")).spec == "x"

    asyncio.run(main())


def test_tenants_take_turns(structured):
    """While tenant a's burst waits, tenant b's request starts after at most one more of a's."""
    so, held = structured
    so.queue.tenant_max_pending = so.queue.max_pending = 8

    async def main():
        tasks = [asyncio.create_task(so.constraint(body(guided_regex=f"held-a{i}"), SETTINGS, "a"))
                 for i in range(5)]
        await started(so, 5)
        tasks.append(asyncio.create_task(so.constraint(body(guided_regex="held-b"), SETTINGS, "b")))
        await started(so, 6)
        held.release.set()
        await asyncio.gather(*tasks)
        assert held.seen.index("held-b") <= 2, held.seen

    asyncio.run(main())


def test_a_request_that_leaves_while_waiting_frees_its_place(structured):
    so, held = structured

    async def main():
        running = asyncio.create_task(so.constraint(body(guided_regex="held-1"), SETTINGS, "a"))
        waiting = asyncio.create_task(so.constraint(body(guided_regex="held-2"), SETTINGS, "a"))
        await started(so, 2)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert so.queue.pending == 1
        held.release.set()
        await running
        assert held.seen == ["held-1"] and so.queue.pending == 0

    asyncio.run(main())


def test_a_compilation_past_its_budget_keeps_its_thread_counted():
    """The thread goes on with a compilation its request gave up on: the queue counts it until
    it ends, so refused requests cannot pile up work behind the threads."""
    from concurrent.futures import ThreadPoolExecutor
    release = threading.Event()
    executor = ThreadPoolExecutor(1)
    queue = CompileQueue(executor, 1, max_pending=1, tenant_max_pending=1)

    async def main():
        with pytest.raises(TimeoutError):
            await queue.run("a", lambda: release.wait(30), 0.05)
        assert queue.pending == 1
        with pytest.raises(Busy):
            await queue.run("b", lambda: None, 1)
        release.set()
        for _ in range(1000):
            if not queue.pending:
                break
            await asyncio.sleep(0.001)
        assert (await queue.run("b", lambda: 7, 10))[0] == 7

    try:
        asyncio.run(main())
    finally:
        release.set()
        executor.shutdown()


def test_the_limits_are_gateway_settings():
    cfg = GatewayConfig(colocated_workers=("w:1",), cluster_secret=b"s" * 32)
    assert cfg.grammar_max_pending >= cfg.grammar_tenant_max_pending >= 1
    for bad in ({"grammar_max_pending": 0}, {"grammar_max_pending": 4, "grammar_tenant_max_pending": 8}):
        with pytest.raises(ValueError, match="grammar_"):
            GatewayConfig(colocated_workers=("w:1",), cluster_secret=b"s" * 32, **bad)


# ~1 KB of schema that llguidance compiles for minutes, bounded by none of its parser limits
# (tests/test_grammar_compiler.py SLOW): the gateway's check runs in a child killed at the budget
SLOW = {"type": "string", "allOf": [{"pattern": f"^(.*a.{{{i % 30 + 1}}}.*)$"} for i in range(30)]}


def test_a_schema_that_compiles_for_minutes_is_refused_and_frees_its_thread():
    tok = Tokenizer(SHIPPED_MODEL)
    so = StructuredOutputs(tok, ModelConfig.from_path(SHIPPED_MODEL), timeout_s=1.0, threads=1)

    async def main():
        with pytest.raises(Rejected) as e:
            await so.constraint(body(guided_json=SLOW), SETTINGS, "a")
        assert e.value.status == 400 and e.value.reason == "grammar_timeout"
        # the one thread is free again: the next constraint is compiled, not stuck behind minutes of work
        c = await asyncio.wait_for(so.constraint(body(guided_choice=["yes", "no"]), SETTINGS, "b"), 30)
        assert c is not None and c.kind == "choice" and so.queue.pending == 0

    try:
        asyncio.run(main())
    finally:
        so.close()
