"""The admission queue: a bounded number of requests in the gateway, per-tenant limits (requests
in flight and KV tokens reserved), a limit on requests forwarded at once, the decode workers' KV
capacity, and a queue timeout.  Every rejection has a reason.

Waiting requests queue per tenant (first come, first served within a tenant); whenever a slot
or KV room frees, the tenant holding the smallest share (of the running slots or of the
cluster's KV, whichever it holds more of) goes next, round robin among equals, so one tenant's
burst cannot hold the queue:

    ring: B → C → A                (A was served last; say all three hold as much)
    B's head fits                → admit it; B goes to the end: C → A → B
    B is over its own KV budget  → skip B (only B's own requests hold it back), try C
    B's head needs KV room the cluster does not have now
                                 → hold: nobody passes B until room is freed
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol

from gateway.errors import public

RECHECK_S = 1.0          # a waiting request re-reads the limits this often (workers come and go)


class Rejected(Exception):
    """A request refused by the gateway: its reason code (one of gateway/errors.py ERRORS) and
    message; `status` is the HTTP status the table gives that reason.  `param` names the field
    at fault, `headers` go with the answer (a retryable code's Retry-After when None)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message
        self.status = public(reason).status
        self.param: str | None = None
        self.headers: dict[str, str] | None = None


class InvalidField(Rejected):
    """A refusal that names the request field at fault (`param` of the error body); its reasons
    are 400s."""

    def __init__(self, param: str, message: str, reason: str = "out_of_range") -> None:
        super().__init__(reason, message)
        self.param = param


class KvLimits(Protocol):
    """The KV limits the queue admits against, read at each admission (they follow the workers)."""

    def cluster_tokens(self) -> int:
        """KV tokens the decode workers hold in all (0: unknown, no limit)."""

    def tenant_tokens(self) -> int:
        """KV tokens one tenant may hold reserved at once (0: no limit)."""


class NoKvLimits:
    """No KV limit: requests are counted only."""

    def cluster_tokens(self) -> int:
        return 0

    def tenant_tokens(self) -> int:
        return 0


@dataclass(eq=False)
class Waiter:
    """One request in the queue; `admitted` is set when it gets its slot."""
    tenant: str
    kv_tokens: int
    admitted: asyncio.Future[None]


@dataclass
class TenantLoad:
    """What one tenant holds in the gateway now."""
    queued: deque[Waiter] = field(default_factory=deque)
    running: int = 0
    kv_reserved: int = 0                 # KV tokens of its running requests

    @property
    def in_flight(self) -> int:
        return len(self.queued) + self.running


class AdmissionQueue:
    def __init__(self, max_queue: int, max_running: int, tenant_limit: int, timeout_s: float,
                 limits: KvLimits | None = None, on_reject: Callable[[str, str], None] | None = None) -> None:
        self.max_queue, self.max_running, self.tenant_limit = max_queue, max_running, tenant_limit
        self.timeout_s = timeout_s
        self.limits = limits or NoKvLimits()
        self.on_reject = on_reject          # (tenant, reason) of every refusal: metrics
        self.tenants: dict[str, TenantLoad] = {}      # tenants with requests waiting or running
        self._ring: deque[str] = deque()               # tenants with requests waiting, next turn first
        self.waiting = 0
        self.running = 0
        self.kv_reserved = 0

    @property
    def total(self) -> int:
        """Requests admitted and not yet ended (waiting for a slot or running)."""
        return self.waiting + self.running

    @asynccontextmanager
    async def admit(self, tenant: str, kv_tokens: int = 0) -> AsyncIterator[None]:
        """Hold a running slot and `kv_tokens` of the tenant's KV budget for the body of the
        `async with`.  Raises Rejected at once: 400 kv_budget or kv_capacity for a request that
        can never be admitted, 429 queue_full or tenant_limit; after waiting `timeout_s` (the
        request then leaves the queue): 429 kv_budget_in_use when the tenant's own requests hold
        its budget, else 503 queue_timeout."""
        self._check(tenant, kv_tokens)
        load = self.tenants.setdefault(tenant, TenantLoad())
        waiter = Waiter(tenant, kv_tokens, asyncio.get_running_loop().create_future())
        load.queued.append(waiter)
        self.waiting += 1
        if len(load.queued) == 1:
            self._ring.append(tenant)
        self._dispatch()
        try:
            await self._wait(waiter)
        except BaseException:
            self._leave(waiter)
            raise
        try:
            yield
        finally:
            self._leave(waiter)

    def _check(self, tenant: str, kv_tokens: int) -> None:
        """Refuses at once what can never be admitted (400) and what waiting for others may
        fix (429: the queue or the tenant's share of it is full)."""
        budget, cluster = self.limits.tenant_tokens(), self.limits.cluster_tokens()
        if budget and kv_tokens > budget:
            raise self._reject(tenant, "kv_budget", f"this request reserves {kv_tokens} KV tokens (prompt + "
                               f"max_tokens, for each choice), more than the tenant's whole KV budget of {budget} "
                               f"tokens (tenant_max_kv_tokens): it can never be admitted; lower max_tokens or n")
        if cluster and kv_tokens > cluster:
            raise self._reject(tenant, "kv_capacity", f"this request reserves {kv_tokens} KV tokens (prompt + "
                               f"max_tokens, for each choice), more than the decode workers hold together "
                               f"({cluster} tokens): it can never be admitted; lower max_tokens or n")
        if self.total >= self.max_queue:
            raise self._reject(tenant, "queue_full", f"the server's queue is full ({self.max_queue} "
                               f"requests); retry later")
        load = self.tenants.get(tenant)
        if load is not None and load.in_flight >= self.tenant_limit:
            raise self._reject(tenant, "tenant_limit", f"tenant has {load.in_flight} requests in flight, "
                               f"the limit is {self.tenant_limit} (tenant_max_concurrency); retry when one ends")

    async def _wait(self, waiter: Waiter) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while not waiter.admitted.done():
            left = deadline - loop.time()
            if left <= 0:
                raise self._timed_out(waiter)
            await asyncio.wait([waiter.admitted], timeout=min(left, RECHECK_S))
            self._dispatch()                 # a worker may have joined since

    def _timed_out(self, waiter: Waiter) -> Rejected:
        """The refusal of a request that waited `timeout_s`: 429 when its tenant's own requests
        hold the KV budget it needs, else 503 (no slot or KV room freed in time)."""
        held, budget = self.tenants[waiter.tenant].kv_reserved, self.limits.tenant_tokens()
        if budget and held + waiter.kv_tokens > budget:
            return self._reject(waiter.tenant, "kv_budget_in_use", f"waited {self.timeout_s}s in the queue: "
                                f"this request reserves {waiter.kv_tokens} KV tokens and the tenant's other requests "
                                f"hold {held} of its KV budget of {budget} tokens (tenant_max_kv_tokens); retry when "
                                f"they end")
        return self._reject(waiter.tenant, "queue_timeout", f"waited {self.timeout_s}s in the queue without a "
                            f"free slot or KV room; retry later")

    def _reject(self, tenant: str, reason: str, message: str) -> Rejected:
        if self.on_reject is not None:
            self.on_reject(tenant, reason)
        return Rejected(reason, message)

    # ---- the round robin --------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Admit waiting requests while a running slot is free, round robin over the tenants."""
        while self.running < self.max_running and (waiter := self._next()) is not None:
            load = self.tenants[waiter.tenant]
            self.waiting -= 1
            self.running += 1
            load.running += 1
            load.kv_reserved += waiter.kv_tokens
            self.kv_reserved += waiter.kv_tokens
            waiter.admitted.set_result(None)

    def _next(self) -> Waiter | None:
        """The head of the first tenant in turn that may start one now (taken off its queue; the
        tenant goes to the ring's end), or None."""
        budget, cluster = self.limits.tenant_tokens(), self.limits.cluster_tokens()
        # the smallest dominant share goes first: of the running slots or of the cluster's KV,
        # whichever the tenant holds more of; among equals, the ring's order
        def share(tenant: str) -> float:
            load = self.tenants[tenant]
            return max(load.running / self.max_running, load.kv_reserved / cluster if cluster else 0.0)

        for tenant in sorted(self._ring, key=share):
            load = self.tenants[tenant]
            head = load.queued[0]
            if budget and load.kv_reserved and load.kv_reserved + head.kv_tokens > budget:
                continue                     # over its own budget: the others go first
            if cluster and self.kv_reserved and self.kv_reserved + head.kv_tokens > cluster:
                return None                  # its turn, but no room: nobody passes it
            self._ring.remove(tenant)
            load.queued.popleft()
            if load.queued:
                self._ring.append(tenant)
            return head
        return None

    def _leave(self, waiter: Waiter) -> None:
        """The request ends: give back its slot and KV tokens if it was admitted, else take it
        off its tenant's queue; then admit who can go now."""
        load = self.tenants[waiter.tenant]
        if waiter.admitted.done():
            self.running -= 1
            load.running -= 1
            load.kv_reserved -= waiter.kv_tokens
            self.kv_reserved -= waiter.kv_tokens
        else:
            waiter.admitted.cancel()
            load.queued.remove(waiter)
            self.waiting -= 1
            if not load.queued:
                self._ring.remove(waiter.tenant)
        if not load.in_flight:
            del self.tenants[waiter.tenant]
        self._dispatch()
