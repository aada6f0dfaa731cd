"""Paged attention: the torch reference (also the CPU path), its masks, and the kernel choice.

KV cache layout of one layer (one page = `page_size` consecutive positions):

    kv_layer:         [C, num_pages, page_size, H, D]
                      C == 2: K = kv_layer[0], V = kv_layer[1]          (GQA, Dv = D)
                      C == 1: K = kv_layer[0] (H = 1, MQA), V = kv_layer[0][..., :v_dim]
                              (MLA's absorbed decode: the latent is key and value)
    k_cache, v_cache: [num_pages, page_size, H, D] (v_cache may be a view narrower than D)
    page_table:       [batch, max_pages] int32; row b lists request b's pages in order
    position p of request b lives at k_cache[page_table[b, p // S], p % S]

Variants (every function takes them, defaults keep plain causal attention):
    window w: a query at position i sees keys j with i - w < j <= i (transformers' sliding_window)
    sinks:    [Hq] logits, one extra softmax column per head, dropped after the softmax (gpt-oss)

The choice between the Triton kernel and the reference is made once, at engine
start-up, by `engine.attention.select_attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def split_kv(kv_layer: torch.Tensor, v_dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches ([P, S, H, Dk], [P, S, H, Dv]; views) of one layer [C, P, S, H, Dk].

    Raises ValueError for C not in (1, 2), or a v_dim that does not fit the layout."""
    c, d = kv_layer.shape[0], kv_layer.shape[-1]
    if c == 2 and v_dim in (None, d):
        return kv_layer[0], kv_layer[1]
    if c == 1 and (v_dim is None or 0 < v_dim <= d):
        return kv_layer[0], kv_layer[0][..., :v_dim]
    raise ValueError(f"kv_layer {tuple(kv_layer.shape)} with v_dim={v_dim}: expected C == 2 "
                     f"(K, V; v_dim None or {d}) or C == 1 (latent; 0 < v_dim <= {d})")


def check_variants(window: int | None, sinks: torch.Tensor | None, hq: int) -> None:
    """Raises ValueError for a window below 1 or sinks that are not one logit per query head."""
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1 position, got {window}")
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"sinks must be [{hq}] (one logit per query head), got {tuple(sinks.shape)}")


def gather_kv(cache: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """Contiguous K or V of every request: [B, max_pages * S, Hkv, D]."""
    b, max_pages = page_table.shape
    _, s, hkv, d = cache.shape
    return cache[page_table.long()].view(b, max_pages * s, hkv, d)


def prefill_mask(q_positions: torch.Tensor, seq_lens: torch.Tensor, length: int,
                 window: int | None = None) -> torch.Tensor:
    """Which of `length` key positions each query sees: [B, Q, L] bool.

    q_positions [B, Q] (absolute), seq_lens [B] (keys >= are never seen)."""
    key_pos = torch.arange(length, device=q_positions.device)
    visible = (key_pos[None, None, :] <= q_positions[:, :, None]) & \
              (key_pos[None, None, :] < seq_lens[:, None, None])
    if window is not None:
        visible &= key_pos[None, None, :] > q_positions[:, :, None] - window
    return visible


def decode_mask(seq_lens: torch.Tensor, length: int, window: int | None = None) -> torch.Tensor:
    """Keys seen by each request's one query at position seq_len - 1: [B, L] bool."""
    key_pos = torch.arange(length, device=seq_lens.device)
    lens = seq_lens[:, None].long()
    visible = key_pos[None, :] < lens
    if window is not None:
        visible &= key_pos[None, :] >= lens - window
    return visible


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, Q, Dk], k [B, Hkv, L, Dk], v [B, Hkv, L, Dv], mask bool [B, 1, Q, L] or None
    -> [B, Hq, Q, Dv].  Without sinks one SDPA call (GQA in the kernel); with sinks the
    scores get the sink column and the softmax runs in fp32."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    b, hq, nq, _ = q.shape
    hkv = k.shape[1]
    qg = q.float().unflatten(1, (hkv, hq // hkv))                            # [B, Hkv, G, Q, Dk]
    scores = torch.einsum("bhgqd,bhld->bhgql", qg, k.float()) * scale        # [B, Hkv, G, Q, L]
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    sink = sinks.float().view(1, hkv, hq // hkv, 1, 1).expand(b, -1, -1, nq, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # sink dropped
    out = torch.einsum("bhgql,bhld->bhgqd", probs, v.float())
    return out.flatten(1, 2).to(q.dtype)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        page_table: torch.Tensor, q_positions: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, *, window: int | None = None,
                        sinks: torch.Tensor | None = None,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of padded queries over each request's pages.

    q:           [B, Q, Hq, Dk]  (Q = queries per request, padded)
    q_positions: [B, Q] int      absolute position of each query (padding: any value)
    seq_lens:    [B] int         tokens in the cache for each request (keys >= are masked)
    mask:        [B, Q, L] bool  precomputed `prefill_mask` (else built from the above)
    returns      [B, Q, Hq, Dv]
    """
    k = gather_kv(k_cache, page_table).transpose(1, 2)  # [B, Hkv, L, Dk]
    v = gather_kv(v_cache, page_table).transpose(1, 2)  # [B, Hkv, L, Dv]
    if mask is None:
        mask = prefill_mask(q_positions, seq_lens, k.shape[2], window)
    out = attend(q.transpose(1, 2), k, v, mask[:, None], scale, sinks)
    return out.transpose(1, 2)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               page_table: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, *, window: int | None = None,
                               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per request at position seq_len - 1 (the Triton kernel's reference).

    q: [B, Hq, Dk]; v_cache may be narrower (Dv); returns [B, Hq, Dv].
    """
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    k = gather_kv(k_cache, page_table).float()  # [B, L, Hkv, Dk]; fp32 math for every dtype
    v = gather_kv(v_cache, page_table).float()  # [B, L, Hkv, Dv]
    qg = q.float().view(b, hkv, hq // hkv, d) * scale  # [B, Hkv, G, Dk]
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k)
    visible = decode_mask(seq_lens, k.shape[1], window)  # [B, L]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, hkv, hq // hkv, 1).expand(b, -1, -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, v)
    return out.reshape(b, hq, v.shape[-1]).to(q.dtype)
