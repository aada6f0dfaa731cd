"""Attention backends: how the model attends over the paged KV cache.

A backend is chosen once, at start-up (`select_attention`).  Per forward pass it
`plan`s once (work shared by all layers: index and mask tensors), then each layer
calls `decode` (one query per request) or `prefill` (padded queries per request).

    kv_layer: [C, num_pages, page_size, H, Dk]  (one layer; C == 2: K, V; C == 1: a latent
              that is the key and, cut to v_dim, the value; see engine.kernels.paged_attention)

Both take the variants of `engine.kernels.paged_attention`: `window` (sliding window),
`sinks` ([Hq] fp32 logits, gpt-oss) and `v_dim` (C == 1 only).  Defaults: plain causal.
Both raise ValueError for a layout or variant they cannot serve (see `split_kv`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch

from engine.forward_batch import ForwardBatch
from engine.kernels.paged_attention import (
    attend,
    check_variants,
    decode_mask,
    paged_attention_ref,
    paged_decode_attention_ref,
    prefill_mask,
    split_kv,
)


@dataclass
class TorchPlan:
    """The pages that hold keys (reserved pages past the longest request are skipped) and
    which key positions each request may see, per window: built once per forward pass."""

    table: torch.Tensor     # [B, pages] int64
    seq_lens: torch.Tensor  # [B]
    length: int | None      # max(seq_lens); None in a static plan (keys masked, never cut)
    keys_len: int           # pages * page_size: the gathered key positions
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> [B, 1, 1, L]

    def keys(self, window: int | None) -> tuple[int, torch.Tensor | None]:
        """(first key position to keep, mask or None).  A single request needs no mask:
        its keys are cut to [first, length) instead (unless the plan is static)."""
        if self.length is not None and self.table.shape[0] == 1:
            return (0 if window is None else max(0, self.length - window)), None
        if window not in self.masks:
            self.masks[window] = decode_mask(self.seq_lens, self.keys_len, window)[:, None, None]
        return 0, self.masks[window]


TritonPlan = tuple[torch.Tensor, torch.Tensor]  # page_table [B, max_pages], seq_lens [B]
AttentionPlan = TorchPlan | TritonPlan  # what `plan` returns and `decode` reads back: opaque to the model


class TorchAttention:
    """The CPU path (and reference): gather each request's pages, one fused SDPA call
    (with sinks: the scores in fp32 with the sink column).

    `static`: a decode plan reads no Python number from the batch (every page of the page
    table is gathered and the keys past each request's length are masked), so that a compiled
    step's graph does not depend on the lengths of the requests in it."""

    name = "torch"

    def __init__(self, page_size: int, static: bool = False) -> None:
        self.page_size = page_size
        self.static = static
        self._prefill_for: ForwardBatch | None = None  # the batch _prefill_masks were built for
        self._prefill_masks: dict[int | None, torch.Tensor] = {}

    def plan(self, batch: ForwardBatch) -> AttentionPlan:
        if self.static:
            table = batch.page_table.long()
            return TorchPlan(table, batch.seq_lens, None, table.shape[1] * self.page_size)
        length = batch.max_seq_len
        table = batch.page_table[:, :-(-length // self.page_size)].long()  # [B, pages]
        return TorchPlan(table, batch.seq_lens, length, table.shape[1] * self.page_size)

    def decode(self, q: torch.Tensor, kv_layer: torch.Tensor, plan: AttentionPlan, scale: float, *,
               window: int | None = None, sinks: torch.Tensor | None = None,
               v_dim: int | None = None) -> torch.Tensor:
        """q: [B, Hq, Dk] -> [B, Hq, Dv]."""
        p = cast(TorchPlan, plan)  # this backend's own plan
        check_variants(window, sinks, q.shape[1])
        c, _, s, h, d = kv_layer.shape
        b, pages = p.table.shape
        kv = kv_layer[:, p.table].view(c, b, pages * s, h, d)  # [C, B, L, H, Dk]
        first, visible = p.keys(window)
        if visible is None and p.length is not None:
            kv = kv[:, :, first:p.length]
        kv = kv.transpose(2, 3)  # [C, B, H, L, Dk]
        k, v = split_kv(kv, v_dim)
        return attend(q.unsqueeze(2), k, v, visible, scale, sinks).squeeze(2)  # [B, Hq, Dv]

    def prefill(self, q: torch.Tensor, kv_layer: torch.Tensor, batch: ForwardBatch, scale: float, *,
                window: int | None = None, sinks: torch.Tensor | None = None,
                v_dim: int | None = None) -> torch.Tensor:
        """q: [T, Hq, Dk] (flat) -> [T, Hq, Dv], causal over each request's pages."""
        check_variants(window, sinks, q.shape[1])
        k_cache, v_cache = split_kv(kv_layer, v_dim)
        assert batch.q_index is not None and batch.q_valid is not None  # a prefill batch
        q_positions = batch.positions[batch.q_index]  # [B, Q]
        padded = paged_attention_ref(q[batch.q_index], k_cache, v_cache, batch.page_table,
                                     q_positions, batch.seq_lens, scale, sinks=sinks,
                                     mask=self._prefill_mask(batch, q_positions, window))
        return padded[batch.q_valid]

    def _prefill_mask(self, batch: ForwardBatch, q_positions: torch.Tensor,
                      window: int | None) -> torch.Tensor:
        """[B, Q, L], built once per forward pass and window (layers alternate windows)."""
        if self._prefill_for is not batch:
            self._prefill_for, self._prefill_masks = batch, {}
        if window not in self._prefill_masks:
            length = batch.page_table.shape[1] * self.page_size
            self._prefill_masks[window] = prefill_mask(q_positions, batch.seq_lens, length, window)
        return self._prefill_masks[window]


class TritonAttention(TorchAttention):
    """CUDA: the Triton decode kernel straight over the page table (window, sinks and the
    latent layout in the kernel; a request with more than SPLIT_TOKENS keys split into chunks,
    by its own length only: engine.kernels.triton.split_combine); prefill as torch."""

    name = "triton"

    def __init__(self, page_size: int) -> None:
        super().__init__(page_size)
        from engine.kernels.triton.paged_attention import paged_decode_attention
        self._kernel = paged_decode_attention

    def plan(self, batch: ForwardBatch) -> TritonPlan:
        return batch.page_table, batch.seq_lens

    def decode(self, q: torch.Tensor, kv_layer: torch.Tensor, plan: AttentionPlan, scale: float, *,
               window: int | None = None, sinks: torch.Tensor | None = None,
               v_dim: int | None = None) -> torch.Tensor:
        table, seq_lens = cast(TritonPlan, plan)  # the kernel reads only the pages below each request's length
        check_variants(window, sinks, q.shape[1])
        k_cache, v_cache = split_kv(kv_layer, v_dim)
        return self._kernel(q, k_cache, v_cache, table, seq_lens, scale, window=window, sinks=sinks)


# The kernel variants a model may need ("window", "sinks", "latent"): start-up compiles and
# checks the plain kernel and those a model names (engine.models.kernel_variants).
VARIANTS = frozenset({"window", "sinks", "latent"})


def select_attention(device: torch.device | str, page_size: int, backend: str | None = None,
                     variants: frozenset[str] = VARIANTS) -> TorchAttention:
    """Pick the backend once, for pages of `page_size` tokens (the pool's): `backend` None means
    Triton on CUDA, torch elsewhere.  `variants`: the kernel variants the model runs (see
    VARIANTS), checked at start-up with the plain kernel.

    Raises ValueError for an unknown name or Triton off CUDA (the Triton interpreter is
    for kernel tests, never for serving); RuntimeError when the kernel fails its
    start-up comparison with the reference.
    """
    dev = torch.device(device)
    backend = backend or ("triton" if dev.type == "cuda" else "torch")
    if backend == "torch":
        return TorchAttention(page_size)
    if backend != "triton":
        raise ValueError(f"unknown attention backend {backend!r}; choose 'torch' or 'triton'")
    if dev.type != "cuda":
        raise ValueError(f"the Triton attention kernel serves on CUDA devices only, not {dev}; "
                         "use attention='torch'")
    attn = TritonAttention(page_size)
    _startup_check(attn, dev, variants)
    return attn


def _startup_check(attn: TritonAttention, device: torch.device, variants: frozenset[str] = VARIANTS) -> None:
    """Compile the kernel now, plain GQA and the `variants` the model runs (window with
    sinks; MLA's 576-dim latent with Dv = 512), and compare each with the reference on a
    small input, so a broken build fails at start-up, not on the first decode step (and a
    variant a model never runs cannot stop it from starting).  Request 1 (1,100 keys) is split
    into chunks and combined, as served; the others are not."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    table = torch.zeros(3, 70, dtype=torch.int32)                   # [B, max_pages]
    table[0, :2], table[2, :2] = torch.tensor([3, 1]), torch.tensor([4, 6])
    table[1] = torch.randperm(72, generator=gen)[:70] + 8
    table = table.to(device)
    lens = torch.tensor([20, 1100, 1], dtype=torch.int32, device=device)
    sinks = torch.randn(4, generator=gen).to(device)
    # (name, q shape, kv_layer shape, window, sinks, v_dim)
    cases: list[tuple[str, tuple[int, ...], tuple[int, ...], int | None, torch.Tensor | None, int | None]] = [
        ("plain", (3, 4, 64), (2, 80, 16, 2, 64), None, None, None),
        ("window+sinks", (3, 4, 64), (2, 80, 16, 2, 64), 21, sinks, None),
        ("latent", (3, 16, 576), (1, 80, 16, 1, 576), None, None, 512)]
    wanted = {"plain"} | ({"window+sinks"} if variants & {"window", "sinks"} else set()) | (variants & {"latent"})
    for name, q_shape, kv_shape, window, sink, v_dim in (c for c in cases if c[0] in wanted):
        q = torch.randn(q_shape, generator=gen).to(device)
        kv = torch.randn(kv_shape, generator=gen).to(device)
        got = attn.decode(q, kv, (table, lens), 0.125, window=window, sinks=sink, v_dim=v_dim)
        k_cache, v_cache = split_kv(kv, v_dim)
        want = paged_decode_attention_ref(q, k_cache, v_cache, table, lens, 0.125, window=window, sinks=sink)
        err = (got - want).abs().max().item()
        if not err < 1e-3:
            raise RuntimeError(f"Triton decode attention ({name}) differs from the reference by "
                               f"{err} at start-up")
