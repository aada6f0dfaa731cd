"""The workers the gateway knows, what their `Health` and `Stats` last said, a circuit
breaker each, and the choice of a decode and a prefill worker for a request."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from kv_transfer.auth import aio_interceptors
from kv_transfer.tls import TlsIdentity, open_aio_channel
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc
from worker.types import Role

log = logging.getLogger("tandem.gateway")
FAILURES_TO_OPEN = 3
OPEN_S = 5.0
CHANNEL_OPTIONS = [("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 20_000),
                   ("grpc.http2.max_pings_without_data", 0), ("grpc.keepalive_permit_without_calls", 1)]


@dataclass
class Worker:
    address: str
    role: Role
    secret: bytes = field(default=b"", repr=False)   # the cluster secret: every call carries credentials
    tls: TlsIdentity | None = field(default=None, repr=False)   # the gateway's cluster certificate
    channel: grpc.aio.Channel | None = None
    health: wpb.HealthReply | None = None
    stats: wpb.StatsReply | None = None
    outstanding: int = 0                    # requests this gateway has on it now
    queued_tokens: int = 0                  # prefill: prompt tokens this gateway sent, unanswered
    failures: int = 0
    open_until: float = 0.0
    decode_stub: wpb_grpc.DecodeServiceStub | None = None     # decode and colocated workers
    prefill_stub: wpb_grpc.PrefillServiceStub | None = None   # prefill workers

    def connect(self) -> None:
        self.channel = open_aio_channel(self.address, self.tls, CHANNEL_OPTIONS, aio_interceptors(self.secret))
        if self.role == Role.PREFILL:
            self.prefill_stub = wpb_grpc.PrefillServiceStub(self.channel)
        else:
            self.decode_stub = wpb_grpc.DecodeServiceStub(self.channel)

    @property
    def stub(self) -> wpb_grpc.DecodeServiceStub | wpb_grpc.PrefillServiceStub:
        """The worker's service (both have Health and Stats)."""
        stub = self.prefill_stub if self.role == Role.PREFILL else self.decode_stub
        assert stub is not None, f"worker {self.address} is not connected"
        return stub

    @property
    def healthy(self) -> bool:
        return self.health is not None and self.health.ready

    def available(self) -> bool:
        return self.healthy and time.monotonic() >= self.open_until

    def failed(self) -> None:
        """A call could not reach it: after FAILURES_TO_OPEN in a row, stop sending for OPEN_S."""
        self.failures += 1
        if self.failures >= FAILURES_TO_OPEN:
            self.open_until = time.monotonic() + OPEN_S

    def succeeded(self) -> None:
        self.failures, self.open_until = 0, 0.0


class WorkerPool:
    def __init__(self, decode: tuple[str, ...], prefill: tuple[str, ...], colocated: tuple[str, ...],
                 secret: bytes, tls: TlsIdentity | None = None) -> None:
        self.secret = secret              # the cluster secret the workers' calls are authenticated with
        self.tls = tls                    # mutual TLS to the workers when they run it (across nodes)
        self.workers = [Worker(a, r, secret, tls) for r, addrs in ((Role.DECODE, decode), (Role.PREFILL, prefill),
                                                                   (Role.COLOCATED, colocated)) for a in addrs]
        self._retired: list[Worker] = []

    def connect(self) -> None:
        """Open the channels (inside the event loop that will use them)."""
        for w in self.workers:
            w.connect()

    def update(self, found: dict[str, list[str]]) -> None:
        """Follow the registry: add workers that appeared (a restarted worker has a new address),
        drop the ones that are gone."""
        want = {(a, Role(role)) for role, addrs in found.items() for a in addrs}
        have = {(w.address, w.role) for w in self.workers}
        for w in [w for w in self.workers if (w.address, w.role) not in want]:
            self.workers.remove(w)
            self._retired.append(w)           # no new requests; closed once none is left on it
        for w in [w for w in self._retired if w.outstanding == 0]:
            self._retired.remove(w)
            assert w.channel is not None   # connected when it joined the pool
            asyncio.get_running_loop().create_task(w.channel.close())
        for address, role in want - have:
            w = Worker(address, role, self.secret, self.tls)
            w.connect()
            self.workers.append(w)

    def of(self, *roles: Role) -> list[Worker]:
        return [w for w in self.workers if w.role in roles]

    async def refresh(self) -> None:
        await asyncio.gather(*(self._refresh(w) for w in self.workers))

    async def _refresh(self, w: Worker) -> None:
        try:
            w.health = await w.stub.Health(wpb.HealthRequest(), timeout=2.0)
            w.stats = await w.stub.Stats(wpb.StatsRequest(), timeout=2.0)
        except grpc.aio.AioRpcError as e:
            if w.health is not None:
                log.warning("worker %s (%s) stopped answering: %s", w.address, w.role, e.code().name)
            w.health = None
            w.failed()

    @property
    def ready(self) -> bool:
        decode = any(w.healthy for w in self.of(Role.DECODE))
        prefill = any(w.healthy for w in self.of(Role.PREFILL))
        return (decode and prefill) or any(w.healthy for w in self.of(Role.COLOCATED))

    def capacity_tokens(self) -> int:
        """The largest KV capacity (tokens) of a healthy decode-capable worker (0: none known)."""
        return max((w.health.kv_capacity_tokens for w in self.of(Role.DECODE, Role.COLOCATED)
                    if w.healthy and w.health is not None), default=0)

    def pick_decode(self, need_tokens: int, exclude: set[str]) -> Worker | None:
        """A decode (or colocated) worker with room for `need_tokens` and the least work."""
        prefill_up = any(p.available() for p in self.of(Role.PREFILL))
        ok = [w for w in self.of(Role.DECODE, Role.COLOCATED) if w.available() and w.address not in exclude
              and w.health is not None and w.health.kv_capacity_tokens >= need_tokens
              and (w.role == Role.COLOCATED or prefill_up)]
        roomy = [w for w in ok if w.stats is None or w.stats.kv_tokens_free >= need_tokens] or ok
        return min(roomy, key=lambda w: w.outstanding + (w.stats.running + w.stats.waiting if w.stats else 0),
                   default=None)

    def pick_prefill(self, exclude: set[str]) -> Worker | None:
        ok = [w for w in self.of(Role.PREFILL) if w.available() and w.address not in exclude]
        return min(ok, key=lambda w: w.queued_tokens + (w.stats.waiting_tokens if w.stats else 0), default=None)

    async def close(self) -> None:
        for w in self.workers:
            if w.channel is not None:
                await w.channel.close()
