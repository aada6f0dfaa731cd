"""Shared-memory transport, receiving side: a Unix socket of control messages in front of
a `TransferReceiver` (unix_server.py: who may connect); payloads are read where the sender put
them, in its shared segment.  A segment that others than its owner could write is refused:
its bytes could change between the checksum and the copy."""

from __future__ import annotations

import mmap
import os
import socket
import stat
from functools import partial

from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.transport.unix_server import UnixControlServer
from kv_transfer.transport.wire import recv_msg, send_msg
from proto import kv_transfer_pb2 as pb


class ShmTransferServer(UnixControlServer):
    """Serves `receiver` at shm://PATH (see UnixControlServer for `path`, `allowed_uids` and
    `on_refused`)."""

    SCHEME = "shm"

    def _connection(self, conn: socket.socket) -> None:
        seen: set[bytes] = set()
        shm = None
        try:
            first = recv_msg(conn, pb.PushMessage)
            version = self._agree(conn, first)
            if first is None or version is None:
                return
            try:
                shm = _map_segment(first.hello.shm_name)
            except PermissionError as e:
                send_msg(conn, pb.PushReply(ok=False, reason=Refusal.TRANSPORT.value, detail=str(e)))
                return
            send_msg(conn, pb.PushReply(ok=True, hello=pb.HelloReply(version=version)))
            self._frames(conn, seen, lambda: recv_msg(conn, pb.PushMessage), partial(self._receive, shm))
        except (OSError, ConnectionError):
            pass
        finally:
            for tid in seen:
                self.receiver.stream_closed(tid)
            if shm is not None:
                shm.close()
            self._conns.discard(conn)
            conn.close()

    def _receive(self, shm: mmap.mmap, f: pb.Frame) -> None:
        end = f.payload_offset + f.payload_length
        if end > len(shm):
            raise TransferRefused(Refusal.BAD_GEOMETRY, f"payload [{f.payload_offset}, {end}) outside "
                                  f"the shared segment of {len(shm)} bytes")
        view = memoryview(shm)[f.payload_offset:end]
        try:
            self.receiver.receive(f.header, view)
        finally:
            view.release()


def _map_segment(name: str) -> mmap.mmap:
    """Map the sender's segment by name.  (Not through SharedMemory: that would register it
    with this process's resource tracker, which would unlink the sender's segment.)  Raises
    PermissionError for a segment that anyone but its owner may open."""
    import _posixshmem
    fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
    try:
        st = os.fstat(fd)
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise PermissionError(f"shared segment {name} has mode {stat.S_IMODE(st.st_mode):o}: "
                                  "others than its owner could change payloads")
        return mmap.mmap(fd, st.st_size)
    finally:
        os.close(fd)
