"""One choice of a request as the gateway forwards it: its state across attempts and
migrations (`Choice`), the error a request fails with (`ForwardError`), a stream that broke
after a token (`StreamBroken`), and what migrations report (`MigrationObserver`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from engine.errors import ErrorCode
from engine.params import SamplingParams
from gateway.cache_view import PrefixKeys
from gateway.errors import public
from gateway.routing import WorkerPool
from proto import worker_pb2 as wpb

UNKNOWN_STATUS = 502                  # a code this gateway does not know: the worker side failed it


class ForwardError(Exception):
    """A request that failed, with the code and HTTP status the client gets."""

    def __init__(self, code: ErrorCode, message: str, status: int | None = None):
        super().__init__(f"{code.value}: {message}")
        self.code, self.message = code, message
        self.status = status or public(code).status      # gateway/errors.py, the one table

    @classmethod
    def from_proto(cls, error: wpb.Error, prefix: str = "") -> ForwardError:
        """A worker's Error message.  A code this gateway does not know (a newer worker) is
        answered as INTERNAL with status 502, the worker's code kept in the message."""
        try:
            return cls(ErrorCode(error.code), prefix + error.message)
        except ValueError:
            return cls(ErrorCode.INTERNAL, f"{prefix}{error.code}: {error.message}", UNKNOWN_STATUS)


class StreamBroken(Exception):
    """The decode stream broke after it streamed a token: `cause` is "lost" (the stream was cut
    or ended without a final message), "drain" (the worker drains or shuts down) or "error"
    (its step failed); `address`: the decode worker's."""

    def __init__(self, cause: str, error: ForwardError, address: str):
        super().__init__(f"{cause}: {error}")
        self.cause, self.error, self.address = cause, error, address


class MigrationObserver(Protocol):
    """What a choice's migrations report (gateway/metrics.py MigrationMetrics)."""

    def migrated(self, cause: str) -> None: ...

    def failed(self, reason: str) -> None: ...

    def recomputed(self, tokens: int) -> None:
        """Prompt and generated tokens a migration's re-prefill computed (not found cached)."""

    def gap(self, seconds: float) -> None:
        """From the last token before a break to the first message after it."""


class NoObserver:
    def migrated(self, cause: str) -> None: ...

    def failed(self, reason: str) -> None: ...

    def recomputed(self, tokens: int) -> None: ...

    def gap(self, seconds: float) -> None: ...


@dataclass(frozen=True)
class Prompt:
    """What the workers get of a request's prompt besides its tokens: its cache salt (the
    request's `cache_salt`, "" for none) and its page keys for prefix routing (None: route by
    load alone)."""
    cache_salt: str = ""
    keys: PrefixKeys | None = None


@dataclass
class Choice:
    """One choice's forwarding state, kept across its attempts and migrations."""
    pool: WorkerPool
    request_id: str
    tenant: str
    ids: list[int]                      # the original prompt
    params: SamplingParams              # the client's
    deadline: float                     # time.monotonic() when the request's timeout passes
    max_attempts: int                   # tries of one stream before its first token
    capacity_wait_s: float              # how long one stream waits for a worker with room
    prompt: Prompt = Prompt()
    observer: MigrationObserver = field(default_factory=NoObserver)
    generated: list[int] = field(default_factory=list)   # token ids streamed to the client so far
    seed: int | None = None             # the seed of the reservation whose stream gave the first token
    cached_tokens: int | None = None    # that reservation's cached prompt tokens (the choice's usage)
    attempts: int = 0                   # Generate calls made (each gets its own request id)
    leaving: set[str] = field(default_factory=set)   # workers that said DRAINING (or UNAVAILABLE): not again

    @property
    def need_tokens(self) -> int:
        """KV tokens a decode worker reserves for it: prompt + max_tokens, migrated or not."""
        return len(self.ids) + self.params.max_tokens

    def remaining_s(self) -> float:
        """Seconds to the deadline; raises ForwardError(TIMEOUT) when it passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ForwardError(ErrorCode.TIMEOUT, "the request timeout passed")
        return left
