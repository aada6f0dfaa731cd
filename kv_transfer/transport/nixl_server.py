"""NIXL transport, receiving side: one-sided writes straight into the reserved pages, and a
Unix-socket control channel (unix_server.py: who may connect) for everything else.

    sender                                   this server
    Hello(versions)                   ->     HelloReply(version)
    Hello(transfer_id, ownership_tag) ->     the tag checked, the reservation's sent pages
                                             registered for this transfer alone; HelloReply(nixl=
                                             NixlTarget: partial agent metadata, strides, pages)
    NIXL writes into the pages ...           (no code of ours runs)
    Frames(headers of written frames) ->     receive_in_place: admitted, nothing copied
    Commit                            ->     the exposure ends (deregistered, quiet), every frame
                                             verified where it lies, coverage; PushReply

Only the transfer's own pages are registered, as runs of consecutive physical pages per
(layer, component); the registration is dropped at the commit and before the owner may free
the pages (TransferReceiver.release).  On one host UCX moves the bytes over cross-memory attach
(`cma`, process_vm_writev): a registration bounds what an honest sender's NIXL lets it address,
while the host's uid check is what keeps other processes out, as for shm://.  Over RDMA the NIC
enforces the registration itself.

The agent runs without NIXL's progress thread (it spins a core); a connection thread drives the
agent's progress while it waits for the next control message, every millisecond while one of its
transfers is open to writes.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Callable, Iterable

from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import Reservation
from kv_transfer.transport.nixl_agent import Agent, Region, Registration
from kv_transfer.transport.unix_server import UnixControlServer
from kv_transfer.transport.wire import recv_msg, send_msg
from proto import kv_transfer_pb2 as pb

BUSY_POLL_S = 0.001      # progress period while a transfer of the connection is open to writes
IDLE_POLL_S = 0.05


class NixlExposure:
    """One reservation's pages registered for one sender's one-sided writes."""

    def __init__(self, agent: Agent, reg: Registration) -> None:
        self._agent, self._reg = agent, reg
        self._quiet = threading.Event()

    def revoke(self) -> None:
        self._agent.deregister(self._reg)

    def quiet(self, timeout_s: float) -> bool:
        return self._quiet.wait(timeout_s)

    def metadata(self) -> bytes:
        """What the sender needs to write into these pages (and no other memory of this agent)."""
        return self._agent.partial_metadata(self._reg)

    def settle(self) -> None:
        """The sender has no write in flight (it committed, or closed the connection)."""
        self._quiet.set()

    @property
    def settled(self) -> bool:
        return self._quiet.is_set()


def page_regions(res: Reservation, kv_base: int, strides: tuple[int, int, int], layers: int,
                 components: int, page_bytes: int) -> list[Region]:
    """The bytes frames may write: for each (layer, component), each run of consecutive
    physical pages among the reservation's sent pages, as one region."""
    layer_stride, component_stride, page_stride = strides
    pages = sorted(ref.page for ref in res.sent_pages)
    runs: list[tuple[int, int]] = []           # (first page, count)
    for p in pages:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return [(kv_base + layer * layer_stride + c * component_stride + first * page_stride, count * page_bytes)
            for layer in range(layers) for c in range(components) for first, count in runs]


class NixlTransferServer(UnixControlServer):
    """Serves `receiver` at nixl://PATH (see UnixControlServer for `path`, `allowed_uids` and
    `on_refused`).  Raises ImportError, binding nothing, when NIXL cannot run here."""

    SCHEME = "nixl"

    def __init__(self, receiver: TransferReceiver, path: str | None = None,
                 allowed_uids: Iterable[int] | None = None, on_refused: Callable[[], None] | None = None) -> None:
        self.agent = Agent("kv-receiver")
        kv = receiver.pool.kv
        self._mem = ("VRAM", kv.device.index or 0) if kv.is_cuda else ("DRAM", 0)
        super().__init__(receiver, path, allowed_uids, on_refused)

    def _connection(self, conn: socket.socket) -> None:
        seen: set[bytes] = set()
        exposures: dict[bytes, NixlExposure] = {}
        try:
            first = self._next(conn, exposures)
            version = self._agree(conn, first)
            if version is None:
                return
            send_msg(conn, pb.PushReply(ok=True, hello=pb.HelloReply(version=version)))
            while (msg := self._next(conn, exposures)) is not None:
                send_msg(conn, self._handle(msg, seen, exposures))
        except (OSError, ConnectionError):
            pass
        finally:
            for exposure in exposures.values():     # the sender closes only once its writes are over
                exposure.settle()
            for tid in seen:
                self.receiver.stream_closed(tid)
            self._conns.discard(conn)
            conn.close()

    def _next(self, conn: socket.socket, exposures: dict[bytes, NixlExposure]) -> pb.PushMessage | None:
        """The next control message, driving the agent's progress while none is there."""
        while True:
            busy = any(not e.settled for e in exposures.values())
            if select.select([conn], [], [], BUSY_POLL_S if busy else IDLE_POLL_S)[0]:
                return recv_msg(conn, pb.PushMessage)
            self.agent.progress()

    def _handle(self, msg: pb.PushMessage, seen: set[bytes], exposures: dict[bytes, NixlExposure]) -> pb.PushReply:
        kind = msg.WhichOneof("kind")
        try:
            if kind == "hello":
                tid = msg.hello.transfer_id
                exposure = self.receiver.expose(tid, msg.hello.ownership_tag, self._register)
                assert isinstance(exposure, NixlExposure)
                exposures[tid] = exposure
                seen.add(tid)           # it may now write: closing fails the transfer
                return pb.PushReply(ok=True, hello=pb.HelloReply(nixl=self._target(tid, exposure)))
            if kind == "commit":
                tid = msg.commit.transfer_id
                if tid in exposures:
                    exposures.pop(tid).settle()        # sent once every write completed
                res = self.receiver.commit(msg.commit)
                seen.discard(tid)
                return pb.PushReply(ok=True, committed=True, frames_accepted=len(res.frames))
            if kind == "frames":
                for f in msg.frames.frames:
                    self.receiver.receive_in_place(f.header)
                return pb.PushReply(ok=True, frames_accepted=len(msg.frames.frames))
            return pb.PushReply(ok=False, reason=Refusal.TRANSPORT.value, detail=f"unexpected {kind} message")
        except TransferRefused as e:
            return pb.PushReply(ok=False, reason=e.code, detail=e.detail)

    def _register(self, res: Reservation) -> NixlExposure:
        kv = self.receiver.pool.kv
        item = kv.element_size()
        strides = (kv.stride(0) * item, kv.stride(1) * item, kv.stride(2) * item)
        regions = page_regions(res, kv.data_ptr(), strides, kv.shape[0], kv.shape[1], kv.stride(2) * item)
        return NixlExposure(self.agent, self.agent.register(regions, *self._mem))

    def _target(self, tid: bytes, exposure: NixlExposure) -> pb.NixlTarget:
        res = self.receiver.get(tid)
        if res is None:
            raise TransferRefused(Refusal.EXPIRED, f"transfer {tid.hex()[:16]} ended")
        kv = self.receiver.pool.kv
        item = kv.element_size()
        return pb.NixlTarget(
            agent_metadata=exposure.metadata(), base=kv.data_ptr(),
            layer_stride=kv.stride(0) * item, component_stride=kv.stride(1) * item,
            page_stride=kv.stride(2) * item, token_stride=kv.stride(3) * item,
            pages=[ref.page for ref in res.pages], mem_type=self._mem[0], device_id=self._mem[1])
