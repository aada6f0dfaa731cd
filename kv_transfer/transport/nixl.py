"""NIXL transport, sending side: every frame is written one-sided by NIXL into the staging ring
the receiver registered for this connection (never into its pool: nixl_server.py says why),
and announced by its header and ring offset over the control socket once the write is DONE.

    stage / send        the frame gathered into this side's ring (where the sender hashes it,
                        as for every transport), at the offset it will have in the receiver's
    send_from_pool      the frame written straight from the pool's pages (plain hooks, CPU pool)
    every BATCH frames  one NIXL write of the batch; when it is DONE (the bytes are at the
    / flush             receiver), the batch's headers go over the socket; the receiver verifies
                        each frame in its ring, copies it into the page and answers, which frees
                        the batch's ring space
    commit              every write DONE and every batch answered, then the Commit

The sender never has a write in flight when it sends the commit or closes the connection
(close waits for its writes).  The receiver does not count on that: a write that lands late
finds only a staging ring.
"""

from __future__ import annotations

import select
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NoReturn, TypeVar

import torch

from engine.kv_pool import PagePool
from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.pages import Payload, block_nbytes
from kv_transfer.transport.base import TransportConfig
from kv_transfer.transport.nixl_agent import Region, Xfer
from kv_transfer.transport.nixl_channel import IDLE, NixlChannel, pool_registration
from kv_transfer.transport.wire import recv_msg, send_msg
from proto import kv_transfer_pb2 as pb

T = TypeVar("T")


def close_channels() -> None:
    """Close every idle channel (tests, shutdown)."""
    IDLE.close_all()


@dataclass
class _Batch:
    frames: list[pb.Frame] = field(default_factory=list)
    local: list[Region] = field(default_factory=list)
    remote: list[Region] = field(default_factory=list)
    xfer: Xfer | None = None


class NixlStream:
    BATCH = 8

    def __init__(self, path: str, transfer_id: bytes, config: TransportConfig, sender: str = "") -> None:
        self._ch = IDLE.take((path, config.shm_bytes, tuple(config.versions)),
                             lambda: NixlChannel(path, config, sender))
        self._config = config
        self._batch = _Batch()
        self._posted: deque[_Batch] = deque()    # written or being written, headers not yet sent
        self._acks: deque[int] = deque()         # frames of each Frames message not yet answered
        self.closed = False

    # ---- the SenderStream interface ----------------------------------------------
    def stage(self, nbytes: int) -> torch.Tensor:
        off = self._space(nbytes)
        return self._ch.ring[off:off + nbytes]

    def send(self, header: pb.FrameHeader, payload: Payload) -> None:
        if self.closed:
            raise TransferRefused(Refusal.TRANSPORT, "stream is closed")
        ring = self._ch.ring
        if isinstance(payload, bytes):
            payload = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        n = payload.numel() * payload.element_size()
        off = payload.data_ptr() - ring.data_ptr()
        if not (0 <= off < ring.numel()) or self._ch.fit(n) != off:
            staged = self.stage(n)                 # not our staged slot: copy it in
            staged.copy_(payload.reshape(-1).view(torch.uint8))
            off = staged.data_ptr() - ring.data_ptr()
        self._add(header, off, n, [(ring.data_ptr() + off, n)])

    def send_from_pool(self, header: pb.FrameHeader, pool: PagePool, page: int) -> None:
        """The frame written straight from the sender's pool (registered once, locally)."""
        if self.closed:
            raise TransferRefused(Refusal.TRANSPORT, "stream is closed")
        pool_registration(self._ch.agent, pool)     # descriptors may now name its bytes
        n = block_nbytes(pool, header.layer_start, header.layer_end, header.num_tokens)
        off = self._space(n)
        kv, item = pool.kv, pool.kv.element_size()
        base = kv.data_ptr() + page * kv.stride(2) * item
        ls, cs = kv.stride(0) * item, kv.stride(1) * item
        piece = header.num_tokens * kv.stride(3) * item      # kv[layer, c, page, :num_tokens]
        sources = [(base + layer * ls + c * cs, piece)
                   for layer in range(header.layer_start, header.layer_end) for c in range(kv.shape[1])]
        self._add(header, off, n, sources)

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
        IDLE.give_back(self._ch)       # a clean channel serves the next transfer
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
                    pass                    # failed or late: either way it lands only in the ring
                b.xfer.release()
        self._ch.close()

    # ---- the steps ---------------------------------------------------------------
    def _space(self, n: int) -> int:
        """A ring offset where `n` bytes fit now (posting, announcing and reading answers
        until the receiver freed enough).  Raises ValueError for a frame larger than the ring."""
        ch = self._ch
        if n > ch.size:
            raise ValueError(f"frame of {n} bytes exceeds the NIXL staging ring of {ch.size} bytes "
                             f"(TransportConfig.shm_bytes, at most the receiver's staging_bytes)")
        while (off := ch.fit(n)) is None:
            self._post()
            if self._posted:
                self._retire(wait=True)
            else:
                self._reply()               # an answer frees the oldest batch's space
        return off

    def _add(self, header: pb.FrameHeader, off: int, n: int, sources: list[Region]) -> None:
        """Batch the frame `header`, whose `n` bytes lie at `sources` (local addresses) and go
        to ring offset `off`: its pieces land back to back there, in payload order."""
        b, ch = self._batch, self._ch
        ch.inflight.append((off, n))
        b.frames.append(pb.Frame(header=header, payload_offset=off, payload_length=n))
        dst = ch.remote.base + off
        for src, size in sources:
            b.local.append((src, size))
            b.remote.append((dst, size))
            dst += size
        if len(b.frames) >= self.BATCH:
            self._post()
            self._retire(wait=False)

    def _post(self) -> None:
        """Start the NIXL write of the batch so far (a local refusal fails the stream)."""
        b = self._batch
        if not b.frames:
            return
        self._batch = _Batch()
        try:
            b.xfer = self._ch.agent.write(b.local, b.remote, "DRAM", 0, self._ch.remote.mem_type,
                                          self._ch.remote.device_id, self._ch.peer)
        except TransferRefused as e:
            self._fail(e)
        self._posted.append(b)

    def _retire(self, wait: bool) -> None:
        """Send the headers of every batch whose write is DONE, in order (waiting for the oldest
        when `wait`), and read the answers already here."""
        end = time.monotonic() + self._config.deadline_s
        while self._posted:
            b = self._posted[0]
            assert b.xfer is not None
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
            self._acks.append(len(b.frames))
            wait = False
        while self._acks and select.select([self._ch.sock], [], [], 0)[0]:
            self._reply()

    def _reply(self) -> pb.PushReply:
        reply = self._io(lambda: recv_msg(self._ch.sock, pb.PushReply))
        if reply is None:
            self._fail(TransferRefused(Refusal.TRANSPORT, "receiver closed the connection"))
        if not reply.committed and self._acks:
            for _ in range(self._acks.popleft()):   # verified and copied: the space is free
                self._ch.inflight.popleft()
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
