"""NIXL transport, receiving side: the sender writes one-sided into a staging ring this side
registered for its connection alone, never into a page of the pool; a Unix-socket control
channel (unix_server.py: who may connect) carries everything else.

    sender                                   this server
    Hello(versions, shm_size)         ->     a ring from StagingRings, its first
                                             min(shm_size, staging_bytes) bytes registered;
                                             HelloReply(version, nixl=NixlStaging: that
                                             registration's partial agent metadata, address, size)
    NIXL writes into the ring ...            (no code of ours runs)
    Frames(headers, ring offsets)     ->     each frame verified where it lies in the ring, then
                                             copied into its page (TransferReceiver.receive, as
                                             for shm://); the reply frees that ring space
    Commit                            ->     TransferReceiver.commit (coverage, re-checksum)

Why a ring and not the pages.  On one host UCX moves the bytes by cross-memory attach
(process_vm_writev), which checks no registration: a write through descriptors a sender kept
from an earlier transfer still lands after the memory was deregistered (so, over RDMA, would
one through a key that is still registered).  A write the receiver did not expect must find
nothing it will read unverified.  Here it can only reach a staging ring: a ring's bytes are
read only to verify a frame whose header came over the control socket and to copy it once it
verified, and a ring is never handed back to the allocator — a closed connection's ring goes
to the back of StagingRings' queue and serves a later connection.  A stray write into a frame
being received fails its checksum (BAD_CHECKSUM), or, landing between the verify and the copy,
the commit's re-checksum of the destination pages (RECHECK_FAILED); no pool page is ever
registered, so I2 holds as for every transport: a frame that fails its checksum is never
written.  (Over RDMA the NIC also enforces the registration; the uid check on the socket is
what keeps other local processes out, as for shm://.)

The agent runs without NIXL's progress thread (it spins a core); a connection thread drives the
agent's progress while it waits for the next control message, every millisecond for a second
after each message (a sender's first write waits on it: UCX's wire-up), then every 50 ms.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from functools import partial

import torch

from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.pages import as_bytes
from kv_transfer.receiver import TransferReceiver
from kv_transfer.transport.base import TransportConfig
from kv_transfer.transport.nixl_agent import Agent
from kv_transfer.transport.unix_server import UnixControlServer
from kv_transfer.transport.wire import recv_msg, send_msg
from proto import kv_transfer_pb2 as pb

BUSY_POLL_S = 0.001      # progress period in the BUSY_S after a connection's latest message
BUSY_S = 1.0
IDLE_POLL_S = 0.05       # ... and on an idle connection (UCX's wire-up waits on this side's progress)
MIN_STAGING = 1 << 16    # the smallest ring a sender may ask for (TransportConfig.shm_bytes' floor)
MAX_CONNECTIONS = 32     # rings a server makes at most: 32 x 8 MiB by default


class StagingRings:
    """A server's staging rings: at most `count` of `nbytes` each, made on first need and kept
    for the server's life (their memory never goes back to the allocator, so a late write can
    never reach memory put to another use).  Thread-safe."""

    def __init__(self, nbytes: int, count: int) -> None:
        if nbytes < MIN_STAGING or count < 1:
            raise ValueError(f"staging rings of {nbytes} bytes (>= {MIN_STAGING}) x {count} (>= 1)")
        self.nbytes, self.count = nbytes, count
        self._free: deque[torch.Tensor] = deque()
        self._made = 0
        self._lock = threading.Lock()

    def take(self) -> torch.Tensor:
        """The ring idle the longest (or a new one); raises TransferRefused(TRANSPORT) when
        all `count` are in use."""
        with self._lock:
            if self._free:
                return self._free.popleft()
            if self._made >= self.count:
                raise TransferRefused(Refusal.TRANSPORT, f"all {self.count} NIXL staging rings of {self.nbytes} "
                                      f"bytes are in use (the receiver's max_connections)")
            self._made += 1
        return torch.zeros(self.nbytes, dtype=torch.uint8)

    def give_back(self, ring: torch.Tensor) -> None:
        with self._lock:
            self._free.append(ring)

    @property
    def in_use(self) -> int:
        with self._lock:
            return self._made - len(self._free)


class NixlTransferServer(UnixControlServer):
    """Serves `receiver` at nixl://PATH (see UnixControlServer for `path`, `allowed_uids` and
    `on_refused`).  A connection gets a staging ring of the bytes its Hello asks for, at most
    `staging_bytes`; at most `max_connections` hold one at once (more are refused with a
    TRANSPORT error naming the limit).  Raises ImportError, binding nothing, when NIXL cannot
    run here."""

    SCHEME = "nixl"

    def __init__(self, receiver: TransferReceiver, path: str | None = None,
                 allowed_uids: Iterable[int] | None = None, on_refused: Callable[[], None] | None = None,
                 staging_bytes: int = TransportConfig.shm_bytes, max_connections: int = MAX_CONNECTIONS) -> None:
        self.agent = Agent("kv-receiver")
        self.rings = StagingRings(staging_bytes, max_connections)
        super().__init__(receiver, path, allowed_uids, on_refused)

    def _connection(self, conn: socket.socket) -> None:
        seen: set[bytes] = set()
        ring = reg = None
        try:
            first = self._next(conn)
            version = self._agree(conn, first)
            if first is None or version is None:
                return
            size = first.hello.shm_size
            try:
                if not MIN_STAGING <= size <= self.rings.nbytes:
                    raise TransferRefused(Refusal.TRANSPORT, f"a NIXL staging ring of {size} bytes was asked for; "
                                          f"this receiver gives {MIN_STAGING} to {self.rings.nbytes}")
                ring = self.rings.take()
            except TransferRefused as e:
                send_msg(conn, pb.PushReply(ok=False, reason=e.code, detail=e.detail))
                return
            reg = self.agent.register([(ring.data_ptr(), size)], "DRAM", 0)
            staging = pb.NixlStaging(agent_metadata=self.agent.partial_metadata(reg), base=ring.data_ptr(),
                                     size=size, mem_type="DRAM", device_id=0)
            send_msg(conn, pb.PushReply(ok=True, hello=pb.HelloReply(version=version, nixl=staging)))
            self._frames(conn, seen, partial(self._next, conn), partial(self._receive, as_bytes(ring[:size])))
        except (OSError, ConnectionError):
            pass
        finally:
            for tid in seen:
                self.receiver.stream_closed(tid)
            if reg is not None:
                self.agent.deregister(reg)
            if ring is not None:
                self.rings.give_back(ring)
            self._conns.discard(conn)
            conn.close()

    def _next(self, conn: socket.socket) -> pb.PushMessage | None:
        """The next control message, driving the agent's progress while none is there."""
        busy_until = time.monotonic() + BUSY_S
        while not select.select([conn], [], [], BUSY_POLL_S if time.monotonic() < busy_until else IDLE_POLL_S)[0]:
            self.agent.progress()
        return recv_msg(conn, pb.PushMessage)

    def _receive(self, ring: memoryview, f: pb.Frame) -> None:
        end = f.payload_offset + f.payload_length
        if end > len(ring):
            raise TransferRefused(Refusal.BAD_GEOMETRY, f"payload [{f.payload_offset}, {end}) outside "
                                  f"the staging ring of {len(ring)} bytes")
        self.receiver.receive(f.header, ring[f.payload_offset:end])
