"""Attention backends: how the model attends over the paged KV cache.

A backend is chosen once, at start-up (`select_attention`).  Per forward pass it
`plan`s once (work shared by all layers: index and mask tensors), then each layer
calls `decode` (one query per request) or `prefill` (padded queries per request).

    kv_layer: [2, num_pages, page_size, num_kv_heads, head_dim]  (K, V of one layer)
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from engine.forward_batch import ForwardBatch
from engine.kernels.paged_attention import paged_attention_ref, paged_decode_attention_ref

# What `plan` returns and `decode` reads back: each backend's own, opaque to the model.
TorchPlan = tuple[torch.Tensor, torch.Tensor | None, int]  # pages [B, pages], mask [B, 1, 1, L] or None, length
TritonPlan = tuple[torch.Tensor, torch.Tensor]              # page_table [B, max_pages], seq_lens [B]
AttentionPlan = TorchPlan | TritonPlan


class TorchAttention:
    """The CPU path (and reference): gather each request's pages, one fused SDPA call."""

    name = "torch"

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    def plan(self, batch: ForwardBatch) -> AttentionPlan:
        """The pages that hold keys (reserved pages past the longest request are skipped),
        and which key positions each request may see (None: a single request, whose keys
        are cut to its length instead)."""
        length = batch.max_seq_len
        table = batch.page_table[:, :-(-length // self.page_size)].long()  # [B, pages]
        if table.shape[0] == 1:
            return table, None, length
        keys = torch.arange(table.shape[1] * self.page_size, device=table.device)
        visible = keys[None, :] < batch.seq_lens[:, None]  # [B, L]
        return table, visible[:, None, None], length  # mask: [B, 1, 1, L]

    def decode(self, q: torch.Tensor, kv_layer: torch.Tensor, plan: AttentionPlan, scale: float) -> torch.Tensor:
        """q: [B, Hq, D] -> [B, Hq, D]."""
        table, visible, length = cast(TorchPlan, plan)  # this backend's own plan
        b, pages = table.shape
        _, _, s, hkv, d = kv_layer.shape
        kv = kv_layer[:, table].view(2, b, pages * s, hkv, d)  # [2, B, L, Hkv, D]
        if visible is None:
            kv = kv[:, :, :length]
        kv = kv.transpose(2, 3)  # [2, B, Hkv, L, D]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), kv[0], kv[1], attn_mask=visible,
                                             scale=scale, enable_gqa=True)  # [B, Hq, 1, D]
        return out.squeeze(2)

    def prefill(self, q: torch.Tensor, kv_layer: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
        """q: [T, Hq, D] (flat) -> [T, Hq, D], causal over each request's pages."""
        padded = paged_attention_ref(q[batch.q_index], kv_layer[0], kv_layer[1], batch.page_table,
                                     batch.positions[batch.q_index], batch.seq_lens, scale)
        return padded[batch.q_valid]


class TritonAttention(TorchAttention):
    """CUDA: the Triton decode kernel straight over the page table; prefill as torch."""

    name = "triton"

    def __init__(self, page_size: int) -> None:
        super().__init__(page_size)
        from engine.kernels.triton.paged_attention import paged_decode_attention
        self._kernel = paged_decode_attention

    def plan(self, batch: ForwardBatch) -> TritonPlan:
        return batch.page_table, batch.seq_lens

    def decode(self, q: torch.Tensor, kv_layer: torch.Tensor, plan: AttentionPlan, scale: float) -> torch.Tensor:
        table, seq_lens = cast(TritonPlan, plan)  # the kernel reads only the pages below each request's length
        return self._kernel(q, kv_layer[0], kv_layer[1], table, seq_lens, scale)


def select_attention(device: torch.device | str, backend: str | None = None,
                     page_size: int = 16) -> TorchAttention:
    """Pick the backend once: `None` means Triton on CUDA, torch elsewhere.

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
    _startup_check(attn, dev)
    return attn


def _startup_check(attn: TritonAttention, device: torch.device) -> None:
    """Compile the kernel now and compare it with the reference on a small input, so a
    broken build fails at start-up, not on the first decode step."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(3, 4, 64, generator=gen).to(device)
    kv = torch.randn(2, 8, 16, 2, 64, generator=gen).to(device)
    table = torch.tensor([[3, 1, 0], [7, 2, 5], [4, 6, 0]], dtype=torch.int32, device=device)
    lens = torch.tensor([20, 48, 1], dtype=torch.int32, device=device)
    got = attn.decode(q, kv, (table, lens), 0.125)
    want = paged_decode_attention_ref(q, kv[0], kv[1], table, lens, 0.125)
    err = (got - want).abs().max().item()
    if not err < 1e-3:
        raise RuntimeError(f"Triton decode attention differs from the reference by {err} at start-up")
