"""The sending side of one KV transfer: frames built straight from the sender's pool pages.

    sender = TransferSender(stream, ticket, secret, pool, page_table, prompt_len)
    sender.send_layers(0, 4)        # as soon as prefill has computed layers [0, 4)
    sender.send_layers(4, 8)
    result = sender.commit(first_token_id, first_logprob)

Each frame is gathered from `pool.kv[l0:l1, :, page, :n]` into a buffer the stream hands
out (for shared memory: the shared segment itself), checksummed there and sent.

With `cached_tokens=c` (the receiver's reservation says its prefix cache holds the first c
prompt tokens, whole pages) only pages [c / page_size, n) travel; the commit states `c`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.kv_pool import PagePool
from kv_transfer.frame import PROTOCOL_VERSION, Buffer, commit_digest, frame_checksum, ownership_tag
from kv_transfer.hooks import PLAIN_SENDER, SenderHooks
from kv_transfer.pages import (
    Payload,
    block_nbytes,
    block_parts,
    block_shape,
    dtype_name,
    payload_view,
    read_block,
    read_bytes,
    tokens_in_page,
)
from proto import kv_transfer_pb2 as pb


@dataclass(frozen=True)
class TransferTicket:
    """What the decode side's reservation tells prefill: where to write, and as whom; and the
    digest of the prompt ids prefill computed (kv_transfer.frame.prompt_digest), which every
    frame and the commit state and the tag binds."""
    transfer_id: bytes
    request_id: str
    tenant: str
    prompt_digest: bytes


class SenderStream(Protocol):
    """One open stream to a receiver (see kv_transfer.transport)."""

    def stage(self, nbytes: int) -> torch.Tensor | None:
        """A CPU uint8 buffer of `nbytes` to gather the next payload into, or None when the
        stream wants the payload as a bytes object."""

    def send(self, header: pb.FrameHeader, payload: Payload) -> None:
        """Send one frame (payload: the staged buffer, or bytes).  May raise TransferRefused."""

    def flush(self) -> None:
        """Put frames batched so far on the wire now (a layer group is complete)."""

    def commit(self, commit: pb.Commit) -> pb.PushReply:
        """Send the commit and wait for the outcome; raises TransferRefused if refused."""

    def close(self) -> None:
        """End the stream (without a commit this fails the transfer on the receiver)."""


class PoolStream(Protocol):
    """A stream that can move a frame straight out of the sender's pool (one-sided transports:
    no staging copy).  TransferSender uses it for a CPU pool and plain hooks."""

    def send_from_pool(self, header: pb.FrameHeader, pool: PagePool, page: int) -> None:
        """Send kv[header's layers, :, page, :num_tokens] of `pool` as the frame `header`."""


class TransferSender:
    def __init__(self, stream: SenderStream, ticket: TransferTicket, secret: bytes, pool: PagePool,
                 page_table: list[int], prompt_len: int, hooks: SenderHooks = PLAIN_SENDER,
                 cached_tokens: int = 0):
        if pool.pages_for(prompt_len) > len(page_table):
            raise ValueError(f"prompt of {prompt_len} tokens needs {pool.pages_for(prompt_len)} pages, "
                             f"page table has {len(page_table)}")
        if not 0 <= cached_tokens < prompt_len or cached_tokens % pool.page_size:
            raise ValueError(f"cached_tokens={cached_tokens} must be a multiple of the page size "
                             f"{pool.page_size} in [0, {prompt_len}) for a prompt of {prompt_len} tokens "
                             f"(at least its last page is sent)")
        self.stream, self.ticket, self.pool = stream, ticket, pool
        self.page_table, self.prompt_len, self.cached_tokens = page_table, prompt_len, cached_tokens
        t0 = time.perf_counter()
        self.tag = ownership_tag(secret, ticket.tenant, ticket.request_id, ticket.transfer_id,
                                 ticket.prompt_digest)
        self.checksum_s = time.perf_counter() - t0   # checksums and tag (benchmark figure)
        self.checksums: list[int] = []
        self.hooks = hooks
        self._early_commit = False
        # hooks see (and may change) every payload, so they always get a staged one
        self._direct: PoolStream | None = stream if (
            hooks is PLAIN_SENDER and pool.kv.device.type == "cpu"
            and callable(getattr(stream, "send_from_pool", None))) else None  # type: ignore[assignment]

    @property
    def first_page(self) -> int:
        """The first logical page it sends: earlier ones are the receiver's cached prefix."""
        return self.cached_tokens // self.pool.page_size

    def header(self, page_index: int, l0: int, l1: int) -> pb.FrameHeader:
        n = tokens_in_page(self.pool.page_size, self.prompt_len, page_index)
        return pb.FrameHeader(
            protocol_version=PROTOCOL_VERSION, transfer_id=self.ticket.transfer_id,
            request_id=self.ticket.request_id, tenant=self.ticket.tenant, ownership_tag=self.tag,
            seq=len(self.checksums), layer_start=l0, layer_end=l1, page_index=page_index,
            first_token=page_index * self.pool.page_size, num_tokens=n,
            dtype=dtype_name(self.pool.kv.dtype), shape=block_shape(self.pool, l0, l1, n),
            prompt_digest=self.ticket.prompt_digest)

    def send_layers(self, l0: int, l1: int) -> None:
        """Send layers [l0, l1) of every prompt page from first_page on, one frame per page,
        and put them on the wire at once (batching never holds a computed layer group back)."""
        for index in range(self.first_page, self.pool.pages_for(self.prompt_len)):
            self.send_page(index, l0, l1)
        if not self._early_commit:
            self.stream.flush()

    def send_page(self, page_index: int, l0: int, l1: int) -> None:
        if self._early_commit:
            return                   # a hook committed this transfer early
        h = self.header(page_index, l0, l1)
        page, n = self.page_table[page_index], h.num_tokens
        if self._direct is not None:          # hashed where it lies, sent from there
            t0 = time.perf_counter()
            h.checksum = frame_checksum(h, list[Buffer](block_parts(self.pool, page, l0, l1, n)))
            self.checksum_s += time.perf_counter() - t0
            self.checksums.append(h.checksum)
            self._direct.send_from_pool(h, self.pool, page)
            return
        staged = self.stream.stage(block_nbytes(self.pool, l0, l1, n))
        buf: Payload
        if staged is None:
            buf = read_bytes(self.pool, page, l0, l1, n)
        else:
            buf = read_block(self.pool, page, l0, l1, n, out=staged)
        t0 = time.perf_counter()
        h.checksum = frame_checksum(h, [payload_view(buf)])
        self.checksum_s += time.perf_counter() - t0
        self.checksums.append(h.checksum)
        self._early_commit = self.hooks.on_frame(self.ticket, h, buf, self.stream)

    def commit(self, first_token_id: int, first_logprob: float,
               first_top: dict[int, float] | None = None) -> pb.PushReply:
        c = pb.Commit(protocol_version=PROTOCOL_VERSION, transfer_id=self.ticket.transfer_id,
                      request_id=self.ticket.request_id, tenant=self.ticket.tenant,
                      ownership_tag=self.tag, frame_count=len(self.checksums),
                      tokens_covered=self.prompt_len, cached_tokens=self.cached_tokens,
                      digest=commit_digest(self.checksums),
                      first_token_id=first_token_id, first_logprob=first_logprob,
                      prompt_digest=self.ticket.prompt_digest,
                      first_top_ids=list(first_top or ()), first_top_logprobs=list((first_top or {}).values()))
        self.hooks.before_commit(self.ticket, self.stream)
        try:
            return self.stream.commit(c)
        finally:
            self.hooks.after_commit(self.ticket)
