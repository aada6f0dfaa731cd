"""What the choices of one request share on their way through the workers (`Route`): the
worker pool, the request's id, tenant and deadline, the bounds on tries, waits and migrations,
and what migrations report (`MigrationObserver`, gateway/metrics.py MigrationMetrics)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from engine.errors import ErrorCode
from gateway.choice import Choice
from gateway.errors import Cause, ForwardError, MigrationFailure
from gateway.routing import WorkerPool


class MigrationObserver(Protocol):
    """What a choice's migrations report (gateway/metrics.py MigrationMetrics counts them).
    Called on the gateway's event loop; returns nothing and changes no choice."""

    def migrated(self, cause: Cause) -> None:
        """A stream broke after a token and moves to another pair (gateway/migration.py
        `migrate`): `cause` is the error table's `migrates` of the failure: LOST (the stream was
        cut or ended without a final message), DRAIN (the worker drains or shuts down) or ERROR
        (its step failed)."""

    def failed(self, reason: MigrationFailure) -> None:
        """A broken stream could not be continued and the choice ends with MIGRATION_FAILED:
        BOUND or CAPACITY (`migrate`, before another attempt), NO_WORKER or REFUSED (the
        resumed stream failed before its first message, `resume_failed`)."""

    def recomputed(self, tokens: int) -> None:
        """Prompt and generated tokens a migration's re-prefill computed (not found cached)."""

    def gap(self, seconds: float) -> None:
        """From the last token before a break to the first message after it."""


class NoObserver:
    """The observer of a Route built without one (as the tests build theirs; the gateway
    passes its MigrationMetrics): every call is ignored."""

    def migrated(self, cause: Cause) -> None: ...

    def failed(self, reason: MigrationFailure) -> None: ...

    def recomputed(self, tokens: int) -> None: ...

    def gap(self, seconds: float) -> None: ...


@dataclass(frozen=True)
class Route:
    """How one request's choices are forwarded."""
    pool: WorkerPool
    request_id: str                     # the response's id; a choice's is `choice_id(choice)`
    tenant: str
    deadline: float                     # time.monotonic() when the request's timeout passes
    max_attempts: int                   # failed tries of one stream before its first token
    capacity_wait_s: float              # how long one stream waits for a worker with room
    max_migrations: int                 # per choice
    observer: MigrationObserver = field(default_factory=NoObserver)

    def choice_id(self, choice: Choice) -> str:
        """The id of `choice` in the gateway's log and in its attempts' request ids (each
        attempt appends its number): the response's id and the choice's index,
        "<request_id>-<index>"."""
        return f"{self.request_id}-{choice.index}"

    def remaining_s(self) -> float:
        """Seconds to the deadline; raises ForwardError(TIMEOUT) when it passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ForwardError(ErrorCode.TIMEOUT, "the request timeout passed")
        return left
