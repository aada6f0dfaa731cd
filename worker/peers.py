"""The decode workers a prefill worker may push KV to (I9: prefill is not a signing oracle for
whatever endpoint a caller names).  A Prefill call whose decode endpoint is not one of the
deployment's is refused before anything is queued.

    under Ray        the registry's decode transfer endpoints (read again on a miss, at most
                     every `refresh_s`, so a decode worker that just joined is found)
    plain processes  the endpoints given with `--decode-peer` (python -m deploy.worker)
    colocated        its own in-process endpoint only
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

log = logging.getLogger("tandem.worker")
REFRESH_S = 0.5


class KnownPeers:
    """`peers(endpoint)` is True when prefill may push to `endpoint`.  Thread-safe."""

    def __init__(self, fixed: Iterable[str] = (), fetch: Callable[[], Iterable[str]] | None = None,
                 refresh_s: float = REFRESH_S, clock: Callable[[], float] = time.monotonic) -> None:
        """`fixed`: endpoints always allowed; `fetch`: reads the deployment's current ones (may
        raise: the miss is then refused, and the next one reads again)."""
        self._fixed = frozenset(fixed)
        self._fetch, self._refresh_s, self._clock = fetch, refresh_s, clock
        self._known = self._fixed
        self._read_at = float("-inf")
        self._lock = threading.Lock()

    def __call__(self, endpoint: str) -> bool:
        if endpoint in self._known:
            return True
        if self._fetch is None:
            return False
        with self._lock:
            if self._clock() - self._read_at >= self._refresh_s:
                self._read_at = self._clock()
                try:
                    self._known = self._fixed | frozenset(self._fetch())
                except Exception as e:  # the registry restarting: refuse this one, read again later
                    log.warning("reading the decode workers' endpoints: %s", e)
            return endpoint in self._known

    def describe(self) -> str:
        """The endpoints known now, for an error message (at most a few)."""
        known = sorted(self._known)
        more = f" and {len(known) - 4} more" if len(known) > 4 else ""
        return ", ".join(known[:4]) + more if known else "none"
