"""The admission queue: a bounded number of requests in the gateway, per-tenant limits, a
limit on requests forwarded at once, and a queue timeout.  Every rejection has a reason."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class Rejected(Exception):
    """A request refused by the gateway: HTTP status, reason code, message."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


class AdmissionQueue:
    def __init__(self, max_queue: int, max_running: int, tenant_limit: int, timeout_s: float) -> None:
        self.max_queue, self.tenant_limit, self.timeout_s = max_queue, tenant_limit, timeout_s
        self._slots = asyncio.Semaphore(max_running)
        self.per_tenant: Counter[str] = Counter()
        self.waiting = 0
        self.running = 0

    @property
    def total(self) -> int:
        """Requests admitted and not yet ended (waiting for a slot or running)."""
        return self.waiting + self.running

    @asynccontextmanager
    async def admit(self, tenant: str) -> AsyncIterator[None]:
        """Hold a running slot for the body of the `async with`.  Raises Rejected: 429
        queue_full or tenant_limit at once, 503 queue_timeout after waiting too long."""
        if self.total >= self.max_queue:
            raise Rejected(429, "queue_full", f"the server's queue is full ({self.max_queue} requests); retry later")
        if self.per_tenant[tenant] >= self.tenant_limit:
            raise Rejected(429, "tenant_limit", f"tenant has {self.per_tenant[tenant]} requests in flight, "
                           f"the limit is {self.tenant_limit}")
        self.per_tenant[tenant] += 1
        self.waiting += 1
        try:
            try:
                await asyncio.wait_for(self._slots.acquire(), self.timeout_s)
            except asyncio.TimeoutError:
                raise Rejected(503, "queue_timeout", f"waited {self.timeout_s}s in the queue without a free "
                               f"slot; retry later") from None
            finally:
                self.waiting -= 1
            self.running += 1
            try:
                yield
            finally:
                self.running -= 1
                self._slots.release()
        finally:
            self.per_tenant[tenant] -= 1
            if not self.per_tenant[tenant]:
                del self.per_tenant[tenant]
