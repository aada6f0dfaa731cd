"""Triton decode paged attention: one query per request, same semantics as
`engine.kernels.paged_attention.paged_decode_attention_ref` (cache layout and the window and
sinks variants documented there).

One program per (request b, kv head h, block of BLOCK_G query heads of that GQA group, chunk c
of b's keys) runs an online softmax (running max and sum in fp32) over BLOCK_N key positions at
a time; a block may span several pages (page ids are gathered per position), so page sizes
below tl.dot's minimum of 16 work too.  Split-K (engine.kernels.triton.split_combine): a request
whose keys exceed SPLIT_TOKENS is cut into chunks by a rule of its own length alone; each
chunk's program writes a partial and a second kernel combines them.  A request of one chunk is
written by its one program, as before split-K, so no request's output depends on the others in
its batch.  Programs past their request's chunks return at once.  Every variant below (and any
GQA group and page size) runs through this one path: there is no other kernel to route to.

    window w:  the keys (and so the chunks) start at max(0, seq_len - w) instead of 0
    sinks:     chunk 0's running max starts at the sink logit and its running sum at 1 (its
               exp), with nothing added to the accumulator: the sink column, dropped
    head dims: Dk = D1 + tail, D1 the largest power of two <= Dk, the tail loaded as one
               more masked power-of-two block (MLA: 576 = 512 + 64); V is [.., Dv <= Dk],
               padded and masked, and when V is K's first D1 dims (the latent) K's block
               is reused instead of loaded again
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton.split_combine import (
    MAX_SPLITS,
    SPLIT_TOKENS,
    combine,
    partials,
    split_rule,
    visible_keys,
)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 1024


# Kernel parameters are annotated with their in-kernel types, tl.tensor (pointers and runtime
# scalars) or tl.constexpr, never `int`/`float`/`bool`: Triton reads those as forced i32/fp32/u1
# argument types (no 64-bit strides, no specialisation of integers equal to 1).  The page table's
# width (max_pages, stride_ptb) is the one argument that changes with a request's batch partners
# (a batch's table is as wide as its longest request), so it is never specialised: the same
# binary serves a request whatever is beside it.
@triton.jit(do_not_specialize=["stride_ptb", "max_pages"])
def _paged_decode_kernel(
    q_ptr: tl.tensor, k_ptr: tl.tensor, v_ptr: tl.tensor, pt_ptr: tl.tensor, sl_ptr: tl.tensor,
    sink_ptr: tl.tensor, o_ptr: tl.tensor, m_ptr: tl.tensor, l_ptr: tl.tensor, acc_ptr: tl.tensor,
    stride_qb: tl.tensor, stride_qh: tl.tensor,                          # q:  [B, Hq, Dk], last dim contiguous
    stride_kp: tl.tensor, stride_ks: tl.tensor, stride_kh: tl.tensor,    # k:  [P, S, Hkv, Dk]
    stride_vp: tl.tensor, stride_vs: tl.tensor, stride_vh: tl.tensor,    # v:  [P, S, Hkv, Dv]
    stride_ptb: tl.tensor,                                               # pt: [B, max_pages] int32
    stride_ob: tl.tensor, stride_oh: tl.tensor,                          # o:  [B, Hq, Dv]
    stride_mb: tl.tensor, stride_mh: tl.tensor,                          # m, l: [B, Hq, MAX_SPLITS] fp32
    stride_ab: tl.tensor, stride_ah: tl.tensor, stride_as: tl.tensor,    # acc:  [B, Hq, MAX_SPLITS, Dv] fp32
    max_pages: tl.tensor, qk_scale: tl.tensor, window: tl.tensor,        # qk_scale = scale * log2(e)
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    D1: tl.constexpr, D2: tl.constexpr, TAIL: tl.constexpr, DV: tl.constexpr, V_DIM: tl.constexpr,
    V_IS_K1: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, SPLIT_TOKENS: tl.constexpr, MAX_SPLITS: tl.constexpr,
) -> None:
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2) % MAX_SPLITS                        # chunk of b's keys
    first, seq_len = visible_keys(sl_ptr, b, max_pages, window, PAGE_SIZE, HAS_WINDOW)
    chunk, splits = split_rule(seq_len - first, BLOCK_N, SPLIT_TOKENS, MAX_SPLITS)
    if split >= splits:                                          # b has fewer chunks
        return
    lo = first + split * chunk                                   # this chunk: keys lo .. hi - 1
    hi = tl.minimum(lo + chunk, seq_len)
    offs_g = (tl.program_id(2) // MAX_SPLITS) * BLOCK_G + tl.arange(0, BLOCK_G)  # [BLOCK_G] head in the group
    offs_d1 = tl.arange(0, D1)
    offs_v = tl.arange(0, DV)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    heads = h * GROUP + offs_g                  # [BLOCK_G] absolute query head

    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q1 = tl.load(q_row + offs_d1[None, :], mask=g_mask[:, None], other=0.0)   # [BLOCK_G, D1]
    if DOT_F32:
        q1 = q1.to(tl.float32)
    if D2 > 0:
        offs_d2 = tl.arange(0, D2)
        q2 = tl.load(q_row + D1 + offs_d2[None, :], mask=g_mask[:, None] & (offs_d2[None, :] < TAIL),
                     other=0.0)                                               # [BLOCK_G, D2]
        if DOT_F32:
            q2 = q2.to(tl.float32)
    if HAS_SINKS:  # the sink column, in chunk 0: its logit starts the max, its exp (1 after the shift) the sum
        sink = tl.load(sink_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, float("-inf"))
        l_i = tl.where(split == 0, 1.0, tl.zeros([BLOCK_G], tl.float32))
    else:
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max (log2 domain)
        l_i = tl.zeros([BLOCK_G], tl.float32)                 # running sum of exp2
    acc = tl.zeros([BLOCK_G, DV], tl.float32)

    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n                                # [BLOCK_N]
        valid = pos < hi
        # Page id of each position; pages past the chunk are never read.
        page = tl.load(pt_ptr + b * stride_ptb + pos // PAGE_SIZE, mask=valid, other=0)
        page = page.to(tl.int64)
        slot = pos % PAGE_SIZE
        k_row = k_ptr + (page * stride_kp + slot * stride_ks + h * stride_kh)[:, None]  # [BLOCK_N, 1]
        k1 = tl.load(k_row + offs_d1[None, :], mask=valid[:, None], other=0.0)          # [BLOCK_N, D1]
        if DOT_F32:
            k1 = k1.to(tl.float32)
        s = tl.dot(q1, tl.trans(k1), input_precision="ieee")                             # [BLOCK_G, BLOCK_N]
        if D2 > 0:
            k2 = tl.load(k_row + D1 + offs_d2[None, :], mask=valid[:, None] & (offs_d2[None, :] < TAIL),
                         other=0.0)                                                     # [BLOCK_N, D2]
            if DOT_F32:
                k2 = k2.to(tl.float32)
            s += tl.dot(q2, tl.trans(k2), input_precision="ieee")
        if V_IS_K1:
            v = k1
        else:
            v_off = page * stride_vp + slot * stride_vs + h * stride_vh
            v = tl.load(v_ptr + v_off[:, None] + offs_v[None, :],
                        mask=valid[:, None] & (offs_v[None, :] < V_DIM), other=0.0)      # [BLOCK_N, DV]
            if DOT_F32:
                v = v.to(tl.float32)

        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        # Every block holds >= 1 valid position, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))          # [BLOCK_G]
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])                     # [BLOCK_G, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out_mask = g_mask[:, None] & (offs_v[None, :] < V_DIM)
    if splits == 1:
        out = acc / l_i[:, None]                            # seq_len 0 -> NaN, like the reference
        tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_v[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=out_mask)
    else:                                                   # a partial, for split_combine
        ml = b * stride_mb + heads * stride_mh + split
        tl.store(m_ptr + ml, m_i, mask=g_mask)
        tl.store(l_ptr + ml, l_i, mask=g_mask)
        tl.store(acc_ptr + b * stride_ab + heads[:, None] * stride_ah + split * stride_as + offs_v[None, :],
                 acc, mask=out_mask)


# The interpreter (TRITON_INTERPRET=1, read when the kernel is decorated) multiplies the raw
# bits of bfloat16 tl.dot operands (triton-lang/triton#11584): upcast them to fp32 there.
_INTERPRETED = not isinstance(_paged_decode_kernel, triton.runtime.jit.JITFunction)


def key_block(head_dim: int, page_size: int) -> int:
    """BLOCK_N, the key positions a program attends at a time (and the unit of split-K's chunks)."""
    if head_dim > 256:
        return 16
    return max(16, min(triton.next_power_of_2(page_size), 64 if head_dim <= 128 else 32))


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
           seq_lens: torch.Tensor, window: int | None, sinks: torch.Tensor | None) -> None:
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"expected q [B, Hq, D] and k_cache [P, S, Hkv, D], got "
                         f"{tuple(q.shape)} and {tuple(k_cache.shape)}")
    if v_cache.shape[:3] != k_cache.shape[:3] or not 1 <= v_cache.shape[3] <= k_cache.shape[3]:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} does not fit k_cache shape "
                         f"{tuple(k_cache.shape)} (same [P, S, Hkv], 1 <= Dv <= Dk)")
    bsz, hq, d = q.shape
    hkv, dk = k_cache.shape[2:]
    if dk != d:
        raise ValueError(f"head_dim mismatch: q has {d}, caches have {dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"Hq={hq} is not a multiple of Hkv={hkv}")
    if not 16 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [16, {MAX_HEAD_DIM}], got {d}")
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q/k_cache/v_cache must share one dtype among {_DTYPES}, got "
                         f"{q.dtype}/{k_cache.dtype}/{v_cache.dtype}")
    if page_table.dim() != 2 or page_table.shape[0] != bsz or seq_lens.shape != (bsz,):
        raise ValueError(f"expected page_table [{bsz}, max_pages] and seq_lens [{bsz}], got "
                         f"{tuple(page_table.shape)} and {tuple(seq_lens.shape)}")
    if page_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError(f"page_table and seq_lens must be int32, got {page_table.dtype} and {seq_lens.dtype}")
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1 position, got {window}")
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"sinks must be [{hq}] (one logit per query head), got {tuple(sinks.shape)}")
    tensors = (q, k_cache, v_cache, page_table, seq_lens) + (() if sinks is None else (sinks,))
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous in the last (head_dim) dim")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, *, window: int | None = None,
                           sinks: torch.Tensor | None = None, split_tokens: int = SPLIT_TOKENS,
                           max_splits: int = MAX_SPLITS) -> torch.Tensor:
    """Decode attention (one query per request at position seq_len - 1) over paged K/V.

    q: [B, Hq, Dk]; k_cache: [num_pages, page_size, Hkv, Dk], v_cache: [.., Hkv, Dv <= Dk]
    (may be a view of k_cache: the latent); same dtype as q: fp32, fp16 or bf16;
    page_table: [B, max_pages] int32; seq_lens: [B] int32, each >= 1; window: keys
    seq_len - window .. seq_len - 1 only; sinks: [Hq] logits.  Returns [B, Hq, Dv] in q's dtype.
    split_tokens, max_splits: the split-K rule's constants (engine.kernels.triton.split_combine);
    serving keeps the defaults, tests shrink them (max_splits=1: no request is split).
    Raises ValueError on a wrong rank, shape, dtype or device, Hq % Hkv != 0, a head_dim
    outside [16, 1024], a window < 1, caches whose last dim is not contiguous, or split
    constants below 1 (max_splits not a power of two).
    """
    _check(q, k_cache, v_cache, page_table, seq_lens, window, sinks)
    if split_tokens < 1 or max_splits < 1 or max_splits & (max_splits - 1):
        raise ValueError(f"split_tokens must be >= 1 and max_splits a power of two, got "
                         f"{split_tokens} and {max_splits}")
    bsz, hq, d = q.shape
    _, page_size, hkv, dv = v_cache.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    page_table = page_table.contiguous()
    seq_lens = seq_lens.contiguous()
    sink = q if sinks is None else sinks.float().contiguous()  # q: never read without sinks (no allocation)

    out = torch.empty((bsz, hq, dv), dtype=q.dtype, device=q.device)  # [B, Hq, Dv]
    if bsz == 0 or hq == 0:
        return out
    group = hq // hkv
    d1 = 1 << (d.bit_length() - 1)                 # largest power of two <= Dk
    tail = d - d1
    block_g = max(16, min(triton.next_power_of_2(group), 64 if d <= 256 else 16))
    block_n = key_block(d, page_size)
    v_is_k1 = (dv == d1 and v_cache.data_ptr() == k_cache.data_ptr()
               and v_cache.stride() == k_cache.stride())
    m, l_sum, acc = partials(bsz, hq, dv, max_splits, q.device) if max_splits > 1 else (out, out, out)
    grid = (bsz, hkv, triton.cdiv(group, block_g) * max_splits)
    _paged_decode_kernel[grid](
        q, k_cache, v_cache, page_table, seq_lens, sink, out, m, l_sum, acc,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0),
        out.stride(0), out.stride(1),
        m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
        page_table.shape[1], scale * _LOG2E, window or 0,
        PAGE_SIZE=page_size, GROUP=group, BLOCK_G=block_g,
        D1=d1, D2=max(16, triton.next_power_of_2(tail)) if tail else 0, TAIL=tail,
        DV=max(16, triton.next_power_of_2(dv)), V_DIM=dv, V_IS_K1=v_is_k1,
        HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None,
        BLOCK_N=block_n, DOT_F32=_INTERPRETED and q.dtype == torch.bfloat16,
        SPLIT_TOKENS=split_tokens, MAX_SPLITS=max_splits,
    )
    if max_splits > 1:
        combine(seq_lens, m, l_sum, acc, out, page_table.shape[1], window, page_size, block_n,
                split_tokens, max_splits)
    return out
