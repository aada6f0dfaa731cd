"""Paged attention: the torch reference (also the CPU path) and the kernel choice.

KV cache layout of one layer (one page = `page_size` consecutive positions):

    k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim]
    page_table:       [batch, max_pages] int32; row b lists request b's pages in order
    position p of request b lives at k_cache[page_table[b, p // S], p % S]

The choice between the Triton kernel and the reference is made once, at engine
start-up, by `engine.attention.select_attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    k = gather_kv(k_cache, page_table).float()  # [B, L, Hkv, D]; fp32 math for every dtype
    v = gather_kv(v_cache, page_table).float()
    qg = q.float().view(b, hkv, hq // hkv, d) * scale  # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k)
    key_pos = torch.arange(k.shape[1], device=q.device)
    mask = key_pos[None, :] >= seq_lens[:, None].long()  # [B, L]
    scores = scores.masked_fill(mask[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgl,blhd->bhgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(b, hq, d).to(q.dtype)
