"""How one attempt of a choice on a worker pair ended (gateway/attempt.py sets it): what the
loop over attempts (gateway/forward.py) and the migration (gateway/migration.py) read.

    Finished   the stream ended with its Finish
    Retry      nothing was streamed; another pair may succeed
    Broken     the stream broke after a token: the choice migrates
    Failed     no attempt may succeed: the request fails
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import Cause, ForwardError


class Outcome:
    """How an attempt ended."""


@dataclass(frozen=True)
class Finished(Outcome):
    """The stream ended with its Finish (recorded in the choice)."""


@dataclass(frozen=True)
class Retry(Outcome):
    """Nothing was streamed, and another attempt may succeed: `error` says why (the error table
    says whether it was a failed attempt), `exclude` are the workers not to ask again for this
    stream, `last_resort` a prefill worker whose push broke (asked only when no other is up)."""
    error: ForwardError
    exclude: frozenset[str] = frozenset()
    last_resort: str | None = None


@dataclass(frozen=True)
class Broken(Outcome):
    """The stream broke after it streamed a token: the choice migrates, for `cause`; `address`
    is the decode worker's."""
    cause: Cause
    error: ForwardError
    address: str


@dataclass(frozen=True)
class Failed(Outcome):
    """No attempt may succeed: the request fails with `error`."""
    error: ForwardError
