"""Length-prefixed protobuf messages over a stream socket (the control channel of the
shared-memory and NIXL transports).  Never pickle."""

from __future__ import annotations

import socket
import struct
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from google.protobuf.message import Message

M = TypeVar("M", bound="Message")

_LEN = struct.Struct("<I")
MAX_CONTROL_MESSAGE = 1 << 20


def send_msg(sock: socket.socket, msg: Message) -> None:
    body = msg.SerializeToString()
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_msg(sock: socket.socket, cls: type[M], limit: int = MAX_CONTROL_MESSAGE) -> M | None:
    """The next message, or None when the peer closed the connection cleanly."""
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > limit:
        raise ConnectionError(f"control message of {n} bytes exceeds the limit {limit}")
    body = _recv_exact(sock, n)
    if body is None:
        raise ConnectionError("connection closed inside a message")
    return cls.FromString(body)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise ConnectionError("connection closed inside a message")
        got += k
    return bytes(buf)
