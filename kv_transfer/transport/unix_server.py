"""The Unix-socket control server both same-node transports stand behind (shm://, nixl://).

Who may push: the socket lies in a private directory (0700, made by `mkdtemp`) unless the
caller names a path, the socket itself is 0600, and every connecting peer's uid (SO_PEERCRED)
must be this process's own or one of `allowed_uids`; any other peer is closed before a single
message is read, counted (`refused_peers`) and logged.  Each accepted connection gets a thread
running the transport's `_connection`."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.receiver import TransferReceiver
from kv_transfer.transport import framing
from kv_transfer.transport.wire import send_msg
from proto import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)
_CRED = struct.Struct("3i")        # struct ucred: pid, uid, gid


class UnixControlServer(ABC):
    """Serves `receiver` at SCHEME://PATH (a Unix socket; one thread per connected sender).

    path: where to bind; None makes a fresh private directory (0700) for the socket, removed
    with its contents by `stop()`.  allowed_uids: the peers' uids accepted (default: this
    process's own uid only).  on_refused: called for each peer refused for its uid (a worker
    counts them with its RPC refusals, in `Stats.rpc_unauthenticated`)."""

    SCHEME = ""

    def __init__(self, receiver: TransferReceiver, path: str | None = None,
                 allowed_uids: Iterable[int] | None = None, on_refused: Callable[[], None] | None = None) -> None:
        self._own_dir = tempfile.mkdtemp(prefix="tandem-kv-") if path is None else None
        path = os.path.join(self._own_dir, "kv.sock") if self._own_dir else path
        assert path is not None
        self.receiver, self.path = receiver, path
        self.allowed_uids = frozenset([os.getuid()] if allowed_uids is None else allowed_uids)
        self.refused_peers = 0         # connections closed for their uid
        self._on_refused = on_refused
        if os.path.exists(path):
            os.unlink(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o600)          # before listen(): no peer can connect in between
        self._sock.listen(64)
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._accept = threading.Thread(target=self._serve, name=f"kv-{self.SCHEME}-accept", daemon=True)
        self._accept.start()

    @property
    def endpoint(self) -> str:
        return f"{self.SCHEME}://{self.path}"

    def _serve(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if not self._peer_allowed(conn):
                conn.close()
                continue
            self._conns.add(conn)
            t = threading.Thread(target=self._connection, args=(conn,), name=f"kv-{self.SCHEME}-conn", daemon=True)
            t.start()
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _peer_allowed(self, conn: socket.socket) -> bool:
        """Whether the connected process runs as an allowed uid; counts and logs a refusal."""
        try:
            pid, uid, _ = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        except OSError as e:
            pid, uid = -1, -1
            log.warning("%s://%s: no peer credentials (%s)", self.SCHEME, self.path, e)
        if uid in self.allowed_uids:
            return True
        self.refused_peers += 1        # only the accept thread writes it
        if self._on_refused is not None:
            self._on_refused()
        log.warning("%s://%s: refused a peer (pid %d, uid %d): allowed uids %s",
                    self.SCHEME, self.path, pid, uid, sorted(self.allowed_uids))
        return False

    @abstractmethod
    def _connection(self, conn: socket.socket) -> None:
        """Serve one accepted, uid-checked connection until it ends (the transport's part)."""

    def _agree(self, conn: socket.socket, first: pb.PushMessage | None) -> int | None:
        """The protocol version for a connection whose first message is `first` (a Hello), or
        None once the connection should end: not a Hello, or no version in common (answered
        BAD_VERSION)."""
        if first is None or first.WhichOneof("kind") != "hello":
            return None
        try:
            return self.receiver.hello(list(first.hello.versions))
        except TransferRefused as e:
            send_msg(conn, pb.PushReply(ok=False, reason=Refusal.BAD_VERSION.value, detail=e.detail,
                                        hello=pb.HelloReply(version=0, reason=e.detail)))
            return None

    def _frames(self, conn: socket.socket, seen: set[bytes], next_msg: Callable[[], pb.PushMessage | None],
                receive: Callable[[pb.Frame], None]) -> None:
        """One reply per message `next_msg` gives, until it gives None: a batch of frames (each
        to `receive`, which reads its payload where the transport left it), or a transfer's
        commit; a transfer's Hello needs none.  `seen`: the transfers this connection wrote
        into (closing fails only those)."""
        while (msg := next_msg()) is not None:
            kind = msg.WhichOneof("kind")
            try:
                if kind == "hello":                       # the next transfer on this connection
                    self.receiver.hello(list(msg.hello.versions))
                    continue
                if kind == "commit":
                    res = self.receiver.commit(msg.commit)
                    seen.discard(msg.commit.transfer_id)
                    send_msg(conn, pb.PushReply(ok=True, committed=True, frames_accepted=len(res.frames)))
                    continue
                frames = framing.frames_of(msg)
                for f in frames:
                    receive(f)
                    seen.add(f.header.transfer_id)
                send_msg(conn, pb.PushReply(ok=True, frames_accepted=len(frames)))
            except TransferRefused as e:
                send_msg(conn, pb.PushReply(ok=False, reason=e.code, detail=e.detail))

    def stop(self) -> None:
        """Stop accepting, cut every connection (their transfers fail: STREAM_CLOSED), and wait
        for the connection threads."""
        self._stopping = True
        for sock in [self._sock, *list(self._conns)]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._sock.close()
        self._accept.join(timeout=5)
        for t in self._threads:
            t.join(timeout=5)
        if os.path.exists(self.path):
            os.unlink(self.path)
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
