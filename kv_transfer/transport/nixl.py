"""NIXL transport, sending side: frames are gathered into a registered staging ring (where the
sender hashes them, as for every transport), written one-sided by NIXL straight into the
receiver's reserved pages, and only then announced by their headers over the control socket.

    ShmStream-like life: a connection (and its ring) serves transfer after transfer.
    first frame of a transfer   -> Hello(transfer_id, its ownership tag): the receiver registers
                                   the reservation's pages and answers where they lie
    every BATCH frames / flush  -> one NIXL write of the batch's (layer, component) pieces;
                                   when it is DONE (the bytes are at the receiver), their
                                   headers go over the socket and the ring space is free again
    commit                      -> every write DONE, then the Commit

The sender never has a write in flight when it sends the commit or closes the connection
(close waits for its writes): that is what lets the receiver deem the exposure quiet.
"""

from __future__ import annotations

import select
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NoReturn, TypeVar

import torch

from engine.kv_pool import PagePool
from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.pages import Payload
from kv_transfer.transport.base import TransportConfig
from kv_transfer.transport.channels import IdleChannels
from kv_transfer.transport.nixl_agent import Agent, Region, Registration, Xfer, process_agent
from kv_transfer.transport.shm import check_server_uid
from kv_transfer.transport.wire import recv_msg, send_msg
from proto import kv_transfer_pb2 as pb

T = TypeVar("T")
TARGET_LIMIT = 64 << 20      # the largest NixlTarget a receiver may answer (its page table, metadata)
_POOLS: weakref.WeakKeyDictionary[PagePool, Registration] = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def _pool_registration(agent: Agent, pool: PagePool) -> Registration:
    """`pool`'s storage registered with `agent` (once per pool; dropped when the pool goes)."""
    with _POOLS_LOCK:
        reg = _POOLS.get(pool)
        if reg is None:
            kv = pool.kv
            reg = _POOLS[pool] = agent.register([(kv.data_ptr(), kv.numel() * kv.element_size())], "DRAM", 0)
            weakref.finalize(pool, agent.deregister, reg)
        return reg


class _Channel:
    """One control connection and the staging ring registered for its writes."""

    def __init__(self, path: str, config: TransportConfig, sender: str) -> None:
        import socket
        self.agent: Agent = process_agent()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(config.deadline_s)
        try:
            self.sock.connect(path)
        except OSError as e:
            self.sock.close()
            raise TransferRefused(Refusal.TRANSPORT, f"nixl://{path}: {e}") from e
        check_server_uid(self.sock, f"nixl://{path}")
        self.ring = torch.empty(config.shm_bytes, dtype=torch.uint8)
        self.reg: Registration = self.agent.register([(self.ring.data_ptr(), config.shm_bytes)], "DRAM", 0)
        self.key = (path, config.shm_bytes, tuple(config.versions))
        self.closed = False
        try:
            send_msg(self.sock, pb.PushMessage(hello=pb.Hello(versions=list(config.versions), sender=sender)))
            reply = recv_msg(self.sock, pb.PushReply)
        except OSError as e:
            self.close()
            raise TransferRefused(Refusal.TRANSPORT, f"nixl://{path}: {e}") from e
        if reply is None or not reply.ok:
            self.close()
            if reply is None:
                raise TransferRefused(Refusal.TRANSPORT, "receiver closed the connection")
            raise TransferRefused(Refusal.BAD_VERSION, reply.detail)

    def idle_and_alive(self) -> bool:
        return not self.closed and not select.select([self.sock], [], [], 0)[0]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()
            self.agent.deregister(self.reg)


_IDLE: IdleChannels[_Channel] = IdleChannels()


def close_channels() -> None:
    """Close every idle channel (tests, shutdown)."""
    _IDLE.close_all()


@dataclass
class _Batch:
    frames: list[pb.Frame] = field(default_factory=list)
    local: list[Region] = field(default_factory=list)
    remote: list[Region] = field(default_factory=list)
    span: tuple[int, int] | None = None   # ring bytes [start, end) its staged payloads occupy
    xfer: Xfer | None = None


class NixlStream:
    BATCH = 8

    def __init__(self, path: str, transfer_id: bytes, config: TransportConfig, sender: str = "") -> None:
        self._ch = _IDLE.take((path, config.shm_bytes, tuple(config.versions)),
                              lambda: _Channel(path, config, sender))
        self._tid, self._config = transfer_id, config
        self._target: pb.NixlTarget | None = None
        self._peer = ""
        self._batch = _Batch()
        self._posted: deque[_Batch] = deque()    # written or being written, headers not yet sent
        self._acks = 0                           # Frames messages not yet answered
        self._head = 0                           # next free ring byte (the ring fills, then wraps)
        self.closed = False

    # ---- the SenderStream interface ----------------------------------------------
    def stage(self, nbytes: int) -> torch.Tensor:
        ring = self._ch.ring
        if nbytes > ring.numel():
            raise ValueError(f"frame of {nbytes} bytes exceeds the staging ring of {ring.numel()}")
        while (off := self._fit(nbytes)) is None:
            self._post()
            self._retire(wait=True)
        if off < self._head:
            self._post()                             # a batch never wraps around the ring
        return ring[off:off + nbytes]

    def send(self, header: pb.FrameHeader, payload: Payload) -> None:
        if self.closed:
            raise TransferRefused(Refusal.TRANSPORT, "stream is closed")
        b = self._batch
        if header.transfer_id != self._tid:          # another transfer's frame (a replay): its
            b.frames.append(pb.Frame(header=header))  # header goes out, its bytes have nowhere to go
            return
        target = self._target or self._expose(header)
        ring = self._ch.ring
        if isinstance(payload, bytes):
            payload = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        n = payload.numel() * payload.element_size()
        off = payload.data_ptr() - ring.data_ptr()
        if not (0 <= off < ring.numel()) or self._fit(n) != off:
            staged = self.stage(n)                 # not our staged slot: copy it in
            staged.copy_(payload.reshape(-1).view(torch.uint8))
            off = staged.data_ptr() - ring.data_ptr()
        self._head = off + n
        b = self._batch
        b.span = (off if b.span is None else b.span[0], off + n)
        piece = header.num_tokens * target.token_stride
        self._add(header, [ring.data_ptr() + off + j * piece for j in range(len(self._pieces(header)))])

    def send_from_pool(self, header: pb.FrameHeader, pool: PagePool, page: int) -> None:
        """The frame written straight from the sender's pool (registered once, locally: this
        agent's metadata goes to no peer, so no peer can address it)."""
        if self.closed:
            raise TransferRefused(Refusal.TRANSPORT, "stream is closed")
        if self._target is None:
            self._expose(header)
        _pool_registration(self._ch.agent, pool)      # descriptors may now name its bytes
        kv, item = pool.kv, pool.kv.element_size()
        base = kv.data_ptr() + page * kv.stride(2) * item
        ls, cs = kv.stride(0) * item, kv.stride(1) * item
        self._add(header, [base + layer * ls + c * cs for layer, c in self._pieces(header)])

    def _pieces(self, header: pb.FrameHeader) -> list[tuple[int, int]]:
        """The frame's contiguous pieces, in payload order: (layer, component)."""
        components = header.shape[1] if len(header.shape) > 1 else 1
        return [(layer, c) for layer in range(header.layer_start, header.layer_end) for c in range(components)]

    def _add(self, header: pb.FrameHeader, sources: list[int]) -> None:
        """Batch the frame `header` whose pieces start at `sources` (local addresses)."""
        target = self._target
        assert target is not None
        b = self._batch
        b.frames.append(pb.Frame(header=header))
        piece = header.num_tokens * target.token_stride
        page = target.pages[header.page_index] if header.page_index < len(target.pages) else 0
        dst, ls, cs = target.base + page * target.page_stride, target.layer_stride, target.component_stride
        b.local.extend((src, piece) for src in sources)
        b.remote.extend((dst + layer * ls + c * cs, piece) for layer, c in self._pieces(header))
        if len(b.frames) >= self.BATCH:
            self._post()
            self._retire(wait=False)

    def flush(self) -> None:
        if not self.closed:
            self._post()
            self._retire(wait=False)

    def settle(self, timeout_s: float) -> None:
        """Every frame so far written and announced, and the answers read (fault injection)."""
        if not self.closed:
            self._post()
            while self._posted:
                self._retire(wait=True)
            end = time.monotonic() + timeout_s
            while self._acks and time.monotonic() < end:
                if select.select([self._ch.sock], [], [], 0.01)[0]:
                    self._reply()

    def commit(self, commit: pb.Commit) -> pb.PushReply:
        self._post()
        while self._posted:
            self._retire(wait=True)
        self._io(lambda: send_msg(self._ch.sock, pb.PushMessage(commit=commit)))
        while self._acks:
            self._reply()
        reply = self._reply()
        self.closed = True
        _IDLE.give_back(self._ch)       # a clean channel serves the next transfer
        return reply

    def close(self) -> None:
        """End the stream once no write of it is in flight; the receiver then fails the
        transfer (the connection's end, without a commit)."""
        if self.closed:
            return
        self.closed = True
        end = time.monotonic() + self._config.deadline_s
        for b in self._posted:
            if b.xfer is not None:          # NIXL finishes a write it started: wait for its end
                try:
                    b.xfer.wait(end)
                except TransferRefused:
                    pass                    # failed or late: either way it is over or never will land
                b.xfer.release()
        self._ch.close()

    # ---- the steps ---------------------------------------------------------------
    def _expose(self, header: pb.FrameHeader) -> pb.NixlTarget:
        """Ask the receiver to open this transfer's pages to our writes (proving its tag)."""
        hello = pb.Hello(versions=list(self._config.versions), transfer_id=self._tid,
                         ownership_tag=header.ownership_tag)
        self._io(lambda: send_msg(self._ch.sock, pb.PushMessage(hello=hello)))
        reply = self._io(lambda: recv_msg(self._ch.sock, pb.PushReply, limit=TARGET_LIMIT))
        if reply is None:
            self._fail(TransferRefused(Refusal.TRANSPORT, "receiver closed the connection"))
        if not reply.ok:
            self._fail(TransferRefused(reply.reason, reply.detail))
        target = reply.hello.nixl
        self._peer = self._ch.agent.add_remote(target.agent_metadata)
        self._target = target
        return target

    def _fit(self, n: int) -> int | None:
        """Where n staged bytes fit in the ring without touching a payload still being written
        (or whose headers are not sent yet), or None."""
        size = self._ch.ring.numel()
        spans = [b.span for b in [*self._posted, self._batch] if b.span is not None]
        if not spans:
            return 0
        tail, head = spans[0][0], self._head
        if head >= tail:                             # not wrapped: [head, size) then [0, tail)
            if head + n <= size:
                return head
            return 0 if n <= tail else None
        return head if head + n <= tail else None

    def _post(self) -> None:
        """Start the NIXL write of the batch so far (a local refusal, e.g. a piece outside the
        pages registered for the transfer, fails the stream)."""
        b = self._batch
        if not b.frames:
            return
        self._batch = _Batch()
        if b.local:
            assert self._target is not None
            try:
                b.xfer = self._ch.agent.write(b.local, b.remote, "DRAM", 0, self._target.mem_type,
                                              self._target.device_id, self._peer)
            except TransferRefused as e:
                self._fail(e)
        self._posted.append(b)

    def _retire(self, wait: bool) -> None:
        """Send the headers of every batch whose write is DONE, in order (waiting for the oldest
        when `wait`), and read the answers already here."""
        end = time.monotonic() + self._config.deadline_s
        while self._posted:
            b = self._posted[0]
            if b.xfer is not None:
                try:
                    if wait:
                        b.xfer.wait(end)
                    elif not b.xfer.done():
                        break
                except TransferRefused as e:
                    self._fail(e)
                b.xfer.release()
            self._posted.popleft()
            msg = pb.PushMessage(frames=pb.Frames(frames=b.frames))
            self._io(lambda: send_msg(self._ch.sock, msg))
            self._acks += 1
            wait = False
        while self._acks and select.select([self._ch.sock], [], [], 0)[0]:
            self._reply()

    def _reply(self) -> pb.PushReply:
        reply = self._io(lambda: recv_msg(self._ch.sock, pb.PushReply))
        if reply is None:
            self._fail(TransferRefused(Refusal.TRANSPORT, "receiver closed the connection"))
        if not reply.committed and self._acks:
            self._acks -= 1
        if not reply.ok:
            self._fail(TransferRefused(reply.reason, reply.detail))
        return reply

    def _fail(self, e: TransferRefused) -> NoReturn:
        self.close()
        raise e

    def _io(self, op: Callable[[], T]) -> T:
        try:
            return op()
        except OSError as e:
            self._fail(TransferRefused(Refusal.TRANSPORT, f"NIXL control socket: {e}"))
