"""The gRPC transport's message framing: a protobuf `PushMessage` (headers only) followed by
the payload bytes of its frames, so payloads are never copied into or out of protobuf.

    [u32 n][PushMessage, n bytes][payload of frame 0][payload of frame 1]...

Each frame's `payload_offset` counts from the first byte after the PushMessage.
"""

from __future__ import annotations

import struct
from typing import Sequence

from kv_transfer.errors import Refusal, TransferRefused
from proto import kv_transfer_pb2 as pb

_LEN = struct.Struct("<I")


def encode(msg: pb.PushMessage, payloads: Sequence[bytes] = ()) -> bytes:
    """The wire bytes of `msg` with `payloads` after it (frame i's offset/length set here)."""
    frames = frames_of(msg)
    off = 0
    for f, p in zip(frames, payloads, strict=True):
        f.payload_offset, f.payload_length = off, len(p)
        off += len(p)
    head = msg.SerializeToString()
    return b"".join((_LEN.pack(len(head)), head, *payloads))


def decode(data: bytes) -> tuple[pb.PushMessage, list[memoryview]]:
    """The message and each frame's payload as a view into `data` (no copy)."""
    view = memoryview(data)
    if len(view) < _LEN.size:
        raise TransferRefused(Refusal.BAD_GEOMETRY, f"message of {len(view)} bytes has no header")
    (n,) = _LEN.unpack_from(view)
    body = view[_LEN.size + n:]
    if n > len(view) - _LEN.size:
        raise TransferRefused(Refusal.BAD_GEOMETRY, f"header length {n} exceeds the message")
    msg = pb.PushMessage.FromString(view[_LEN.size:_LEN.size + n])
    payloads = []
    for f in frames_of(msg):
        end = f.payload_offset + f.payload_length
        if end > len(body):
            raise TransferRefused(Refusal.BAD_GEOMETRY, f"payload [{f.payload_offset}, {end}) "
                                  f"outside the message body of {len(body)} bytes")
        payloads.append(body[f.payload_offset:end])
    return msg, payloads


def frames_of(msg: pb.PushMessage) -> list[pb.Frame]:
    kind = msg.WhichOneof("kind")
    if kind == "frame":
        return [msg.frame]
    if kind == "frames":
        return list(msg.frames.frames)
    return []
