"""Shared-memory transport for two processes on one node, sending side.

The sender owns a shared segment used as a ring of in-flight payloads: it gathers each
frame straight from its pool into the ring and sends only the headers (and where each
payload lies), a batch at a time, over a Unix socket.  The receiver (shm_server.py)
verifies each payload where it lies and copies it once into its pool, then acknowledges
the batch, which frees that part of the ring.  The segment's name is unlinked as soon as
both sides have mapped it, so a crash leaves nothing behind in /dev/shm.  A connection and
its segment serve transfer after transfer.

The segment is created with O_EXCL and mode 0600 (multiprocessing.shared_memory's default on
Linux) under a name with 128 random bits; before sending anything the sender checks that the
process listening on the socket runs as its own uid (or root) with SO_PEERCRED.
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import struct
from collections import deque
from multiprocessing import shared_memory
from typing import Callable, TypeVar

import torch

from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.pages import Payload
from kv_transfer.transport.base import TransportConfig
from kv_transfer.transport.channels import IdleChannels, ring_fit
from kv_transfer.transport.wire import recv_msg, send_msg
from proto import kv_transfer_pb2 as pb

T = TypeVar("T")


class _Channel:
    """One connection and its shared segment, reused by transfer after transfer (mapping a
    fresh segment costs a page fault per 4 KiB on both sides)."""

    def __init__(self, path: str, config: TransportConfig, sender: str) -> None:
        self.path = path
        self.sock = connect_control(f"shm://{path}", path, config.deadline_s)
        self.shm = shared_memory.SharedMemory(name=f"tandem-kv-{secrets.token_hex(16)}", create=True,
                                              size=config.shm_bytes)
        self.ring: torch.Tensor | None = torch.frombuffer(self.shm.buf, dtype=torch.uint8)  # None once closed
        self.inflight: deque[tuple[int, int]] = deque()    # (offset, nbytes), oldest first
        self.key = (path, config.shm_bytes, tuple(config.versions))   # who may reuse this channel
        self.closed = False
        try:
            send_msg(self.sock, pb.PushMessage(hello=pb.Hello(
                versions=list(config.versions), sender=sender, shm_name=self.shm.name,
                shm_size=self.shm.size)))
            reply = recv_msg(self.sock, pb.PushReply)
        except OSError as e:
            self.close()
            raise TransferRefused(Refusal.TRANSPORT, f"shm://{path}: {e}") from e
        finally:
            self.shm.unlink()          # both sides mapped it (or the peer is gone)
        if reply is None or not reply.ok:
            self.close()
            if reply is None:
                raise TransferRefused(Refusal.TRANSPORT, "receiver closed the connection")
            transport = reply.reason == Refusal.TRANSPORT.value     # e.g. a segment others may write
            raise TransferRefused(Refusal.TRANSPORT if transport else Refusal.BAD_VERSION, reply.detail)

    def idle_and_alive(self) -> bool:
        """Nothing to read on an idle channel: anything readable means the peer hung up."""
        return not self.closed and not select.select([self.sock], [], [], 0)[0]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.sock.close()
        self.ring = None
        try:
            self.shm.close()
        except BufferError:
            pass                       # a payload view is still alive; the mapping goes with it


def connect_control(endpoint: str, path: str, timeout_s: float) -> socket.socket:
    """A connection to the Unix control socket at `path` (shm://, nixl://), whose listening
    process runs as this uid (`check_server_uid`); raises TransferRefused (TRANSPORT)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(path)
    except OSError as e:
        sock.close()
        raise TransferRefused(Refusal.TRANSPORT, f"{endpoint}: {e}") from e
    check_server_uid(sock, endpoint)
    return sock


def check_server_uid(sock: socket.socket, endpoint: str) -> None:
    """Refuse (and close `sock`) unless the listening process runs as this uid or root: the
    segment's name and every header go to it."""
    cred = struct.Struct("3i")
    try:
        _, uid, _ = cred.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, cred.size))
    except OSError as e:
        sock.close()
        raise TransferRefused(Refusal.TRANSPORT, f"{endpoint}: no peer credentials: {e}") from e
    if uid not in (os.getuid(), 0):
        sock.close()
        raise TransferRefused(Refusal.TRANSPORT, f"{endpoint}: the receiver runs as uid {uid}, "
                              f"not {os.getuid()}")


_IDLE: IdleChannels[_Channel] = IdleChannels()


def close_channels() -> None:
    """Close every idle channel (tests, shutdown)."""
    _IDLE.close_all()


class ShmStream:
    BATCH = 8            # frames per control message (and per acknowledgement)

    def __init__(self, path: str, transfer_id: bytes, config: TransportConfig, sender: str = "") -> None:
        self._ch = _IDLE.take((path, config.shm_bytes, tuple(config.versions)),
                              lambda: _Channel(path, config, sender))
        self._batch: list[pb.Frame] = []
        self._acks: deque[int] = deque()        # frames per batch sent and not yet acknowledged
        self.closed = False
        self._io(lambda: send_msg(self._ch.sock, pb.PushMessage(hello=pb.Hello(
            versions=list(config.versions), transfer_id=transfer_id))))

    def stage(self, nbytes: int) -> torch.Tensor:
        ring = self._ch.ring
        assert ring is not None, "the stream's channel is closed"
        if nbytes > ring.numel():
            raise ValueError(f"frame of {nbytes} bytes exceeds the shared segment of {ring.numel()}")
        while (off := self._fit(nbytes)) is None:
            self._flush()
            self._read_reply()
        return ring[off:off + nbytes]

    def _fit(self, n: int) -> int | None:
        ch = self._ch
        assert ch.ring is not None, "the stream's channel is closed"
        return ring_fit(ch.inflight, ch.ring.numel(), n)

    def send(self, header: pb.FrameHeader, payload: Payload) -> None:
        if self.closed:
            raise TransferRefused(Refusal.TRANSPORT, "stream is closed")
        ch = self._ch
        assert ch.ring is not None, "the stream's channel is closed"
        if isinstance(payload, bytes):
            payload = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        n = payload.numel() * payload.element_size()
        off = payload.data_ptr() - ch.ring.data_ptr()
        if not (0 <= off < ch.ring.numel()) or self._fit(n) != off:
            staged = self.stage(n)                       # not our staged slot: copy it in
            staged.copy_(payload.reshape(-1).view(torch.uint8))
            off = staged.data_ptr() - ch.ring.data_ptr()
        ch.inflight.append((off, n))
        self._batch.append(pb.Frame(header=header, payload_offset=off, payload_length=n))
        if len(self._batch) >= self.BATCH:
            self._flush()
            while select.select([ch.sock], [], [], 0)[0]:   # early refusals, acks already here
                self._read_reply()

    def flush(self) -> None:
        if not self.closed:
            self._flush()

    def _flush(self) -> None:
        if self._batch:
            msg = pb.PushMessage(frames=pb.Frames(frames=self._batch))
            self._io(lambda: send_msg(self._ch.sock, msg))
            self._acks.append(len(self._batch))
            self._batch = []

    def _read_reply(self) -> pb.PushReply:
        ch = self._ch
        reply = self._io(lambda: recv_msg(ch.sock, pb.PushReply))
        if reply is None:
            self.close()
            raise TransferRefused(Refusal.TRANSPORT, "receiver closed the connection")
        if not reply.committed and self._acks:
            for _ in range(self._acks.popleft()):
                ch.inflight.popleft()
        if not reply.ok:
            self.close()
            raise TransferRefused(reply.reason, reply.detail)
        return reply

    def commit(self, commit: pb.Commit) -> pb.PushReply:
        self._flush()
        self._io(lambda: send_msg(self._ch.sock, pb.PushMessage(commit=commit)))
        while self._acks:
            self._read_reply()
        reply = self._read_reply()
        self.closed = True
        _IDLE.give_back(self._ch)       # a clean channel serves the next transfer
        return reply

    def _io(self, op: Callable[[], T]) -> T:
        try:
            return op()
        except OSError as e:
            self.close()
            raise TransferRefused(Refusal.TRANSPORT, f"shared-memory control socket: {e}") from e

    def close(self) -> None:
        """End the stream; closing the connection fails an uncommitted transfer on the receiver."""
        if not self.closed:
            self.closed = True
            self._ch.close()
