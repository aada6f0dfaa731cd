"""Idle connections kept for the next transfer to the same receiver (shm://, nixl://): a
connection and its registered or shared buffer cost far more to set up than a transfer's
frames, so a clean one serves transfer after transfer."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, Protocol, TypeVar


class Channel(Protocol):
    @property
    def key(self) -> Hashable:
        """Who may reuse it: (path, buffer bytes, protocol versions)."""

    def idle_and_alive(self) -> bool:
        """Nothing to read on an idle channel: anything readable means the peer hung up."""

    def close(self) -> None: ...


C = TypeVar("C", bound=Channel)


class IdleChannels(Generic[C]):
    def __init__(self) -> None:
        self._idle: dict[Hashable, list[C]] = {}
        self._lock = threading.Lock()

    def take(self, key: Hashable, make: Callable[[], C]) -> C:
        """An idle live channel for `key`, or a new one from `make` (dead ones are closed)."""
        with self._lock:
            idle = self._idle.get(key, [])
            while idle:
                ch = idle.pop()
                if ch.idle_and_alive():
                    return ch
                ch.close()
        return make()

    def give_back(self, ch: C) -> None:
        with self._lock:
            self._idle.setdefault(ch.key, []).append(ch)

    def close_all(self) -> None:
        """Close every idle channel (tests, shutdown)."""
        with self._lock:
            for chans in self._idle.values():
                for ch in chans:
                    ch.close()
            self._idle.clear()


def ring_fit(inflight: deque[tuple[int, int]], size: int, n: int) -> int | None:
    """Where `n` bytes fit in a ring of `size` bytes without touching a span in use, or None.
    `inflight`: the (offset, nbytes) spans in use, oldest first (a sender's shared segment or
    NIXL staging ring: a span is free again once the receiver answered for it)."""
    if not inflight:
        return 0
    tail = inflight[0][0]
    last, last_n = inflight[-1]
    head = last + last_n                          # the end of the newest span in use
    if last >= tail:                              # not wrapped: free [head, size) + [0, tail)
        if head + n <= size:
            return head
        return 0 if n <= tail else None
    return head if head + n <= tail else None     # wrapped: free [head, tail)
