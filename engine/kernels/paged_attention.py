"""Paged attention: the torch reference (also the CPU path) and the kernel choice.

KV cache layout of one layer (one page = `page_size` consecutive positions):

    k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim]
    page_table:       [batch, max_pages] int32; row b lists request b's pages in order
    position p of request b lives at k_cache[page_table[b, p // S], p % S]

The choice between the Triton kernel and the reference is made once, by
`select_decode_attention(device)`, at engine start-up.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

DecodeAttention = Callable[..., torch.Tensor]


def gather_kv(cache: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """Contiguous K or V of every request: [B, max_pages * S, Hkv, D]."""
    b, max_pages = page_table.shape
    _, s, hkv, d = cache.shape
    return cache[page_table.long()].view(b, max_pages * s, hkv, d)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        page_table: torch.Tensor, q_positions: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of padded queries over each request's pages.

    q:           [B, Q, Hq, D]  (Q = queries per request, padded)
    q_positions: [B, Q] int     absolute position of each query (padding: any value)
    seq_lens:    [B] int        tokens in the cache for each request (keys >= are masked)
    returns      [B, Q, Hq, D]
    """
    k = gather_kv(k_cache, page_table).transpose(1, 2)  # [B, Hkv, L, D]
    v = gather_kv(v_cache, page_table).transpose(1, 2)
    key_pos = torch.arange(k.shape[2], device=q.device)
    visible = (key_pos[None, None, :] <= q_positions[:, :, None]) & \
              (key_pos[None, None, :] < seq_lens[:, None, None])  # [B, Q, L]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible[:, None],
                                         scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               page_table: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """One query per request at position seq_len - 1.

    q: [B, Hq, D]; returns [B, Hq, D].
    """
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    k = gather_kv(k_cache, page_table)  # [B, L, Hkv, D]
    v = gather_kv(v_cache, page_table)
    qg = q.view(b, hkv, hq // hkv, d)  # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale
    key_pos = torch.arange(k.shape[1], device=q.device)
    mask = key_pos[None, :] >= seq_lens[:, None].long()  # [B, L]
    scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.einsum("bhgl,blhd->bhgd", probs, v)
    return out.reshape(b, hq, d)


def select_decode_attention(device: torch.device | str, prefer_triton: bool | None = None) -> tuple[str, DecodeAttention]:
    """Pick the decode-attention implementation once: Triton on CUDA, else the reference.

    `prefer_triton=None` means: Triton when the device is CUDA and triton imports.
    (On a CPU the Triton interpreter is for kernel tests only, never for serving.)
    """
    dev = torch.device(device)
    if prefer_triton is None:
        prefer_triton = dev.type == "cuda"
    if prefer_triton:
        try:
            from engine.kernels.triton.paged_attention import paged_decode_attention
        except ImportError:
            return "torch", paged_decode_attention_ref
        return "triton", paged_decode_attention
    return "torch", paged_decode_attention_ref
