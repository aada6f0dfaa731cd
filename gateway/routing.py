"""The workers the gateway knows, what their `Health` and `Stats` last said, a circuit
breaker each, a view of each one's prefix cache (gateway/cache_view.py), and the choice of a
decode and a prefill worker for a request.

The choice (`choose`), with routing "prefix": among the candidates (healthy, not excluded, with
room) take those whose load is within a slack of the least loaded one's,

    load(w) <= least + LOAD_SLACK_FRACTION * least + slack_min

and of those the one expected to hold the longest leading run of the prompt's page keys in its
prefix cache; ties (a cold prompt: 0 everywhere) go to the least loaded, then to the first
known.  Load is requests for a decode worker (this gateway's on it, plus the others' its last
Stats showed: `Worker.load`), slack_min DECODE_SLACK_REQUESTS; for a prefill worker it is prompt tokens queued,
slack_min the request's own prompt length (one more prompt's work).  So a worker that holds a
hot prefix gets its requests until it is that much busier than the others; then the next one
goes elsewhere (and that worker caches the prefix too).  With routing "load" the cache is not
consulted: the least loaded candidate wins.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from gateway.cache_view import CacheView, PrefixKeys, capacity_pages, follow
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
# (gRPC's default 4 MiB receive limit stays: a worker splits a large CacheEvents reset into
# messages of at most worker.cache_events.MAX_KEYS keys, about 0.6 MB)
LOAD_SLACK_FRACTION = 0.5         # prefix routing: how much busier than the least loaded a worker
DECODE_SLACK_REQUESTS = 2         # may be and still win by its cached prefix (module docstring)


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
    mine_at_stats: tuple[int, int] = (0, 0)  # (outstanding, queued_tokens) when `stats` was asked for
    failures: int = 0
    open_until: float = 0.0
    answered_at: float = 0.0                # time.monotonic() of its last Health answer
    decode_stub: wpb_grpc.DecodeServiceStub | None = None     # decode and colocated workers
    prefill_stub: wpb_grpc.PrefillServiceStub | None = None   # prefill workers
    cache: CacheView | None = None          # its prefix cache, from its CacheEvents (prefix routing)
    cache_task: asyncio.Task[None] | None = field(default=None, repr=False)   # following them
    cache_events: bool = True               # False once it answered UNIMPLEMENTED

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

    @property
    def draining(self) -> bool:
        """Its last Health said it drains: it admits nothing new (a request sent to it would be
        refused with DRAINING)."""
        return self.health is not None and self.health.draining

    def available(self) -> bool:
        """Whether new requests may go to it: healthy, not draining, its circuit closed."""
        return self.healthy and not self.draining and time.monotonic() >= self.open_until

    def failed(self) -> None:
        """A call could not reach it: after FAILURES_TO_OPEN in a row, stop sending for OPEN_S."""
        self.failures += 1
        if self.failures >= FAILURES_TO_OPEN:
            self.open_until = time.monotonic() + OPEN_S

    def succeeded(self) -> None:
        self.failures, self.open_until = 0, 0.0

    def cached_tokens(self, keys: PrefixKeys | None) -> int:
        """The prompt's leading tokens its prefix cache is expected to hold (0: none known)."""
        return self.cache.cached_tokens(keys) if self.cache is not None else 0

    @property
    def load(self) -> int:
        """Decode: requests on it; prefill: prompt tokens queued.  This gateway's own, counted
        now, plus the others' (other gateways'): what the worker's last Stats counted beyond this
        gateway's own at that moment.  Stats are up to a refresh old, so adding them to this
        gateway's count would count its requests twice and follow them a second late."""
        mine_then_requests, mine_then_tokens = self.mine_at_stats
        if self.role == Role.PREFILL:
            others = self.stats.waiting_tokens - mine_then_tokens if self.stats else 0
            return self.queued_tokens + max(0, others)
        others = self.stats.running + self.stats.waiting - mine_then_requests if self.stats else 0
        return self.outstanding + max(0, others)


class WorkerPool:
    def __init__(self, decode: tuple[str, ...], prefill: tuple[str, ...], colocated: tuple[str, ...],
                 secret: bytes, tls: TlsIdentity | None = None, routing: str = "prefix") -> None:
        self.routing = routing            # "prefix" (follow the workers' caches) or "load"
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
            self._unfollow(w)
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
            w.answered_at = time.monotonic()
            mine = (w.outstanding, w.queued_tokens)
            w.stats = await w.stub.Stats(wpb.StatsRequest(), timeout=2.0)
            w.mine_at_stats = mine
            self._follow(w)
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

    def _follow(self, w: Worker) -> None:
        """Follow the worker's cache events while it says it caches prefixes (prefix routing)."""
        h = w.health
        wanted = (self.routing == "prefix" and w.cache_events and h is not None and h.prefix_cache
                  and h.kv_page_size > 0)
        if wanted and w.cache_task is None:
            assert h is not None
            view = w.cache = CacheView(capacity_pages(h))
            w.cache_task = asyncio.get_running_loop().create_task(self._subscription(w, view))
        elif not wanted and w.cache_task is not None:
            self._unfollow(w)

    async def _subscription(self, w: Worker, view: CacheView) -> None:
        try:
            await follow(view, lambda: w.stub.CacheEvents(wpb.CacheEventsRequest()), w.address)
            w.cache_events = False            # UNIMPLEMENTED: an older worker
        except Exception:  # a bug must not end routing: this worker is routed by load alone
            log.exception("following the cache events of %s failed", w.address)
            view.clear()

    def _unfollow(self, w: Worker) -> None:
        if w.cache_task is not None:
            w.cache_task.cancel()
        w.cache_task, w.cache = None, None

    def page_sizes(self) -> set[int]:
        """The page sizes of the caches the workers' views follow (for the prompts' keys)."""
        return {w.cache.page_size for w in self.workers if w.cache is not None and w.cache.page_size}

    def pick_decode(self, need_tokens: int, exclude: set[str], keys: PrefixKeys | None = None) -> Worker | None:
        """A decode (or colocated) worker with room for `need_tokens`, not draining: the least
        loaded, or with prefix routing and `keys` (the prompt's) the one `choose` prefers."""
        prefill_up = any(p.available() for p in self.of(Role.PREFILL))
        ok = [w for w in self.of(Role.DECODE, Role.COLOCATED) if w.available() and w.address not in exclude
              and w.health is not None and w.health.kv_capacity_tokens >= need_tokens
              and (w.role == Role.COLOCATED or prefill_up)]
        roomy = [w for w in ok if w.stats is None or w.stats.kv_tokens_free >= need_tokens] or ok
        return choose(roomy, keys if self.routing == "prefix" else None, DECODE_SLACK_REQUESTS)

    def pick_prefill(self, exclude: set[str], keys: PrefixKeys | None = None, prompt_tokens: int = 0
                     ) -> Worker | None:
        """A prefill worker, not draining: the least loaded, or with prefix routing the one
        `choose` prefers (`prompt_tokens`: the request's, its load slack)."""
        ok = [w for w in self.of(Role.PREFILL) if w.available() and w.address not in exclude]
        return choose(ok, keys if self.routing == "prefix" else None, prompt_tokens)

    async def close(self) -> None:
        tasks = [w.cache_task for w in self.workers + self._retired if w.cache_task is not None]
        for w in self.workers + self._retired:
            self._unfollow(w)
        await asyncio.gather(*tasks, return_exceptions=True)
        for w in self.workers:
            if w.channel is not None:
                await w.channel.close()


def choose(candidates: list[Worker], keys: PrefixKeys | None, slack_min: float) -> Worker | None:
    """The worker for a request (module docstring): within the load slack of the least loaded,
    the longest expected cached prefix of `keys`, then the least load.  None: no candidate."""
    if not candidates:
        return None
    least = min(w.load for w in candidates)
    if keys is None:
        return next(w for w in candidates if w.load == least)
    bound = least + LOAD_SLACK_FRACTION * least + slack_min
    near = [w for w in candidates if w.load <= bound]
    return max(near, key=lambda w: (w.cached_tokens(keys), -w.load))
