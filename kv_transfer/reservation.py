"""One transfer's state on the receiving side.

    RESERVED --first frame--> RECEIVING --commit ok--> COMMITTED
        \\                        \\
         `-------- any refusal, cancel, timeout --------> FAILED

A reservation covers the request's prompt pages (logical page i holds tokens
[i*S, (i+1)*S)).  The first `cached_tokens / S` of them are the receiver's cached prefix
(shared, read-only pages of its prefix cache): no frame may touch them.  Every later page must
be written once for every layer before commit:

    page:   0 .. first_page-1        first_page .. n-1
            cached (never written)   sent as frames: [page][layer] written exactly once
    commit: cached_tokens + tokens of the layer-0 frames == prompt_len == tokens_covered
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from engine.kv_pool import PagePool, PageRef
from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.frame import commit_digest
from kv_transfer.pages import block_nbytes, block_shape, dtype_name, tokens_in_page
from proto import kv_transfer_pb2 as pb

TRANSFER_TIMEOUT_S = 30.0   # a reservation's default idle timeout (WorkerSettings.transfer_timeout_s)


class State(str, Enum):
    RESERVED = "RESERVED"
    RECEIVING = "RECEIVING"
    COMMITTED = "COMMITTED"
    FAILED = "FAILED"


def prompt_pages(pool: PagePool, request_id: str, prompt_len: int, cached_tokens: int) -> list[PageRef]:
    """The pages a transfer of `request_id`'s prompt covers: the first ceil(prompt_len / S) of
    those the pool gave it.  Raises ValueError unless it holds that many, and `cached_tokens` is
    a multiple of S in [0, prompt_len) (a cached prefix is whole pages and never holds the
    prompt's last token, whose logits are computed) equal to the leading pages the pool holds
    for it as cached."""
    n, size = pool.pages_for(prompt_len), pool.page_size
    if not pool.has(request_id):
        raise ValueError(f"request {request_id} holds no pages: the pool owner allocates before reserving")
    refs = pool.refs(request_id)
    if prompt_len < 1 or n > len(refs):
        raise ValueError(f"request {request_id}: a prompt of {prompt_len} tokens needs {n} pages, "
                         f"it holds {len(refs)}")
    if cached_tokens < 0 or cached_tokens >= prompt_len:
        raise ValueError(f"cached_tokens={cached_tokens} must lie in [0, {prompt_len}) for a prompt "
                         f"of {prompt_len} tokens (the last prompt token is never cached)")
    if cached_tokens % size:
        raise ValueError(f"cached_tokens={cached_tokens} must be a multiple of the page size {size}")
    cached = pool.cached_pages(request_id)
    if cached * size != cached_tokens:
        raise ValueError(f"request {request_id}: cached_tokens={cached_tokens}, but its first {cached} "
                         f"pages ({cached * size} tokens) are the pool's cached prefix: reserve with "
                         f"what the pool gave it")
    return refs[:n]


@dataclass
class FrameRecord:
    header: pb.FrameHeader
    page: int                 # physical page in the receiver's pool
    head: bytes = b""         # kv_transfer.frame.header_bytes(header), hashed again at the re-check


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
    timeout_s: float          # idle timeout: no frame arriving for this long ends the transfer
    cached_tokens: int = 0    # leading prompt tokens in the receiver's prefix cache (a multiple of S)
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

    @property
    def first_page(self) -> int:
        """The first logical page frames write: earlier pages are the cached prefix."""
        return self.cached_tokens // self.page_size

    @property
    def sent_pages(self) -> list[PageRef]:
        """The pages frames write (logical pages [first_page, n))."""
        return self.pages[self.first_page:]

    def page_complete(self, index: int) -> bool:
        return all(self.layers_done[index])

    def tokens_in_page(self, index: int) -> int:
        return tokens_in_page(self.page_size, self.prompt_len, index)

    def check_geometry(self, h: pb.FrameHeader, payload_len: int, pool: PagePool) -> None:
        """Raises TransferRefused(OUT_OF_RANGE | BAD_GEOMETRY) unless the frame fits exactly: its
        token range, dtype, shape [layers, components, tokens, heads, dim] (the pool's KV
        geometry) and payload size."""
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
            components, heads, dim = pool.geometry
            raise TransferRefused(Refusal.BAD_GEOMETRY, f"page {h.page_index}: " + ", ".join(bad) +
                                  f"; this pool's KV rows are [layers, {components} components, tokens, "
                                  f"{heads} heads, {dim} dims] of {want['dtype']}")

    def check_uncached(self, h: pb.FrameHeader) -> None:
        """Raises TransferRefused(CACHED_PAGE) for a frame aimed at the cached prefix (a page
        index checked by check_geometry)."""
        if h.page_index < self.first_page:
            raise TransferRefused(Refusal.CACHED_PAGE, f"page {h.page_index} is a cached prefix page "
                                  f"(the first {self.first_page} pages, {self.cached_tokens} tokens, "
                                  f"are shared and read-only)")

    def check_new(self, h: pb.FrameHeader) -> None:
        """Raises TransferRefused(DUPLICATE) if this seq or any of its (page, layer) was received."""
        if h.seq in self.frames:
            raise TransferRefused(Refusal.DUPLICATE, f"frame seq {h.seq} was already received")
        done = self.layers_done[h.page_index][h.layer_start:h.layer_end]
        if any(done):
            raise TransferRefused(Refusal.DUPLICATE, f"page {h.page_index} layers "
                                  f"[{h.layer_start}, {h.layer_end}) overlap layers already written")

    def check_coverage(self, c: pb.Commit) -> None:
        """Raises TransferRefused(INCOMPLETE | BAD_COVERAGE | BAD_DIGEST) unless every page from
        first_page on was written for every layer, the frames' tokens plus the cached prefix are
        the whole prompt, and the commit states the same counts and digest."""
        n = len(self.pages)
        missing = [i for i in range(self.first_page, n) if not self.page_complete(i)]
        if missing:
            raise TransferRefused(Refusal.INCOMPLETE, f"prompt pages {missing[:8]} of pages "
                                  f"[{self.first_page}, {n}) not fully written")
        seqs = sorted(self.frames)
        sent = sum(r.header.num_tokens for r in self.frames.values() if r.header.layer_start == 0)
        if c.frame_count != len(seqs) or seqs != list(range(len(seqs))) or \
                c.tokens_covered != self.prompt_len or sent + self.cached_tokens != self.prompt_len or \
                c.cached_tokens != self.cached_tokens:
            raise TransferRefused(Refusal.BAD_COVERAGE, f"commit says {c.frame_count} frames / "
                                  f"{c.tokens_covered} tokens / {c.cached_tokens} cached; received seqs "
                                  f"0..{len(seqs) - 1} ({len(seqs)} frames) covering {sent} tokens after "
                                  f"{self.cached_tokens} cached, of {self.prompt_len}")
        if commit_digest([self.frames[s].header.checksum for s in seqs]) != c.digest:
            raise TransferRefused(Refusal.BAD_DIGEST, "digest over frame checksums differs")

    def claim(self, h: pb.FrameHeader) -> FrameRecord:
        """Take (page, layers) and the seq for `h` and count a write in flight; returns its record."""
        done = self.layers_done[h.page_index]
        done[h.layer_start:h.layer_end] = b"\x01" * (h.layer_end - h.layer_start)
        record = self.frames[h.seq] = FrameRecord(h, self.pages[h.page_index].page)
        self.writers += 1
        self.state = State.RECEIVING
        return record

    def fail(self, reason: Refusal, detail: str) -> None:
        self.state, self.reason, self.detail = State.FAILED, reason, detail
