"""What every transport shares: its settings and the sender-side bookkeeping of a stream."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kv_transfer.frame import SUPPORTED_VERSIONS
from kv_transfer.reservation import TRANSFER_TIMEOUT_S
from kv_transfer.tls import TlsIdentity


@dataclass(frozen=True)
class TransportConfig:
    """Transport settings (one frozen config for all three).

    message_bytes: gRPC payload bytes batched into one message (1 MiB measured best here:
        bench.transfer, larger messages were slower).
    streams: parallel gRPC streams per transfer, each on its own connection (1 measured best
        on a 2-core machine; more can pay where several cores drive the network).
    max_message_bytes: hard gRPC message size limit on both sides.
    deadline_s: the application's deadline for a whole transfer (gRPC deadline, socket timeout).
    keepalive_s / keepalive_timeout_s: HTTP/2 pings.  A healthy peer answers pings even while
        it applies backpressure, so a slow reader is never cut; only a dead peer is.
    shm_bytes: the shared-memory ring of in-flight payloads (8 MiB: small enough to stay in
        the last-level cache between the two processes, large enough to keep both busy).
    queue_messages: gRPC messages queued ahead of the network per stream (backpressure).
    versions: protocol versions this side offers at the handshake.
    max_push_streams: concurrent Push streams a gRPC receiver serves (256: above any transfer
        concurrency a decode worker reaches in normal work — every reservation that is still
        being filled — so only a flood is refused); one more is refused with RESOURCE_EXHAUSTED
        before it is read.  The receiver runs `max_push_streams + HANDSHAKE_THREADS` threads,
        so a Handshake always finds one however many Push streams stall.
    stream_idle_s: a Push stream that sends nothing for this long is cut by the gRPC receiver
        (twice the default transfer timeout, TRANSFER_TIMEOUT_S: 60 s), so stalled streams give
        their threads back; the transfers it had proven (a verified frame) fail.
    tls: this process's cluster certificate: gRPC streams and servers run mutual TLS with it
        (kv_transfer/tls.py); None runs them in plaintext (one node).  Ignored by local://
        and shm://, which never leave the node.
    """
    message_bytes: int = 1 << 20
    streams: int = 1
    max_message_bytes: int = 64 << 20
    deadline_s: float = 120.0
    keepalive_s: float = 10.0
    keepalive_timeout_s: float = 20.0
    shm_bytes: int = 8 << 20
    queue_messages: int = 8
    versions: tuple[int, ...] = SUPPORTED_VERSIONS
    max_push_streams: int = 256
    stream_idle_s: float = 2 * TRANSFER_TIMEOUT_S
    tls: TlsIdentity | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.message_bytes <= self.max_message_bytes // 2:
            raise ValueError(f"message_bytes={self.message_bytes} must be in (0, max_message_bytes/2="
                             f"{self.max_message_bytes // 2}]")
        if not 1 <= self.streams <= 16:
            raise ValueError(f"streams={self.streams} must be in [1, 16]")
        if self.deadline_s <= 0 or self.keepalive_s <= 0 or self.keepalive_timeout_s <= 0:
            raise ValueError("deadline_s, keepalive_s and keepalive_timeout_s must be > 0")
        if self.shm_bytes < 1 << 16:
            raise ValueError(f"shm_bytes={self.shm_bytes} must be at least 64 KiB")
        if self.queue_messages < 1:
            raise ValueError(f"queue_messages={self.queue_messages} must be >= 1")
        if self.max_push_streams < 1:
            raise ValueError(f"max_push_streams={self.max_push_streams} must be >= 1")
        if not 0 < self.stream_idle_s < float("inf"):
            raise ValueError(f"stream_idle_s={self.stream_idle_s} must be > 0 and finite")


class StagingBuffer:
    """A reusable CPU buffer for payloads of transports that copy them anyway."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)

    def get(self, nbytes: int) -> torch.Tensor:
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._buf[:nbytes]
