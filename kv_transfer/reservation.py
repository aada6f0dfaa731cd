"""One transfer's state on the receiving side.

    RESERVED --first frame--> RECEIVING --commit ok--> COMMITTED
        \\                        \\
         `-------- any refusal, cancel, timeout --------> FAILED

A reservation covers the request's prompt pages (logical page i holds tokens
[i*S, (i+1)*S)); each page must be written once for every layer before commit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from engine.kv_pool import PagePool, PageRef
from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.pages import block_nbytes, block_shape, dtype_name, tokens_in_page
from proto import kv_transfer_pb2 as pb


class State(str, Enum):
    RESERVED = "RESERVED"
    RECEIVING = "RECEIVING"
    COMMITTED = "COMMITTED"
    FAILED = "FAILED"


@dataclass
class FrameRecord:
    header: pb.FrameHeader
    page: int                 # physical page in the receiver's pool


@dataclass
class Reservation:
    transfer_id: bytes
    request_id: str
    tenant: str
    tag: bytes
    prompt_len: int
    prompt_digest: bytes      # kv_transfer.frame.prompt_digest of the prompt reserved for
    pages: list[PageRef]      # logical prompt page i -> the physical page reserved for it
    num_layers: int
    page_size: int
    deadline: float
    timeout_s: float = 30.0   # idle timeout: no frame arriving for this long ends the transfer
    state: State = State.RESERVED
    reason: Refusal | None = None
    detail: str = ""
    writers: int = 0          # writes in flight (claimed, not finished)
    layers_done: list[bytearray] = field(default_factory=list)   # [page][layer] -> 0/1
    frames: dict[int, FrameRecord] = field(default_factory=dict)  # seq -> record
    first_token_id: int | None = None
    first_logprob: float | None = None
    first_top: dict[int, float] = field(default_factory=dict)   # the first token's top-N

    def __post_init__(self) -> None:
        self.layers_done = [bytearray(self.num_layers) for _ in self.pages]

    @property
    def terminal(self) -> bool:
        return self.state in (State.COMMITTED, State.FAILED)

    def page_complete(self, index: int) -> bool:
        return all(self.layers_done[index])

    def tokens_in_page(self, index: int) -> int:
        return tokens_in_page(self.page_size, self.prompt_len, index)

    def check_geometry(self, h: pb.FrameHeader, payload_len: int, pool: PagePool) -> None:
        """Raises TransferRefused(OUT_OF_RANGE | BAD_GEOMETRY) unless the frame fits exactly."""
        if h.page_index >= len(self.pages):
            raise TransferRefused(Refusal.OUT_OF_RANGE, f"page {h.page_index} outside the reservation "
                                  f"of {len(self.pages)} prompt pages")
        if not 0 <= h.layer_start < h.layer_end <= self.num_layers:
            raise TransferRefused(Refusal.OUT_OF_RANGE, f"layers [{h.layer_start}, {h.layer_end}) "
                                  f"outside [0, {self.num_layers})")
        n = self.tokens_in_page(h.page_index)
        want = dict(first_token=h.page_index * self.page_size, num_tokens=n, dtype=dtype_name(pool.kv.dtype),
                    shape=list(block_shape(pool, h.layer_start, h.layer_end, n)),
                    payload=block_nbytes(pool, h.layer_start, h.layer_end, n))
        got = dict(first_token=h.first_token, num_tokens=h.num_tokens, dtype=h.dtype,
                   shape=list(h.shape), payload=payload_len)
        bad = [f"{k}={got[k]} (expected {want[k]})" for k in want if got[k] != want[k]]
        if bad:
            raise TransferRefused(Refusal.BAD_GEOMETRY, f"page {h.page_index}: " + ", ".join(bad))

    def check_new(self, h: pb.FrameHeader) -> None:
        """Raises TransferRefused(DUPLICATE) if this seq or any of its (page, layer) was received."""
        if h.seq in self.frames:
            raise TransferRefused(Refusal.DUPLICATE, f"frame seq {h.seq} was already received")
        done = self.layers_done[h.page_index][h.layer_start:h.layer_end]
        if any(done):
            raise TransferRefused(Refusal.DUPLICATE, f"page {h.page_index} layers "
                                  f"[{h.layer_start}, {h.layer_end}) overlap layers already written")

    def claim(self, h: pb.FrameHeader) -> None:
        for layer in range(h.layer_start, h.layer_end):
            self.layers_done[h.page_index][layer] = 1
        self.frames[h.seq] = FrameRecord(h, self.pages[h.page_index].page)
        self.writers += 1
        self.state = State.RECEIVING

    def fail(self, reason: Refusal, detail: str) -> None:
        self.state, self.reason, self.detail = State.FAILED, reason, detail
