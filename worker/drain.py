"""Draining a worker: it stops admitting, lets its live requests finish for a grace period, then
ends the rest with DRAINING (their pages freed), so a gateway continues them elsewhere (a decode
stream after a token is migrated, anything before it retried).

    drain(worker.roles, grace_s=30)   # -> DrainResult(finished, drained), once none is left

Used by the Drain RPC of both services (`drain_reply`) and by `WorkerHandle.drain`.  While
draining, `reserve`/`submit` refuse with DRAINING and Health and Stats say `draining`; `undrain`
admits again.  A drain undone during its grace period ends nothing.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.errors import ErrorCode
from proto import worker_pb2 as wpb

log = logging.getLogger("tandem.worker")
MAX_GRACE_S = 3600.0          # a Drain call's grace period is clamped to this
END_WAIT_S = 30.0             # how long a drain waits for the requests it ended to be gone
DRAINED_MESSAGE = "the worker is draining: the request continues on another worker"


class Drainable(Protocol):
    """A role engine that can drain (every `worker.role.RoleEngine`).  Every method is safe to
    call from any thread."""

    counts: Counter[str]        # counts["drained"]: requests it ended with DRAINING

    @property
    def draining(self) -> bool:
        """Between start_drain and undrain: new requests are refused with DRAINING."""
        ...

    def start_drain(self) -> None:
        """Refuse every later request with DRAINING (one being admitted now is either refused
        or listed by `live` after this returns)."""
        ...

    def undrain(self) -> None:
        """Admit requests again."""
        ...

    def live(self) -> list[str]:
        """The ids of its requests that have not ended."""
        ...

    def end_live(self, code: ErrorCode, message: str) -> int:
        """End every live request with an explicit error `code` and free its pages (posted to
        the worker loop, like an abort).  Returns how many it asked to end."""
        ...


@dataclass(frozen=True)
class DrainResult:
    finished: int               # requests live when the drain began that ended within the grace period
    drained: int                # requests still live after it, ended with DRAINING


def drain(engines: Sequence[Drainable], grace_s: float, poll_s: float = 0.05, end_wait_s: float = END_WAIT_S,
          clock: Callable[[], float] = time.monotonic) -> DrainResult:
    """Stop admitting on every engine, wait up to `grace_s` for their live requests to end, then
    end the rest with DRAINING and wait (up to `end_wait_s`) until they are gone.  A request id
    live on two engines (a colocated worker's prefill and decode) counts once.  Returns when no
    request is left (or the drain was undone: nothing is ended then)."""
    for e in engines:
        e.start_drain()
    began = _live(engines)
    deadline = clock() + grace_s
    while _live(engines) and clock() < deadline and _draining(engines):
        time.sleep(poll_s)
    if not _draining(engines):
        log.info("drain undone during its grace period: %d requests left running", len(_live(engines)))
        return DrainResult(len(began - _live(engines)), 0)
    left = _live(engines)
    for e in engines:
        e.end_live(ErrorCode.DRAINING, DRAINED_MESSAGE)
    end = clock() + end_wait_s
    while _live(engines) and clock() < end:
        time.sleep(poll_s)
    if _live(engines):
        log.error("drain: %d requests still live %.0f s after they were ended", len(_live(engines)), end_wait_s)
    log.info("drained: %d requests finished within %.1f s, %d ended with DRAINING",
             len(began - left), grace_s, len(left))
    return DrainResult(len(began - left), len(left))


def _draining(engines: Sequence[Drainable]) -> bool:
    return all(e.draining for e in engines)


def _live(engines: Sequence[Drainable]) -> set[str]:
    return {rid for e in engines for rid in e.live()}


def drain_reply(engines: Sequence[Drainable], request: wpb.DrainRequest) -> wpb.DrainReply:
    """The Drain RPC: drain (`request.grace_s`, clamped to MAX_GRACE_S) or, with `undo`, admit
    again.  Raises ValueError for a grace period that is negative or not a number."""
    if request.undo:
        for e in engines:
            e.undrain()
        return wpb.DrainReply(draining=False)
    grace = request.grace_s
    if math.isnan(grace) or grace < 0:
        raise ValueError(f"grace_s={grace} must be >= 0")
    result = drain(engines, min(grace, MAX_GRACE_S))
    return wpb.DrainReply(finished=result.finished, drained=result.drained,
                          draining=_draining(engines))
