"""Triton decode paged attention: one query per request, same semantics as
`engine.kernels.paged_attention.paged_decode_attention_ref` (cache layout and the window and
sinks variants documented there).

One program per (request b, kv head h, block of BLOCK_G query heads of that GQA group)
runs an online softmax (running max and sum in fp32) over BLOCK_N key positions at a time;
a block may span several pages (page ids are gathered per position), so page sizes below
tl.dot's minimum of 16 work too.

    window w:  the loop starts at key max(0, seq_len - w) instead of 0
    sinks:     the running max starts at the sink logit and the running sum at 1 (its
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

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 1024


# Kernel parameters are annotated with their in-kernel types, tl.tensor (pointers and runtime
# scalars) or tl.constexpr, never `int`/`float`/`bool`: Triton reads those as forced i32/fp32/u1
# argument types (no 64-bit strides, no specialisation of integers equal to 1).
@triton.jit
def _paged_decode_kernel(
    q_ptr: tl.tensor, k_ptr: tl.tensor, v_ptr: tl.tensor, pt_ptr: tl.tensor, sl_ptr: tl.tensor,
    sink_ptr: tl.tensor, o_ptr: tl.tensor,
    stride_qb: tl.tensor, stride_qh: tl.tensor,                          # q:  [B, Hq, Dk], last dim contiguous
    stride_kp: tl.tensor, stride_ks: tl.tensor, stride_kh: tl.tensor,    # k:  [P, S, Hkv, Dk]
    stride_vp: tl.tensor, stride_vs: tl.tensor, stride_vh: tl.tensor,    # v:  [P, S, Hkv, Dv]
    stride_ptb: tl.tensor,                                               # pt: [B, max_pages] int32
    stride_ob: tl.tensor, stride_oh: tl.tensor,                          # o:  [B, Hq, Dv]
    max_pages: tl.tensor, qk_scale: tl.tensor, window: tl.tensor,        # qk_scale = scale * log2(e)
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    D1: tl.constexpr, D2: tl.constexpr, TAIL: tl.constexpr, DV: tl.constexpr, V_DIM: tl.constexpr,
    V_IS_K1: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
) -> None:
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_g = tl.program_id(2) * BLOCK_G + tl.arange(0, BLOCK_G)  # [BLOCK_G] query head within the group
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
    # The reference only sees max_pages * S positions: clamp like it does.
    seq_len = tl.minimum(tl.load(sl_ptr + b), max_pages * PAGE_SIZE)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(seq_len - window, 0)

    if HAS_SINKS:  # the sink column: its logit starts the max, its exp (1 after the shift) the sum
        m_i = tl.load(sink_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_G], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max (log2 domain)
        l_i = tl.zeros([BLOCK_G], tl.float32)                 # running sum of exp2
    acc = tl.zeros([BLOCK_G, DV], tl.float32)

    for start in range(first, seq_len, BLOCK_N):
        pos = start + offs_n                                # [BLOCK_N]
        valid = pos < seq_len
        # Page id of each position; pages past seq_len are never read.
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

    out = acc / l_i[:, None]                                # seq_len 0 -> NaN, like the reference
    tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_v[None, :],
             out.to(o_ptr.dtype.element_ty), mask=g_mask[:, None] & (offs_v[None, :] < V_DIM))


# The interpreter (TRITON_INTERPRET=1, read when the kernel is decorated) multiplies the raw
# bits of bfloat16 tl.dot operands (triton-lang/triton#11584): upcast them to fp32 there.
_INTERPRETED = not isinstance(_paged_decode_kernel, triton.runtime.jit.JITFunction)


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
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention (one query per request at position seq_len - 1) over paged K/V.

    q: [B, Hq, Dk]; k_cache: [num_pages, page_size, Hkv, Dk], v_cache: [.., Hkv, Dv <= Dk]
    (may be a view of k_cache: the latent); same dtype as q: fp32, fp16 or bf16;
    page_table: [B, max_pages] int32; seq_lens: [B] int32, each >= 1; window: keys
    seq_len - window .. seq_len - 1 only; sinks: [Hq] logits.  Returns [B, Hq, Dv] in q's dtype.
    Raises ValueError on a wrong rank, shape, dtype or device, Hq % Hkv != 0, a head_dim
    outside [16, 1024], a window < 1, or caches whose last dim is not contiguous.
    """
    _check(q, k_cache, v_cache, page_table, seq_lens, window, sinks)
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
    block_n = 16 if d > 256 else max(16, min(triton.next_power_of_2(page_size), 64 if d <= 128 else 32))
    v_is_k1 = (dv == d1 and v_cache.data_ptr() == k_cache.data_ptr()
               and v_cache.stride() == k_cache.stride())
    grid = (bsz, hkv, triton.cdiv(group, block_g))
    _paged_decode_kernel[grid](
        q, k_cache, v_cache, page_table, seq_lens, sink, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0),
        out.stride(0), out.stride(1),
        page_table.shape[1], scale * _LOG2E, window or 0,
        PAGE_SIZE=page_size, GROUP=group, BLOCK_G=block_g,
        D1=d1, D2=max(16, triton.next_power_of_2(tail)) if tail else 0, TAIL=tail,
        DV=max(16, triton.next_power_of_2(dv)), V_DIM=dv, V_IS_K1=v_is_k1,
        HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None,
        BLOCK_N=block_n, DOT_F32=_INTERPRETED and q.dtype == torch.bfloat16,
    )
    return out
