"""A NIXL sender's connection: the control socket, the staging ring the receiver registered
for it (where every write of the connection lands), this side's ring of the same size (where
frames are gathered when they are not written straight from the pool), and the ring space
still in use.

    ring offsets [0, size): the same offset in both rings; a span is in use from the moment a
    frame is staged or written until the receiver answers the message that carried its
    header (it verified and copied the frame by then, so the space may be written again)

A connection and its rings serve transfer after transfer (IdleChannels)."""

from __future__ import annotations

import select
import threading
import weakref
from collections import deque

import torch

from engine.kv_pool import PagePool
from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.transport.base import TransportConfig
from kv_transfer.transport.channels import IdleChannels, ring_fit
from kv_transfer.transport.nixl_agent import Agent, Registration, process_agent
from kv_transfer.transport.shm import connect_control
from kv_transfer.transport.wire import recv_msg, send_msg
from proto import kv_transfer_pb2 as pb

_POOLS: weakref.WeakKeyDictionary[PagePool, Registration] = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def pool_registration(agent: Agent, pool: PagePool) -> Registration:
    """`pool`'s storage registered with `agent` as a source of writes (once per pool; dropped
    when the pool goes).  Only this side's agent knows it: its metadata goes to no peer."""
    with _POOLS_LOCK:
        reg = _POOLS.get(pool)
        if reg is None:
            kv = pool.kv
            reg = _POOLS[pool] = agent.register([(kv.data_ptr(), kv.numel() * kv.element_size())], "DRAM", 0)
            weakref.finalize(pool, agent.deregister, reg)
        return reg


class NixlChannel:
    """One control connection to nixl://`path` and its two rings; raises TransferRefused
    (TRANSPORT, or BAD_VERSION when no version is shared) when it cannot be opened."""

    def __init__(self, path: str, config: TransportConfig, sender: str) -> None:
        self.agent: Agent = process_agent()
        self.key = (path, config.shm_bytes, tuple(config.versions))
        self.closed = False
        self.inflight: deque[tuple[int, int]] = deque()     # (offset, nbytes) in use, oldest first
        self.sock = connect_control(f"nixl://{path}", path, config.deadline_s)
        try:
            send_msg(self.sock, pb.PushMessage(hello=pb.Hello(versions=list(config.versions), sender=sender,
                                                              shm_size=config.shm_bytes)))
            reply = recv_msg(self.sock, pb.PushReply)
        except OSError as e:
            self.sock.close()
            raise TransferRefused(Refusal.TRANSPORT, f"nixl://{path}: {e}") from e
        if reply is None or not reply.ok:
            self.sock.close()
            if reply is None:
                raise TransferRefused(Refusal.TRANSPORT, "receiver closed the connection")
            bad_version = reply.reason == Refusal.BAD_VERSION.value
            raise TransferRefused(Refusal.BAD_VERSION if bad_version else Refusal.TRANSPORT, reply.detail)
        self.remote: pb.NixlStaging = reply.hello.nixl
        if not 0 < self.remote.size <= config.shm_bytes:
            self.sock.close()
            raise TransferRefused(Refusal.TRANSPORT, f"nixl://{path}: the receiver offers a staging ring of "
                                  f"{self.remote.size} bytes, {config.shm_bytes} were asked for")
        self.peer = self.agent.add_remote(self.remote.agent_metadata)
        self.ring = torch.empty(self.remote.size, dtype=torch.uint8)
        self.reg = self.agent.register([(self.ring.data_ptr(), self.remote.size)], "DRAM", 0)

    @property
    def size(self) -> int:
        return int(self.remote.size)

    def fit(self, n: int) -> int | None:
        """Where `n` bytes fit in the rings without touching a span in use, or None."""
        return ring_fit(self.inflight, self.size, n)

    def idle_and_alive(self) -> bool:
        return not self.closed and not select.select([self.sock], [], [], 0)[0]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()
            self.agent.deregister(self.reg)


IDLE: IdleChannels[NixlChannel] = IdleChannels()
