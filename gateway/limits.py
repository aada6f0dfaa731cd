"""What the gateway reads from a client and how long it waits on one, as two plain ASGI
middlewares (they wrap `receive` and `send` and pass every message through, so a handler
still sees a client that disconnects):

- `BodyLimit` counts the request body's bytes as they arrive, announced (Content-Length) or
  not (chunked), and answers 413 once the count passes the limit: before the body is parsed
  and before the API key is looked at.  Like a web server's lingering close it first reads
  and drops up to one more limit's worth (so a client that sends its whole body before reading
  the answer, as most do, sees the 413 rather than a reset), then closes the connection: a
  refused request costs at most twice the limit in bytes read, never more memory than one
  received piece.
- `SendDeadline` gives every response message a deadline: a client that has not taken what
  was sent (uvicorn's `send` waits on flow control, with no deadline of its own) for that long
  has its connection reset, and the reset is counted.  A reset, not a close: asyncio closes a
  socket only once its write buffer has drained, which a client that reads nothing never lets
  happen, so a closed connection would stay open (and count against uvicorn's connection
  limit) until the client read.  ASGI has no message for it: `connection_abort` finds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import socket
import struct
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("tandem.gateway")
# uvicorn's words when an application ends a response it had started without finishing it;
# the gateway does that on purpose (the only way an ASGI app can close a connection), so the
# line is dropped for those responses only (see `QuietIdleClose`)
UNFINISHED = "ASGI callable returned without completing response."
_closing_idle: contextvars.ContextVar[bool] = contextvars.ContextVar("closing_idle", default=False)
ABORT = "tandem.abort_connection"      # scope key: resets the request's connection (see connection_abort)


def connection_abort(send: Send) -> Callable[[], None] | None:
    """What resets the connection a request came on, from the `send` the server handed the
    application: uvicorn's is a method of its request cycle, which holds the connection's
    asyncio transport.  The reset drops what is queued in the transport (`abort`) and in the
    kernel (SO_LINGER 0: the socket closes with a TCP reset, not after its send queue drains).
    None under a server that does not work that way: the server then closes as it does."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if not isinstance(transport, asyncio.Transport):
        return None
    alive = transport

    def reset() -> None:
        sock = alive.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        alive.abort()
    return reset


class BodyLimit:
    """Answers 413 (OpenAI error body, `body_too_large`, naming the limit; or the body
    `body_for(path, message)` makes, for a path whose API has another shape) to a request whose
    body passes `limit` bytes: without handing the app any of it when Content-Length says so,
    else as soon as the bytes received pass it.  `received` counts the body bytes read, in all
    (for tests and measurements)."""

    def __init__(self, app: ASGIApp, limit: int, on_refusal: Callable[[], None] | None = None,
                 body_for: Callable[[str, str], dict[str, Any]] | None = None) -> None:
        self.app, self.limit, self.on_refusal, self.body_for = app, limit, on_refusal, body_for
        self.received = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        announced = dict(scope.get("headers") or []).get(b"content-length", b"")
        if announced.isdigit() and int(announced) > self.limit:
            await self._drain(receive)
            await self._refuse(scope, send, f"request body of {int(announced)} bytes exceeds the limit of "
                                     f"{self.limit} bytes")
            return
        seen, answered = 0, False

        async def counted() -> Message:
            nonlocal seen, answered
            message = await receive()
            if message["type"] == "http.request" and not answered:
                size = len(message.get("body", b""))
                seen += size
                self.received += size
                if seen > self.limit:
                    answered = True
                    if message.get("more_body", False):
                        await self._drain(receive)
                    await self._refuse(scope, send, f"request body exceeds the limit of {self.limit} bytes")
                    return {"type": "http.disconnect"}     # the app stops reading: the client is done
            return message

        async def guarded(message: Message) -> None:
            if not answered:                                # after the 413, the app's answer is dropped
                await send(message)

        await self.app(scope, counted, guarded)

    async def _drain(self, receive: Receive) -> None:
        """Read and drop up to `limit` more bytes of the body, or to its end."""
        dropped = 0
        while dropped <= self.limit:
            message = await receive()
            if message["type"] != "http.request":
                return
            dropped += len(message.get("body", b""))
            self.received += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    async def _refuse(self, scope: Scope, send: Send, message: str) -> None:
        if self.on_refusal is not None:
            self.on_refusal()
        shaped = self.body_for(scope.get("path", ""), message) if self.body_for is not None else None
        body = json.dumps(shaped or {"error": {"message": message, "type": "invalid_request_error",
                                               "param": None, "code": "body_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})     # the rest of the body is never read
        await send({"type": "http.response.body", "body": body})


class ClientStalled(Exception):
    """A response message the client did not take within the deadline."""


class SendDeadline:
    """Resets the connection of a client that has not read what it was sent for `timeout_s`
    (a stream the client stopped reading, or a large JSON body it never takes), counting it in
    `tandem_responses_stalled_total`.  The response's own clean-up (`finally` blocks, e.g. the
    stream's generation and its admission slot) runs as the send raises.  The connection is
    reset through `scope[ABORT]` (set by the application's outermost layer from the server's
    own `send`), else left to the server to close."""

    def __init__(self, app: ASGIApp, timeout_s: float, registry: CollectorRegistry) -> None:
        self.app, self.timeout_s = app, timeout_s
        self.stalled = Counter("tandem_responses_stalled", "Responses whose client did not read them for "
                               "stream_idle_timeout_s: the connection was closed", registry=registry)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def timed(message: Message) -> None:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await send(message)
            except TimeoutError:
                raise ClientStalled() from None

        try:
            await self.app(scope, receive, timed)
        except ClientStalled:
            self._closed(scope)
        except BaseExceptionGroup as group:             # raised from inside a task group
            rest = group.subgroup(lambda e: not isinstance(e, ClientStalled | BaseExceptionGroup))
            if rest is not None:
                raise
            self._closed(scope)

    def _closed(self, scope: Scope) -> None:
        self.stalled.inc()
        client = scope.get("client")
        log.warning("reset the connection of a client that read nothing for %.0fs (%s %s from %s)",
                    self.timeout_s, scope.get("method"), scope.get("path"), client[0] if client else "?")
        _closing_idle.set(True)       # returning now leaves the response unfinished
        abort = scope.get(ABORT)
        if abort is not None:
            abort()


class QuietIdleClose(logging.Filter):
    """Drops uvicorn's error line about an unfinished response when `SendDeadline` left it
    unfinished on purpose (the flag lives in the request's context, which uvicorn logs from)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_closing_idle.get() and record.getMessage() == UNFINISHED)


def quiet_idle_closes() -> None:
    """Install `QuietIdleClose` on uvicorn's error logger (once per process)."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, QuietIdleClose) for f in logger.filters):
        logger.addFilter(QuietIdleClose())
