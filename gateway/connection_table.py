"""Who holds the gateway's connection slots: one table per server (`ConnectionTable`) counts
the open connections of each client address and in all, keeps the idle ones in the order they
went idle, and decides what a new connection gets: a slot, the slot of the connection idle
longest, or a refusal (gateway/framing.py Refusal).  The protocol (gateway/connections.py)
asks it and does what it says; nothing else changes its counts."""

from __future__ import annotations

import ipaddress
import resource
from dataclasses import dataclass
from typing import Protocol

from gateway.framing import Refusal


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection, and one client address, may hold (GatewayConfig's fields)."""
    max_connections: int
    max_connections_per_client: int
    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_connections_per_client", "max_header_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("header_timeout_s", "body_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")


class Slot(Protocol):
    def evict(self) -> None:
        """Close this connection: the table gave its slot to another."""


def client_key(host: str | None) -> str:
    """The address a per-client cap counts: the IP (an IPv4-mapped IPv6 one as IPv4), an IPv6
    address by its /64 (one host is usually given a whole /64)."""
    if host is None:
        return "local"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class ConnectionTable:
    """The open connections of one server, by client address, and which of them are idle (no
    request in flight), the longest idle first.  One owner: the protocol instances call
    `admit` when a connection opens, `mark` as requests come and go, `release` when it ends."""

    def __init__(self, limits: ConnectionLimits, tarpit_max: int | None = None) -> None:
        self.limits = limits
        self.tarpit_max = _half_the_open_files() if tarpit_max is None else tarpit_max
        self._tarpitted: set[Slot] = set()
        self._client: dict[Slot, str] = {}
        self._count: dict[str, int] = {}
        self._idle: dict[Slot, None] = {}          # insertion order: idle longest first

    def __len__(self) -> int:
        return len(self._client)

    @property
    def idle(self) -> int:
        return len(self._idle)

    def admit(self, slot: Slot, client: str) -> Refusal | None:
        """Take a slot for a new (idle) connection of `client`, evicting the connection idle
        longest when the table is full; or the refusal to answer it with (nothing taken)."""
        cap = self.limits.max_connections_per_client
        if self._count.get(client, 0) >= cap:
            return Refusal(f"too many open connections from your address (the limit is {cap}); close some or "
                           f"retry", "too_many_connections")
        if len(self._client) >= self.limits.max_connections:
            if not self._idle:
                return Refusal(f"the gateway is full: all of its {self.limits.max_connections} connections have "
                               f"a request in flight; retry shortly", "server_overloaded")
            oldest = next(iter(self._idle))
            self.release(oldest)
            oldest.evict()
        self._client[slot] = client
        self._count[client] = self._count.get(client, 0) + 1
        self._idle[slot] = None
        return None

    def tarpit(self, slot: Slot) -> bool:
        """Whether a connection refused 429 may be held (unread, answered later) rather than
        answered at once: an attacker reconnecting as fast as it is refused would make the
        gateway spend its time accepting and refusing.  At most `tarpit_max` are held (they
        cost a file descriptor each, and no work)."""
        if len(self._tarpitted) >= self.tarpit_max:
            return False
        self._tarpitted.add(slot)
        return True

    def untarpit(self, slot: Slot) -> None:
        self._tarpitted.discard(slot)

    def mark(self, slot: Slot, busy: bool) -> None:
        """A request is in flight on `slot` (busy) or not; idle ones queue up for eviction."""
        if slot not in self._client:
            return
        if busy:
            self._idle.pop(slot, None)
        elif slot not in self._idle:
            self._idle[slot] = None

    def release(self, slot: Slot) -> None:
        """Give `slot` back (a no-op when it holds none)."""
        client = self._client.pop(slot, None)
        if client is None:
            return
        self._idle.pop(slot, None)
        left = self._count[client] - 1
        if left:
            self._count[client] = left
        else:
            del self._count[client]


def _half_the_open_files() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(0, soft // 2) if soft != resource.RLIM_INFINITY else 1 << 14
