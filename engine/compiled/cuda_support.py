"""What the CUDA-graph decode step (engine/compiled/cuda_graphs.py) uses around its graphs: the
packed input rows of a bucket and their host-side staging (CPU code, tested without CUDA),
counting host synchronisations (for the tests and `bench.gpu_check`), and the Triton decode
attention as a custom op that dynamo does not trace."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from engine.attention import AttentionPlan, TorchAttention, TritonAttention, TritonPlan
from engine.kernels.paged_attention import check_variants, split_kv

IDS, POS, SLOT, LEN, REAL, PAGES = range(6)   # columns of a bucket's packed rows; PAGES: the first page
SYNC_WARNING = "synchronizing CUDA operation"  # what torch's sync debug mode warns with


# ---- the host side: staging a decode batch (CPU-only code, tested without CUDA) --------------

def blank_rows(rows: int, max_pages: int, scratch_page: int, page_size: int) -> np.ndarray:
    """[rows, PAGES + max_pages] int32 padding rows: token 0 at position 0 on the scratch page."""
    out = np.full((rows, PAGES + max_pages), scratch_page, dtype=np.int32)
    out[:, [IDS, POS, REAL]] = 0
    out[:, SLOT] = scratch_page * page_size
    out[:, LEN] = 1
    return out


def fill_rows(out: np.ndarray, tokens: list[list[int]], starts: list[int], tables: list[list[int]],
              page_size: int, scratch_page: int, real: int | None = None) -> None:
    """Write a decode batch of n rows into the first n rows of `out` (see `blank_rows`) and turn
    the rest into padding rows.  A row's page columns past its own pages name the scratch page
    (the Triton kernel reads no page past a row's length; the torch attention gathers them all,
    masked: never another request's page).  `real`: how many of the n rows are
    requests (default n).  Raises ValueError for more rows than `out` has, a row adding other than
    one token, or a page table wider than `out`'s."""
    n, (rows, width) = len(tokens), out.shape
    max_pages = width - PAGES
    if n > rows:
        raise ValueError(f"a decode batch of {n} rows does not fit the bucket of {rows}")
    for i, (toks, start, table) in enumerate(zip(tokens, starts, tables)):
        if len(toks) != 1:
            raise ValueError(f"row {i} adds {len(toks)} tokens; a decode step adds one per request")
        if len(table) > max_pages:
            raise ValueError(f"row {i} holds {len(table)} pages, more than the graphs' {max_pages}")
        out[i, PAGES:PAGES + len(table)] = table
        out[i, PAGES + len(table):] = scratch_page
        page = table[start // page_size]
        out[i, IDS], out[i, POS], out[i, LEN] = toks[0], start, start + 1
        out[i, SLOT] = page * page_size + start % page_size
    out[:n, REAL] = 0
    out[:n if real is None else min(real, n), REAL] = 1
    if n < rows:
        out[n:, [IDS, POS, REAL]] = 0
        out[n:, SLOT] = scratch_page * page_size
        out[n:, LEN] = 1
        out[n:, PAGES] = scratch_page


def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A bucket's rows as the forward takes them: input_ids, positions, slot_mapping (int64),
    page_table [b, max_pages], seq_lens [b] (int32, contiguous), as `build_batch` makes them."""
    return (packed[:, IDS].long(), packed[:, POS].long(), packed[:, SLOT].long(), packed[:, PAGES:].contiguous(),
            packed[:, LEN].contiguous())


# ---- counting host synchronisations ---------------------------------------------------------

@dataclass
class SyncCount:
    messages: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.messages)


@contextmanager
def count_host_syncs() -> Iterator[SyncCount]:
    """Count the host synchronisations of the block: every CUDA call torch's sync debug mode
    reports (stream/device synchronisation, a copy to the host or from pageable host memory,
    `.item()`, `.tolist()`, ...).  Restores the previous mode afterwards."""
    found = SyncCount()
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(before)
    found.messages += [str(w.message) for w in caught if SYNC_WARNING in str(w.message)]


# ---- the attention, opaque to dynamo ----------------------------------------------------------

_SCHEMA = ("(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor seq_lens, float scale, "
           "int? window, Tensor? sinks) -> Tensor")
_decode_op: Any = None


def decode_op() -> Any:
    """`tandem::paged_decode_attention`: the Triton decode kernel as a custom op (on a CPU the
    reference, for tests), registered at the first call."""
    global _decode_op
    if _decode_op is None:
        def triton_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                          seq_lens: torch.Tensor, scale: float, window: int | None,
                          sinks: torch.Tensor | None) -> torch.Tensor:
            from engine.kernels.triton.paged_attention import paged_decode_attention
            return paged_decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale, window=window, sinks=sinks)

        def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, window: int | None,
                      sinks: torch.Tensor | None) -> torch.Tensor:
            from engine.kernels.paged_attention import paged_decode_attention_ref
            return paged_decode_attention_ref(q, k_cache, v_cache, page_table, seq_lens, scale, window=window,
                                              sinks=sinks).contiguous()

        def fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
            return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))

        op = torch.library.custom_op("tandem::paged_decode_attention", triton_decode, mutates_args=(),
                                     schema=_SCHEMA)
        op.register_kernel("cpu", reference)
        op.register_fake(fake)
        _decode_op = op
    return _decode_op


class GraphAttention(TritonAttention):
    """The Triton decode attention through `decode_op` (prefill as TritonAttention's)."""

    name = "triton-graph"

    def __init__(self, page_size: int) -> None:
        TorchAttention.__init__(self, page_size)
        self._op = decode_op()

    def decode(self, q: torch.Tensor, kv_layer: torch.Tensor, plan: AttentionPlan, scale: float, *,
               window: int | None = None, sinks: torch.Tensor | None = None,
               v_dim: int | None = None) -> torch.Tensor:
        table, seq_lens = cast(TritonPlan, plan)
        check_variants(window, sinks, q.shape[1])
        k_cache, v_cache = split_kv(kv_layer, v_dim)
        out: torch.Tensor = self._op(q, k_cache, v_cache, table, seq_lens, scale, window, sinks)
        return out

    def plan(self, batch: Any) -> TritonPlan:
        return batch.page_table, batch.seq_lens
