"""Shared-memory transport for two processes on one node.

The sender owns a shared segment used as a ring of in-flight payloads: it gathers each
frame straight from its pool into the ring and sends only the header (and where the
payload lies) over a Unix socket.  The receiver verifies the payload where it lies and
copies it once into its pool, then acknowledges the frame, which frees that part of the
ring.  The segment's name is unlinked as soon as both sides have mapped it, so a crash
leaves nothing behind in /dev/shm.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import threading
from collections import deque
from multiprocessing import shared_memory

import torch

from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.receiver import TransferReceiver
from kv_transfer.transport.base import TransportConfig
from kv_transfer.transport.wire import recv_msg, send_msg
from proto import kv_transfer_pb2 as pb


class ShmTransferServer:
    """Serves `receiver` at shm://PATH (a Unix socket; one thread per connected sender)."""

    def __init__(self, receiver: TransferReceiver, path: str):
        self.receiver, self.path = receiver, path
        if os.path.exists(path):
            os.unlink(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(64)
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._serve, name="kv-shm-accept", daemon=True)
        self._accept.start()

    @property
    def endpoint(self) -> str:
        return f"shm://{self.path}"

    def _serve(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            t = threading.Thread(target=self._connection, args=(conn,), name="kv-shm-conn", daemon=True)
            t.start()
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _connection(self, conn: socket.socket) -> None:
        seen: set[bytes] = set()
        shm = None
        try:
            first = recv_msg(conn, pb.PushMessage)
            if first is None or first.WhichOneof("kind") != "hello":
                return
            try:
                version = self.receiver.hello(list(first.hello.versions))
            except TransferRefused as e:
                send_msg(conn, pb.PushReply(ok=False, reason=Refusal.BAD_VERSION.value, detail=e.detail,
                                            hello=pb.HelloReply(version=0, reason=e.detail)))
                return
            seen.add(first.hello.transfer_id)
            shm = _map_segment(first.hello.shm_name)
            send_msg(conn, pb.PushReply(ok=True, hello=pb.HelloReply(version=version)))
            self._frames(conn, shm, seen)
        except (OSError, ConnectionError):
            pass
        finally:
            for tid in seen:
                self.receiver.stream_closed(tid)
            if shm is not None:
                shm.close()
            conn.close()

    def _frames(self, conn: socket.socket, shm, seen: set[bytes]) -> None:
        accepted = 0
        while (msg := recv_msg(conn, pb.PushMessage)) is not None:
            try:
                if msg.WhichOneof("kind") == "commit":
                    res = self.receiver.commit(msg.commit)
                    seen.discard(msg.commit.transfer_id)
                    send_msg(conn, pb.PushReply(ok=True, committed=True, frames_accepted=len(res.frames)))
                    continue
                f = msg.frame
                seen.add(f.header.transfer_id)
                end = f.shm_offset + f.shm_length
                if end > len(shm):
                    raise TransferRefused(Refusal.BAD_GEOMETRY, f"payload [{f.shm_offset}, {end}) outside "
                                          f"the shared segment of {len(shm)} bytes")
                view = memoryview(shm)[f.shm_offset:end]
                try:
                    self.receiver.receive(f.header, view)
                finally:
                    view.release()
                accepted += 1
                send_msg(conn, pb.PushReply(ok=True, frames_accepted=accepted))
            except TransferRefused as e:
                reason = getattr(e.reason, "value", str(e.reason))
                send_msg(conn, pb.PushReply(ok=False, reason=reason, detail=e.detail, frames_accepted=accepted))

    def stop(self) -> None:
        self._stopping = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._accept.join(timeout=5)
        for t in self._threads:
            t.join(timeout=5)
        if os.path.exists(self.path):
            os.unlink(self.path)


def _map_segment(name: str) -> mmap.mmap:
    """Map the sender's segment by name.  (Not through SharedMemory: that would register it
    with this process's resource tracker, which would unlink the sender's segment.)"""
    import _posixshmem
    fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


class ShmStream:
    def __init__(self, path: str, transfer_id: bytes, config: TransportConfig, sender: str = ""):
        self.config = config
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(config.deadline_s)
        try:
            self._sock.connect(path)
        except OSError as e:
            self._sock.close()
            raise TransferRefused(Refusal.TRANSPORT, f"shm://{path}: {e}") from e
        self._shm = shared_memory.SharedMemory(create=True, size=config.shm_bytes)
        self._ring = torch.frombuffer(self._shm.buf, dtype=torch.uint8)
        self._inflight: deque[tuple[int, int]] = deque()    # (offset, nbytes), oldest first
        self._head = 0
        self.closed = False
        try:
            send_msg(self._sock, pb.PushMessage(hello=pb.Hello(
                versions=list(config.versions), sender=sender, shm_name=self._shm.name,
                shm_size=self._shm.size, transfer_id=transfer_id)))
            reply = recv_msg(self._sock, pb.PushReply)
        except OSError as e:
            self.close()
            raise TransferRefused(Refusal.TRANSPORT, f"shm://{path}: {e}") from e
        finally:
            self._shm.unlink()          # both sides mapped it (or the peer is gone)
        if reply is None or not reply.ok:
            self.close()
            raise TransferRefused(Refusal.BAD_VERSION if reply else Refusal.TRANSPORT,
                                  reply.detail if reply else "receiver closed the connection")

    def stage(self, nbytes: int) -> torch.Tensor:
        if nbytes > self._ring.numel():
            raise ValueError(f"frame of {nbytes} bytes exceeds the shared segment of {self._ring.numel()}")
        while (off := self._fit(nbytes)) is None:
            self._read_reply()
        return self._ring[off:off + nbytes]

    def _fit(self, n: int) -> int | None:
        size = self._ring.numel()
        if not self._inflight:
            return 0
        tail = self._inflight[0][0]
        if self._inflight[-1][0] >= tail:              # not wrapped: free [head, size) + [0, tail)
            if self._head + n <= size:
                return self._head
            return 0 if n <= tail else None
        return self._head if self._head + n <= tail else None   # wrapped: free [head, tail)

    def send(self, header: pb.FrameHeader, payload: torch.Tensor) -> None:
        if self.closed:
            raise TransferRefused(Refusal.TRANSPORT, "stream is closed")
        n = payload.numel() * payload.element_size()
        off = payload.data_ptr() - self._ring.data_ptr()
        if not (0 <= off < self._ring.numel()) or self._fit(n) != off:
            staged = self.stage(n)                       # not our staged slot: copy it in
            staged.copy_(payload.reshape(-1).view(torch.uint8))
            off = staged.data_ptr() - self._ring.data_ptr()
        self._inflight.append((off, n))
        self._head = off + n
        self._io(lambda: send_msg(self._sock, pb.PushMessage(frame=pb.Frame(
            header=header, shm_offset=off, shm_length=n))))
        while select.select([self._sock], [], [], 0)[0]:  # early refusals, acks already here
            self._read_reply()

    def _read_reply(self) -> pb.PushReply:
        reply = self._io(lambda: recv_msg(self._sock, pb.PushReply))
        if reply is None:
            raise TransferRefused(Refusal.TRANSPORT, "receiver closed the connection")
        if not reply.committed and self._inflight:
            self._inflight.popleft()
        if not reply.ok:
            raise TransferRefused(reply.reason, reply.detail)
        return reply

    def commit(self, commit: pb.Commit) -> pb.PushReply:
        self._io(lambda: send_msg(self._sock, pb.PushMessage(commit=commit)))
        try:
            while self._inflight:
                self._read_reply()
            return self._read_reply()
        finally:
            self.close()

    def _io(self, op):
        try:
            return op()
        except OSError as e:
            self.close()
            raise TransferRefused(Refusal.TRANSPORT, f"shared-memory control socket: {e}") from e

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._sock.close()
        self._ring = None
        try:
            self._shm.close()
        except BufferError:
            pass                       # a payload view is still alive; the mapping goes with it
