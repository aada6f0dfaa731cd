"""A request head as it arrived, checked before h11 parses it: its size against the header
limit, and its framing.

h11 bounds only an *incomplete* event (`max_incomplete_event_size`): a head that arrives in
one read is parsed whole however long it is, so the limit is counted here on the raw bytes,
however they came.  h11 also takes framing a proxy in front may read otherwise (RFC 9112
section 6.3 names these as smuggling): Content-Length beside Transfer-Encoding (h11 follows
the chunks, a proxy may follow the length), identical duplicate Content-Length headers
(merged), `Transfer-Encoding: Chunked` (lower-cased), bare LF line ends and folded header
lines (joined).  Each is a `Refusal` here, answered 400 and the connection closed."""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from typing import Any

import h11

from gateway.errors import error_body, public

# the end of a head exactly as h11 finds it (h11/_receivebuffer.py blank_line_regex)
HEAD_END = re.compile(rb"\n\r?\n")
OWS = b" \t"
SHOWN = 40                      # bytes of a header value quoted in a refusal


class Refusal(h11.RemoteProtocolError):
    """A request the front door refuses before the application sees it: the error body's
    `code` (its HTTP `status` and whether it carries Retry-After come from gateway/errors.py,
    the one table) and `str(self)`, the message naming what was wrong."""

    def __init__(self, message: str, code: str = "invalid_http") -> None:
        self.entry = public(code)
        super().__init__(message, error_status_hint=self.entry.status)
        self.status, self.code = self.entry.status, self.entry.code

    def response(self) -> bytes:
        """The whole HTTP/1.1 answer: the OpenAI error body, `Connection: close`, and
        `Retry-After` when waiting can help."""
        body = json.dumps(error_body(self.code, str(self))).encode()
        head = [f"HTTP/1.1 {self.status} {HTTPStatus(self.status).phrase}", "content-type: application/json",
                f"content-length: {len(body)}", "connection: close"]
        head += [f"{k.lower()}: {v}" for k, v in (self.entry.headers() or {}).items()]
        return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def head_too_large(limit: int, size: int | None = None) -> Refusal:
    """The 431 for a head over `limit` bytes (`size` when the whole head is known)."""
    what = f"is {size} bytes" if size is not None else "goes on"
    return Refusal(f"the request head (request line and headers) {what}, over the limit of {limit} bytes",
                   "header_too_large")


def framing_problem(head: bytes) -> str | None:
    """What makes this head's framing ambiguous, or None.  `head` is the request line and
    headers up to and including the blank line that ends them (HEAD_END)."""
    lines = head.split(b"\n")[:-1]                  # each ended by LF; the last is the blank line
    if any(not line.endswith(b"\r") for line in lines):
        return "a line of the request head ends in a bare LF (send CRLF)"
    lines = [line[:-1] for line in lines]
    version = lines[0].rpartition(b" ")[2]
    fields: dict[bytes, list[bytes]] = {b"content-length": [], b"transfer-encoding": []}
    for line in lines[1:-1]:
        if line[:1] in (b" ", b"\t"):
            return "a header line is folded onto the one before it (obs-fold)"
        name, _, value = line.partition(b":")
        if name.lower() in fields:
            fields[name.lower()].append(value.strip(OWS))
    return _length_problem(fields[b"content-length"], fields[b"transfer-encoding"], version)


def _length_problem(lengths: list[bytes], codings: list[bytes], version: bytes) -> str | None:
    if lengths and codings:
        return "the request has both Content-Length and Transfer-Encoding (send one of them)"
    if len(lengths) > 1:
        return f"the request has {len(lengths)} Content-Length headers (send one)"
    if len(codings) > 1:
        return f"the request has {len(codings)} Transfer-Encoding headers (send one)"
    if lengths and not lengths[0].isdigit():
        return f"Content-Length {_shown(lengths[0])} is not a number of bytes"
    if codings and codings[0] != b"chunked":
        return f"Transfer-Encoding {_shown(codings[0])} is not supported: only `chunked` is"
    if codings and version != b"HTTP/1.1":
        return f"Transfer-Encoding in an {_shown(version)} request (chunked needs HTTP/1.1)"
    return None


def _shown(value: bytes) -> str:
    text = value[:SHOWN].decode("latin-1")
    return repr(text + ("..." if len(value) > SHOWN else ""))


class StrictConnection(h11.Connection):
    """h11's server side, refusing (raising `Refusal`, a RemoteProtocolError) a request head
    over `max_head_bytes` and one whose framing is ambiguous, before h11 parses it; `refusal`
    keeps the error that ended the connection (h11's own ones too), for the answer.

    Reads h11's receive buffer (`_receive_buffer._data`, a bytearray) to see the raw head:
    the check scans it once, from where the last look stopped, as h11 does."""

    def __init__(self, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes
        self.refusal: Refusal | None = None
        self._raw: bytearray = self._receive_buffer._data     # h11 >= 0.14; a test pins it
        self._searched = 0

    @property
    def pending(self) -> int:
        """Bytes received and not yet parsed."""
        return len(self._receive_buffer)

    def next_event(self) -> Any:
        try:
            if self.their_state is h11.IDLE:
                self._check_head()
            return super().next_event()
        except Refusal as exc:
            self.refusal = exc
            self._process_error(self.their_role)       # as h11 does for its own errors
            raise
        except h11.RemoteProtocolError as exc:
            status = 431 if exc.error_status_hint == 431 else 400
            self.refusal = (head_too_large(self.max_head_bytes) if status == 431 else
                            Refusal(f"invalid HTTP request: {exc}"))
            raise

    def _check_head(self) -> None:
        self._raw = self._receive_buffer._data
        end = HEAD_END.search(self._raw, self._searched)
        if end is None:
            self._searched = max(0, len(self._raw) - 2)
            if len(self._raw) > self.max_head_bytes:
                raise head_too_large(self.max_head_bytes)
            return
        self._searched = 0
        if end.end() > self.max_head_bytes:
            raise head_too_large(self.max_head_bytes, end.end())
        problem = framing_problem(bytes(self._raw[:end.end()]))
        if problem is not None:
            raise Refusal(f"ambiguous request framing: {problem}; the connection is closed",
                          "ambiguous_framing")
