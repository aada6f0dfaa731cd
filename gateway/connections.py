"""The gateway's HTTP connections: uvicorn's h11 protocol with limits that hold against a
hostile client (`FrontDoorProtocol`, bound to one server by `protocol_for`).

- A request head must arrive whole within `header_timeout_s` of the connection opening (or of
  its first byte, on a kept-alive connection; each deadline is drawn in [0.75, 1] x the
  timeout, so a flood's connections do not all end at once); bytes trickled in do not extend it.  A body must
  keep moving: no byte for `body_timeout_s` while the client owes one (and the gateway is
  reading) ends it.  Either answers 408 (OpenAI error body) and closes.
- The head's size and framing are checked on the raw bytes (gateway/framing.py): over
  `max_header_bytes` is 431, ambiguous framing 400; the connection is closed and nothing after
  the refused head is read as a request.
- `ConnectionTable` (gateway/connection_table.py) counts open connections per client address
  (`max_connections_per_client`;
  one more is held unread and answered 429 after 1-2 x `header_timeout_s`, spread at random,
  so that a client reconnecting as fast as it is refused does not keep the gateway busy
  refusing in bursts; past half the process's open-file limit of those held, answered at once)
  and in all (`max_connections`): a new connection past the total
  takes the slot of the connection idle longest (no request in flight: a half-sent head, or a
  kept-alive connection between requests), which is closed; only when every connection has a
  request in flight is the new one answered 503 `server_overloaded`.  Half-open connections
  therefore never make a client that sends a whole request wait or fail.
- Past `max_connections` requests in flight (uvicorn's tasks, which may outlive their
  connection) a request is answered 503 as well.

Every refusal is the OpenAI error shape and says the limit.  After one, the connection is
half-closed and what the client still sends is read and dropped for at most `LINGER_S` (so a
client still sending sees the answer, not a reset), then closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from typing import Any, ClassVar

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.utils import get_remote_addr
from uvicorn.server import ServerState

from gateway.connection_table import ConnectionLimits, ConnectionTable, client_key
from gateway.errors import error_body, public
from gateway.framing import Refusal, StrictConnection

log = logging.getLogger("tandem.gateway")
LINGER_S = 1.0                  # after a refusal: read and drop the client's bytes this long at most
LINGER_BYTES = 1 << 20          # ... and this many


class FrontDoorProtocol(H11Protocol):
    """uvicorn's h11 protocol with the limits above.  `protocol_for` makes the subclass of one
    server (its `limits` and `table`); uvicorn constructs it per connection."""

    limits: ClassVar[ConnectionLimits]
    table: ClassVar[ConnectionTable]

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.strict = StrictConnection(self.limits.max_header_bytes)
        self.conn = self.strict
        self.app = self._unless_overloaded(self.app)
        self._admitted = self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._tarpit: asyncio.TimerHandle | None = None
        self._moved = 0.0                          # loop time of the last byte received
        self._dropped = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        remote = get_remote_addr(transport)
        refusal = self.table.admit(self, client_key(remote[0] if remote else None))
        if refusal is not None:
            self.transport = transport
            log.debug("refused a connection from %s: %s", remote, refusal)
            if refusal.status == 429 and self.table.tarpit(self):
                transport.pause_reading()          # held unread: answered when a head would have timed out
                held = self.limits.header_timeout_s * (1 + random.random())
                self._tarpit = self.loop.call_later(held, self._linger, refusal)
            else:
                self._linger(refusal)
            return
        self._admitted = True
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self._head_deadline(), self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timers()
        self.table.release(self)
        if self._admitted:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            self._dropped += len(data)
            if self._dropped > LINGER_BYTES:
                self.transport.close()
            return
        self._moved = self.loop.time()
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 (or StrictConnection) refused: the OpenAI body."""
        self._refuse(self.strict.refusal or Refusal(msg))

    def shutdown(self) -> None:
        if self._refused or not self._admitted:
            self.transport.close()
        else:
            super().shutdown()

    def evict(self) -> None:
        self._stop_timers()
        self.transport.close()

    def _watch(self) -> None:
        """Arm the timer the connection's state calls for: the head's deadline while a head is
        awaited (unless uvicorn's keep-alive timer covers an idle connection), the body's
        progress check while the client owes body bytes."""
        if self.transport.is_closing() or self._refused:
            self._stop_timers()
            return
        self.table.mark(self, busy=self.cycle is not None and not self.cycle.response_complete)
        state = self.conn.their_state
        if state is not h11.IDLE:
            self._head_timer = _cancelled(self._head_timer)
        elif self._head_timer is None and (self.strict.pending or self.timeout_keep_alive_task is None):
            self._head_timer = self.loop.call_later(self._head_deadline(), self._head_timed_out)
        if state is not h11.SEND_BODY:
            self._body_timer = _cancelled(self._body_timer)
        elif self._body_timer is None:
            self._moved = self.loop.time()
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_check)

    def _head_deadline(self) -> float:
        """Seconds the head may take: header_timeout_s, less up to a quarter of it at random, so
        that connections opened together (a flood) do not all time out in one burst of work."""
        return self.limits.header_timeout_s * (1 - random.random() / 4)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._refused or self.conn.their_state is not h11.IDLE:
            return
        if not self.strict.pending:                # nothing sent: closed as an idle keep-alive is
            self.evict()
            return
        self._refuse(Refusal(f"the request head did not arrive whole within {self.limits.header_timeout_s:g} s "
                             f"(the header timeout)", "request_timeout"))

    def _body_check(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self._refused or self.conn.their_state is not h11.SEND_BODY:
            return
        now, timeout = self.loop.time(), self.limits.body_timeout_s
        if self.flow.read_paused:                  # the gateway is not reading: not the client's stall
            self._moved = now
        if now - self._moved < timeout:
            self._body_timer = self.loop.call_later(timeout - (now - self._moved), self._body_check)
            return
        self._refuse(Refusal(f"the request body stopped: no byte arrived for {timeout:g} s (the body timeout)",
                             "request_timeout"))

    def _refuse(self, refusal: Refusal) -> None:
        """Answer `refusal` (unless a response has begun: then only close) and linger."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True              # the application sees the client gone ...
            cycle.message_event.set()              # ... and writes nothing more on this connection
        if cycle is not None and cycle.response_started:
            self.evict()
            return
        self._linger(refusal)

    def _linger(self, refusal: Refusal) -> None:
        self._refused = True
        self._stop_timers()
        self.table.release(self)
        if not self.transport.is_reading():
            self.transport.resume_reading()        # read and drop from now on
        self.transport.write(refusal.response())
        if not self.transport.can_write_eof():     # TLS: no half-close
            self.transport.close()
            return
        self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def _stop_timers(self) -> None:
        if self._tarpit is not None:
            self._tarpit = _cancelled(self._tarpit)
            self.table.untarpit(self)
        self._head_timer = _cancelled(self._head_timer)
        self._body_timer = _cancelled(self._body_timer)

    def _unless_overloaded(self, app: Any) -> Any:
        """`app`, answering 503 instead while more than max_connections requests are in flight."""
        tasks, limit = self.tasks, self.limits.max_connections

        async def guarded(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and len(tasks) > limit:     # this request's task is one of them
                await _send_overloaded(send, limit)
                return
            await app(scope, receive, send)
        return guarded


async def _send_overloaded(send: Any, limit: int) -> None:
    body = json.dumps(error_body("server_overloaded", f"the gateway is full: {limit} requests are in flight "
                                                      f"(its limit); retry shortly")).encode()
    retry = [(k.lower().encode(), v.encode()) for k, v in (public("server_overloaded").headers() or {}).items()]
    await send({"type": "http.response.start", "status": public("server_overloaded").status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *retry]})
    await send({"type": "http.response.body", "body": body})


def _cancelled(timer: asyncio.TimerHandle | None) -> asyncio.TimerHandle | None:
    """Cancel `timer` (if any); None, for the attribute that held it."""
    if timer is not None:
        timer.cancel()
    return None


def protocol_for(limits: ConnectionLimits) -> type[FrontDoorProtocol]:
    """The protocol class of one server: its own table of connections under `limits`."""
    return type("BoundFrontDoorProtocol", (FrontDoorProtocol,), {"limits": limits, "table": ConnectionTable(limits)})
