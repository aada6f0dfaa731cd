"""Fair share between tenants: whom a request counts against, the KV tokens it reserves, the KV
limits the admission queue admits against (read from the decode workers' Health), and metric
labels for tenants in a bounded number.

With API keys, a tenant is the key's tenant.  Without, the client's address stands in for it in
the gateway's limits and metrics (an IPv6 client by its /64, which one host usually holds whole);
the tenant the workers see stays `default`: it names the isolation domain of the ownership tags
and of the prefix cache (its salt is derived from the tenant, engine/prefix_cache.py), and
anonymous clients are one domain — an address is no identity.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Callable, Sequence
from typing import Protocol

from starlette.requests import Request

from gateway.config import GatewayConfig
from gateway.routing import WorkerPool
from worker.types import Role

ADDRESS = "addr:"                # share keys of address tenants start with this
ADDRESS_LABELS = 16              # metric label values for address tenants, at most
IPV6_PREFIX = 64


def share_key(request: Request, tenant: str, keyed: bool) -> str:
    """Whom the request counts against in the tenants' limits: its tenant when API keys are
    configured, else its client's address (`addr:203.0.113.7`, `addr:2001:db8:1:2::/64`)."""
    if keyed or request.client is None or not request.client.host:
        return tenant
    return ADDRESS + client_network(request.client.host)


def client_network(host: str) -> str:
    """An IPv4 address as is, an IPv6 address as its /64 (a host that could rotate through its
    prefix counts once), anything else (a unix socket's name) cut to 64 characters."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host[:64]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, IPV6_PREFIX), strict=False))
    return str(ip)


def tenant_label(key: str) -> str:
    """The metric label of a share key: an API-key tenant by its name (the keys table bounds
    them), an address by one of ADDRESS_LABELS buckets `addr-00`.. (a stable hash), so any number
    of clients gives at most that many label values."""
    if not key.startswith(ADDRESS):
        return key
    bucket = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") % ADDRESS_LABELS
    return f"addr-{bucket:02d}"


class NeedsKv(Protocol):
    """Something that reserves KV tokens on a decode worker (a `gateway.choice.Choice`)."""

    @property
    def need_tokens(self) -> int:
        """Its prompt + max_tokens."""
        ...


def reserved_tokens(choices: Sequence[NeedsKv]) -> int:
    """The KV tokens a request reserves on the decode workers: prompt + max_tokens for each
    choice, the whole prompt even where a decode worker's prefix cache holds part of it (the
    gateway admits before any worker says what it has cached): an upper bound."""
    return sum(c.need_tokens for c in choices)


class ClusterKv:
    """The admission queue's KV limits (admission.KvLimits), from the decode workers' last Health:
    the cluster holds the sum of their capacities; a tenant may hold `tenant_max_kv_tokens`, or by
    default half the cluster (all of it when the API keys name one tenant: nobody to share with),
    but never less than one request of the longest length the 400 checks let through (min(context,
    largest worker)), so the default refuses no single-choice request that could run."""

    def __init__(self, pool: WorkerPool, config: GatewayConfig, context_len: Callable[[], int]) -> None:
        self.pool, self.fixed, self.context_len = pool, config.tenant_max_kv_tokens, context_len
        self.alone = len(set(config.api_keys.values())) == 1

    def cluster_tokens(self) -> int:
        return sum(w.health.kv_capacity_tokens for w in self.pool.of(Role.DECODE, Role.COLOCATED)
                   if w.healthy and w.health is not None)

    def tenant_tokens(self) -> int:
        if self.fixed is not None:
            return self.fixed
        cluster = self.cluster_tokens()
        share = cluster if self.alone else cluster // 2
        return max(share, min(self.context_len(), self.pool.capacity_tokens()))
