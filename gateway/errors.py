"""The public error table: every `code` an HTTP error body of the gateway carries, with its
HTTP status and whether waiting may fix it.

One spelling per code, lowercase snake_case, whoever raised it: a refusal of the gateway
(`Rejected.reason`, gateway/admission.py) or a failure past it (each `ErrorCode` of the
workers' protocol, whose wire values stay upper case, is answered as its lowercase spelling:
`INVALID_REQUEST` -> `invalid_request`).  Retryable codes (429 for what waiting on the client's
own load fixes, 5xx for the cluster's) carry `Retry-After`; a request that can never succeed
as sent is a 4xx without it, so clients (the official openai client retries 429, 408 and 5xx)
do not send it again.  This module is a leaf: no FastAPI, no torch.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any

from engine.errors import ErrorCode

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


def _table(*entries: PublicError) -> dict[str, PublicError]:
    return {e.code: e for e in entries}


ERRORS: dict[str, PublicError] = _table(
    # what the client sent: sending it again changes nothing
    PublicError("invalid_body", 400, False, "the body is not a JSON object sent with Content-Type: application/json"),
    PublicError("invalid_json", 400, False, "the body is not valid JSON (the message names the position)"),
    PublicError("schema", 400, False, "a field has the wrong type or a required one is missing (param names it)"),
    PublicError("invalid_request", 400, False, "a bad value or combination of values"),
    PublicError("out_of_range", 400, False, "an integer field or a count outside its limit (param names it)"),
    PublicError("unsupported", 400, False, "an option this server cannot honour"),
    PublicError("too_many_choices", 400, False, "prompts x n over max_n"),
    PublicError("context_length", 400, False, "prompt + max_tokens over the model's context"),
    PublicError("kv_capacity", 400, False, "prompt + max_tokens over the largest decode worker's KV capacity, "
                                           "or all choices over every decode worker's together"),
    PublicError("kv_budget", 400, False, "all choices' prompt + max_tokens over the tenant's whole KV budget"),
    PublicError("prompt_too_long", 400, False, "(a worker) prompt + max_tokens over its context or KV capacity"),
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
    PublicError("cancelled", 499, False, "the client went away (never read)"),
    # the client's own load, or the cluster's: waiting fixes it
    PublicError("queue_full", 429, True, "the gateway's queue is full"),
    PublicError("tenant_limit", 429, True, "the tenant has tenant_max_concurrency requests in flight"),
    PublicError("kv_budget_in_use", 429, True, "the tenant's other requests hold the KV budget this one needs"),
    PublicError("grammar_queue_full", 429, True, "too many structured outputs compiling (grammar_max_pending)"),
    PublicError("grammar_tenant_limit", 429, True, "the tenant has grammar_tenant_max_pending compiling"),
    PublicError("too_many_connections", 429, True, "the client's address holds max_connections_per_client "
                                                   "connections"),
    PublicError("timeout", 408, False, "the request ran past request_timeout_s"),
    PublicError("queue_timeout", 503, True, "no slot or KV room freed within queue_timeout_s"),
    PublicError("no_worker", 503, True, "no worker is ready or has room"),
    PublicError("kv_full", 503, True, "the decode workers had no room within the queue timeout"),
    PublicError("draining", 503, True, "the gateway or every worker that could take it is draining"),
    PublicError("unavailable", 503, True, "the worker was shutting down"),
    PublicError("server_overloaded", 503, True, "the gateway holds as many connections as it may"),
    # a worker failed
    PublicError("prefill_unavailable", 502, True, "no prefill worker could be reached"),
    PublicError("decode_unavailable", 502, True, "no decode worker could be reached"),
    PublicError("decode_failed", 502, True, "the decode worker failed while generating"),
    PublicError("transfer_failed", 502, True, "the prompt's KV could not be moved between the workers"),
    PublicError("migration_failed", 502, True, "a broken stream could not be continued on another worker"),
    PublicError("unknown_peer", 502, False, "a prefill worker was pointed at a decode endpoint it does not know"),
    PublicError("aborted", 502, False, "the request was aborted"),
    PublicError("internal", 500, False, "a bug: the message has an id, the log has the traceback"),
)
# The framework's own refusals (Starlette's HTTPException), by status.
HTTP_CODES = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


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
