"""The structured-output compilations waiting for the gateway's grammar threads.

Bounded in all (`max_pending`, GatewayConfig.grammar_max_pending) and per tenant
(`tenant_max_pending`, grammar_tenant_max_pending), counting those waiting and those running:
past either bound a request is refused at once with 429 and Retry-After, naming the limit.
Waiting compilations start in turn across tenants (round robin), so a tenant's burst of
schemas delays another tenant's next compilation by at most one compilation per thread; and a
full queue makes room for a tenant holding fewer than the largest holder (whose newest waiting
compilation is refused with 429), so a few tenants cannot lock the others out.  A
request's time budget starts when its compilation starts, never while it waits.

All the bookkeeping runs on the event loop; the threads only run the compilations."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, TypeVar

from gateway.admission import Rejected

T = TypeVar("T")
RETRY_AFTER_S = 1
# compilations waiting or running, in all and per tenant (GatewayConfig's grammar_max_pending and
# grammar_tenant_max_pending): a tenant's share is a quarter of the queue
DEFAULT_MAX_PENDING = 128
DEFAULT_TENANT_MAX_PENDING = 32


class Busy(Rejected):
    """429 with a Retry-After header (`headers`): the compile queue is full, for everyone or
    for this tenant."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(reason, message)
        self.headers = {"Retry-After": str(RETRY_AFTER_S)}


@dataclass(eq=False)
class _Job(Generic[T]):
    tenant: str
    fn: Callable[[], T]
    started: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    started_at: float = 0.0
    outcome: Future[T] | None = None     # the thread's result, once done
    shed: Busy | None = None             # dropped while it waited, to make room for another tenant


class CompileQueue:
    """Runs compilations on `executor` (`threads` of them at once, never more: the executor
    has no backlog of its own), fairly across tenants."""

    def __init__(self, executor: Executor, threads: int, max_pending: int, tenant_max_pending: int) -> None:
        self.executor, self.threads = executor, threads
        self.max_pending, self.tenant_max_pending = max_pending, tenant_max_pending
        self._waiting: OrderedDict[str, deque[_Job[Any]]] = OrderedDict()   # tenant -> its jobs, in turn
        self._pending: dict[str, int] = {}      # tenant -> waiting + running
        self._running = 0

    @property
    def pending(self) -> int:
        """Compilations waiting or running, in all."""
        return sum(self._pending.values())

    async def run(self, tenant: str, fn: Callable[[], T], timeout_s: float) -> tuple[T, float]:
        """`fn()` on a thread once its turn comes; returns its result and the seconds it ran.
        Raises Busy (429) when the queue is full, TimeoutError when `fn` has run `timeout_s`
        without ending (it goes on in its thread, which stays counted), or what `fn` raised."""
        self._admit(tenant)
        job: _Job[T] = _Job(tenant, fn)
        self._waiting.setdefault(tenant, deque()).append(job)
        self._pending[tenant] = self._pending.get(tenant, 0) + 1
        self._dispatch()
        try:
            await job.started.wait()
            if job.shed is not None:
                raise job.shed
        except asyncio.CancelledError:
            if not job.started.is_set():    # the client left while it waited: it never runs
                self._waiting[tenant].remove(job)
                if not self._waiting[tenant]:
                    del self._waiting[tenant]
                self._release(tenant)
            raise
        left = timeout_s - (time.monotonic() - job.started_at)
        await asyncio.wait_for(job.done.wait(), max(left, 0.0))
        assert job.outcome is not None
        return job.outcome.result(), time.monotonic() - job.started_at

    def _admit(self, tenant: str) -> None:
        total, mine = self.pending, self._pending.get(tenant, 0)
        if mine >= self.tenant_max_pending:
            raise Busy("grammar_tenant_limit", f"this client has {mine} structured-output compilations "
                       f"pending; at most {self.tenant_max_pending} are allowed (grammar_tenant_max_pending); "
                       f"retry when earlier ones have finished")
        if total >= self.max_pending and not self._shed_for(mine):
            raise Busy("grammar_queue_full", f"{total} structured-output compilations are pending, the most "
                       f"this server queues (grammar_max_pending={self.max_pending}); retry shortly")

    def _shed_for(self, mine: int) -> bool:
        """Make room in a full queue for a tenant with `mine` pending: the newest waiting job of
        the tenant with the most pending is refused (429), when that tenant holds more than
        mine + 1 (a few tenants may not lock the others out).  Returns whether it made room."""
        waiting = [t for t, jobs in self._waiting.items() if jobs]
        if not waiting:
            return False
        victim = max(waiting, key=lambda t: self._pending.get(t, 0))
        if self._pending.get(victim, 0) <= mine + 1:
            return False
        jobs = self._waiting[victim]
        job = jobs.pop()
        if not jobs:
            del self._waiting[victim]
        self._release(victim)
        job.shed = Busy("grammar_queue_full", f"the structured-output compilation queue is full "
                        f"(grammar_max_pending={self.max_pending}) and this client holds the most of it; "
                        "retry shortly")
        job.started.set()
        return True

    def _dispatch(self) -> None:
        """Start waiting jobs while threads are free, taking tenants in turn."""
        loop = asyncio.get_running_loop()
        while self._running < self.threads and self._waiting:
            tenant, jobs = next(iter(self._waiting.items()))
            job = jobs.popleft()
            if jobs:
                self._waiting.move_to_end(tenant)
            else:
                del self._waiting[tenant]
            self._running += 1
            job.started_at = time.monotonic()
            job.started.set()
            try:
                outcome = self.executor.submit(job.fn)
            except RuntimeError:            # the executor was shut down: the gateway is stopping
                outcome = Future()
                outcome.set_exception(Rejected("draining", "the server is shutting down"))
            outcome.add_done_callback(partial(_call_soon, loop, self._finished, job))

    def _finished(self, job: _Job[Any], outcome: Future[Any]) -> None:
        self._running -= 1
        self._release(job.tenant)
        job.outcome = outcome
        job.done.set()
        self._dispatch()

    def _release(self, tenant: str) -> None:
        self._pending[tenant] -= 1
        if not self._pending[tenant]:
            del self._pending[tenant]


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """`fn(*args)` on `loop` from a thread (nothing when the loop has closed: shutting down)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass
