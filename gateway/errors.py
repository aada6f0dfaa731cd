"""The gateway's error table: every `code` an HTTP error body carries, with its HTTP status
and whether waiting may fix it, and for each `ErrorCode` of the workers' protocol what the
gateway does with a failure of that code: try another worker pair, wait for one, or give up
before the choice's first token; migrate the choice after one (and with which cause); what the
client is told.  Every consumer reads its entry here: the attempts of gateway/attempt.py and
gateway/forward.py, gateway/migration.py, the answers of gateway/completions.py.

One spelling per code, lowercase snake_case, whoever raised it: a refusal of the gateway
(`Rejected.reason`, gateway/admission.py) or a failure past it (each `ErrorCode`, whose wire
values stay upper case, is answered as its lowercase spelling: `INVALID_REQUEST` ->
`invalid_request`).  Retryable codes (429 for what waiting on the client's own load fixes, 5xx
for the cluster's) carry `Retry-After`; a request that can never succeed as sent is a 4xx
without it, so clients (the official openai client retries 429, 408 and 5xx) do not send it
again.  No FastAPI, no torch: the connection layer reads it too.
"""

from __future__ import annotations

import enum
import string
from dataclasses import dataclass, field
from typing import Any

import grpc

from engine.errors import ErrorCode
from proto import worker_pb2 as wpb

RETRY_AFTER_S = 1                    # what a retryable answer's Retry-After says, in seconds
MAX_SHOWN_CHARS = 64                 # of a client-supplied name quoted in an error message
_SPELLING = frozenset(string.ascii_lowercase + string.digits + "_")


@dataclass(frozen=True)
class PublicError:
    """What a client is told an error code means."""
    code: str                        # the error body's `code`
    status: int                      # the HTTP status it is answered with
    retryable: bool                  # the same request may succeed later: answered with Retry-After
    meaning: str                     # for the documentation's table and the log

    def __post_init__(self) -> None:
        if not (self.code[:1].isalpha() and set(self.code) <= _SPELLING):
            raise ValueError(f"error code {self.code!r} is not lowercase snake_case")
        if self.retryable and self.status not in (408, 429) and self.status < 500:
            raise ValueError(f"error code {self.code!r}: a {self.status} is not retryable")

    @property
    def type(self) -> str:
        return error_type(self.status)

    def headers(self) -> dict[str, str] | None:
        """`Retry-After` for a retryable code, else None."""
        return {"Retry-After": str(RETRY_AFTER_S)} if self.retryable else None


class Next(enum.Enum):
    """What a failure before a choice's first token leads to (gateway/forward.py)."""
    GIVE_UP = "give up"              # the request fails with it
    RETRY = "retry"                  # that pair failed: try another (a failed attempt: at most max_attempts)
    WAIT = "wait"                    # that worker has no room now: try another, and it again after a wait
    LEAVE = "leave"                  # that worker is going away: try another, never it again for this choice


class Cause(enum.StrEnum):
    """Why a choice's stream moved to another worker pair (tandem_migrations_total{cause})."""
    LOST = "lost"                    # the stream was cut, or ended without a final message
    DRAIN = "drain"                  # the worker drains or shuts down
    ERROR = "error"                  # its step failed


class MigrationFailure(enum.StrEnum):
    """Why a broken stream could not be continued, so the choice ended with MIGRATION_FAILED
    (tandem_migrations_failed_total{reason}; gateway/migration.py)."""
    BOUND = "bound"                  # the choice was past max_migrations
    CAPACITY = "capacity"            # no other decode worker can hold prompt + max_tokens
    NO_WORKER = "no_worker"          # the resumed stream found no worker or no room (a no_room code): 503
    REFUSED = "refused"              # the resumed stream was refused or failed otherwise: 502


@dataclass(frozen=True)
class CodePolicy:
    """One `ErrorCode`: what the client is told (`public`: spelling, HTTP status, Retry-After;
    `message`: the public message, None for the worker's own words about what the client sent)
    and what the gateway does with a failure of that code."""
    code: ErrorCode
    status: int
    retryable: bool
    meaning: str                     # for the documentation's table and the log
    message: str | None
    before_token: Next = Next.GIVE_UP
    # the cluster has no worker or no room for it now (one may come back): with no pair left to
    # try, the choice waits for one (up to the queue timeout); a migration failing so is "no_worker"
    no_room: bool = False
    migrates: Cause | None = None    # after a token, the choice moves to another pair, with this cause
    # a Prefill call that fails with it before a token: the decode worker's receiver refused or
    # broke the push (at its stream cap, say): the retry asks another decode worker
    excludes_decode: bool = False
    # the request's own end (its timeout, its caller's cancel or abort): never moved, and a resumed
    # stream that ends so keeps its code (not MIGRATION_FAILED)
    own: bool = False
    public: PublicError = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "public", PublicError(self.code.value.lower(), self.status, self.retryable,
                                                       self.meaning))

    @property
    def counts(self) -> bool:
        """Whether a retry after it is a failed attempt (a worker with no room now, or going
        away, is not)."""
        return self.before_token not in (Next.WAIT, Next.LEAVE)


def _table(*entries: PublicError) -> dict[str, PublicError]:
    return {e.code: e for e in entries}


_E = ErrorCode
_KV_MOVE = "the prompt's KV cache could not be moved between the workers"
CODES: dict[ErrorCode, CodePolicy] = {p.code: p for p in (
    # what the client sent: the worker's words say what to change
    CodePolicy(_E.INVALID_REQUEST, 400, False, "a bad value or combination of values", None),
    CodePolicy(_E.PROMPT_TOO_LONG, 400, False, "(a worker) prompt + max_tokens over its context or KV capacity",
               None),
    # the request's own end
    CodePolicy(_E.TIMEOUT, 408, False, "the request ran past request_timeout_s",
               "the request ran past its timeout", own=True),
    CodePolicy(_E.CANCELLED, 499, False, "the client went away (never read)", "the request was cancelled", own=True),
    CodePolicy(_E.ABORTED, 502, False, "the request was aborted", "the request was aborted", own=True),
    # no worker or no room now: waiting fixes it
    CodePolicy(_E.NO_WORKER, 503, True, "no worker is ready or has room",
               "no worker can take this request now; retry later", no_room=True),
    CodePolicy(_E.KV_FULL, 503, True, "the decode workers had no room within the queue timeout",
               "the decode workers have no room for this request now; retry later", Next.WAIT, no_room=True),
    CodePolicy(_E.DRAINING, 503, True, "the gateway or every worker that could take it is draining",
               "the workers were draining; retry later", Next.LEAVE, no_room=True, migrates=Cause.DRAIN),
    CodePolicy(_E.UNAVAILABLE, 503, True, "the worker was shutting down", "the worker was shutting down; retry",
               Next.LEAVE, no_room=True, migrates=Cause.DRAIN),
    # a worker failed
    CodePolicy(_E.PREFILL_UNAVAILABLE, 502, True, "no prefill worker could be reached",
               "no prefill worker could be reached; retry later", Next.RETRY, no_room=True),
    CodePolicy(_E.DECODE_UNAVAILABLE, 502, True, "no decode worker could be reached",
               "no decode worker could be reached; retry later", Next.RETRY, no_room=True, migrates=Cause.LOST),
    CodePolicy(_E.TRANSFER_FAILED, 502, True, "the prompt's KV could not be moved between the workers", _KV_MOVE,
               Next.RETRY, excludes_decode=True),
    CodePolicy(_E.DECODE_FAILED, 502, True, "the decode worker failed while generating",
               "the decode worker failed while generating"),
    CodePolicy(_E.MIGRATION_FAILED, 502, True, "a broken stream could not be continued on another worker",
               "the decode worker failed while generating and the stream could not be continued on another; retry"),
    CodePolicy(_E.UNKNOWN_PEER, 502, False, "a prefill worker was pointed at a decode endpoint it does not know",
               _KV_MOVE),
    CodePolicy(_E.INTERNAL, 500, False, "a bug: the message has an id, the log has the traceback", "internal error",
               migrates=Cause.ERROR),
)}
UNKNOWN_CODE_STATUS = 502            # a worker's code this gateway does not know: the worker side failed it
# A decode call that ends with one of these gRPC statuses lost its worker (it died, its connection
# was reset, its server stopped): DECODE_UNAVAILABLE, as a stream cut on this side or ended without a
# final message.  DEADLINE_EXCEEDED is the request's TIMEOUT; any other status DECODE_FAILED.
LOST_STATUSES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
                           grpc.StatusCode.INTERNAL})


ERRORS: dict[str, PublicError] = _table(
    # what the client sent: sending it again changes nothing
    PublicError("invalid_body", 400, False, "the body is not a JSON object sent with Content-Type: application/json"),
    PublicError("invalid_json", 400, False, "the body is not valid JSON (the message names the position)"),
    PublicError("schema", 400, False, "a field has the wrong type or a required one is missing (param names it)"),
    PublicError("out_of_range", 400, False, "an integer field or a count outside its limit (param names it)"),
    PublicError("unsupported", 400, False, "an option this server cannot honour"),
    PublicError("too_many_choices", 400, False, "prompts x n over max_n"),
    PublicError("context_length", 400, False, "prompt + max_tokens over the model's context"),
    PublicError("kv_capacity", 400, False, "prompt + max_tokens over the largest decode worker's KV capacity, "
                                           "or all choices over every decode worker's together"),
    PublicError("kv_budget", 400, False, "all choices' prompt + max_tokens over the tenant's whole KV budget"),
    PublicError("invalid_constraint", 400, False, "a structured output that cannot be compiled"),
    PublicError("grammar_timeout", 400, False, "a structured output that did not compile in time"),
    PublicError("invalid_api_key", 401, False, "no API key, or an unknown one"),
    PublicError("invalid_admin_key", 401, False, "an admin endpoint without an admin key"),
    PublicError("not_found", 404, False, "no such endpoint"),
    PublicError("model_not_found", 404, False, "another model's name"),
    PublicError("method_not_allowed", 405, False, "the endpoint does not take this method"),
    PublicError("body_too_large", 413, False, "a body over max_body_bytes"),
    PublicError("invalid_http", 400, False, "a request h11 cannot parse (the connection is closed)"),
    PublicError("ambiguous_framing", 400, False, "framing a proxy may read otherwise: Content-Length beside "
                                                 "Transfer-Encoding, two lengths, ... (the connection is closed)"),
    PublicError("header_too_large", 431, False, "a request head over max_header_bytes (the connection is closed)"),
    PublicError("request_timeout", 408, False, "a head not whole within header_timeout_s, or a body with no byte "
                                               "for body_timeout_s (the connection is closed)"),
    # the client's own load, or the cluster's: waiting fixes it
    PublicError("queue_full", 429, True, "the gateway's queue is full"),
    PublicError("tenant_limit", 429, True, "the tenant has tenant_max_concurrency requests in flight"),
    PublicError("kv_budget_in_use", 429, True, "the tenant's other requests hold the KV budget this one needs"),
    PublicError("grammar_queue_full", 429, True, "too many structured outputs compiling (grammar_max_pending)"),
    PublicError("grammar_tenant_limit", 429, True, "the tenant has grammar_tenant_max_pending compiling"),
    PublicError("too_many_connections", 429, True, "the client's address holds max_connections_per_client "
                                                   "connections"),
    PublicError("queue_timeout", 503, True, "no slot or KV room freed within queue_timeout_s"),
    PublicError("server_overloaded", 503, True, "the gateway holds as many connections as it may"),
    # each ErrorCode's (CODES)
    *(p.public for p in CODES.values()),
)
# The framework's own refusals (Starlette's HTTPException), by status.
HTTP_CODES = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


def policy(code: ErrorCode) -> CodePolicy:
    """The table's entry of `code`: every ErrorCode has one (tests/test_gateway_error_table.py)."""
    return CODES[code]


def call_error(status: grpc.StatusCode) -> ErrorCode:
    """The code of a decode call that broke with gRPC `status` (LOST_STATUSES)."""
    if status == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ErrorCode.TIMEOUT
    return ErrorCode.DECODE_UNAVAILABLE if status in LOST_STATUSES else ErrorCode.DECODE_FAILED


class ForwardError(Exception):
    """A request that failed past the gateway, with its code and the HTTP status the client gets
    (the table's, unless `status` says otherwise)."""

    def __init__(self, code: ErrorCode, message: str, status: int | None = None):
        super().__init__(f"{code.value}: {message}")
        self.code, self.message = code, message
        self.status = status or CODES[code].status

    @classmethod
    def from_proto(cls, error: wpb.Error, prefix: str = "") -> ForwardError:
        """A worker's Error message.  A code this gateway does not know (a newer worker) is
        answered as INTERNAL with UNKNOWN_CODE_STATUS, the worker's code kept in the message."""
        try:
            return cls(ErrorCode(error.code), prefix + error.message)
        except ValueError:
            return cls(ErrorCode.INTERNAL, f"{prefix}{error.code}: {error.message}", UNKNOWN_CODE_STATUS)

    @property
    def policy(self) -> CodePolicy:
        """The error table's entry of its code (`CODES`): what the attempts, the picker and the
        migration do with it.  A worker's code this gateway does not know is INTERNAL's."""
        return CODES[self.code]


def public_message(code: ErrorCode, detail: str, request_id: str) -> str:
    """What the client is told of a request that failed past the gateway: its code's public
    message and the request id, never a worker's address, a gRPC status or another request's
    id (those stay in the gateway's log, under that request id); a refusal of what the client
    sent (INVALID_REQUEST, PROMPT_TOO_LONG) keeps the worker's words, `detail`."""
    message = CODES[code].message
    return detail if message is None else f"{message} (request id {request_id})"


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    if status == 401:
        return "authentication_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def public(code: str | ErrorCode, status: int | None = None) -> PublicError:
    """The table's entry of `code` (a refusal reason or an ErrorCode).  A code the table lacks
    (tests/test_gateway_errors.py keeps every code raised in the gateway in it) is answered
    with its lowercase spelling, at `status` (else 500), not retryable."""
    key = code.value.lower() if isinstance(code, ErrorCode) else code
    found = ERRORS.get(key)
    if found is not None:
        return found
    spelled = "".join(c if c in _SPELLING else "_" for c in key.lower()[:MAX_SHOWN_CHARS])
    return PublicError(spelled if spelled[:1].isalpha() else "internal", status or 500, False, "")


def error_body(code: str | ErrorCode, message: str, param: str | None = None,
               status: int | None = None) -> dict[str, Any]:
    """OpenAI's error body for `code`; `status` when the response's differs from the table's
    (its `type` follows the status)."""
    entry = public(code, status)
    return {"error": {"message": message, "type": error_type(status or entry.status), "param": param,
                      "code": entry.code}}


def shown(name: str, limit: int = MAX_SHOWN_CHARS) -> str:
    """A client-supplied name as an error message quotes it: repr'd, cut to `limit`
    characters with how long it was (a 100,000-character model name is not echoed whole)."""
    if len(name) <= limit:
        return repr(name)
    return f"{name[:limit]!r}... ({len(name)} characters)"
