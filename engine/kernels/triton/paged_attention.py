"""Triton decode paged attention: one query per request, same semantics as
`engine.kernels.paged_attention.paged_decode_attention_ref` (cache layout documented there).

One program per (request b, kv head h) computes the G = Hq // Hkv query heads of that GQA
group with an online softmax (running max and sum in fp32) over BLOCK_N key positions at a
time; a block may span several pages (page ids are gathered per position), so page sizes
below tl.dot's minimum of 16 work too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# Kernel parameters are annotated with their in-kernel types, tl.tensor (pointers and runtime
# scalars) or tl.constexpr, never `int`/`float`/`bool`: Triton reads those as forced i32/fp32/u1
# argument types (no 64-bit strides, no specialisation of integers equal to 1).
@triton.jit
def _paged_decode_kernel(
    q_ptr: tl.tensor, k_ptr: tl.tensor, v_ptr: tl.tensor, pt_ptr: tl.tensor, sl_ptr: tl.tensor,
    o_ptr: tl.tensor,
    stride_qb: tl.tensor, stride_qh: tl.tensor,                          # q:  [B, Hq, D], last dim contiguous
    stride_kp: tl.tensor, stride_ks: tl.tensor, stride_kh: tl.tensor,    # k:  [P, S, Hkv, D]
    stride_vp: tl.tensor, stride_vs: tl.tensor, stride_vh: tl.tensor,    # v:  [P, S, Hkv, D]
    stride_ptb: tl.tensor,                                               # pt: [B, max_pages] int32
    stride_ob: tl.tensor, stride_oh: tl.tensor,                          # o:  [B, Hq, D]
    max_pages: tl.tensor, qk_scale: tl.tensor,                           # qk_scale = scale * log2(e)
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
) -> None:
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_g = tl.arange(0, GROUP_PAD)            # [G_PAD] query head within the group
    offs_d = tl.arange(0, HEAD_DIM)             # [D]
    offs_n = tl.arange(0, BLOCK_N)              # [BLOCK_N]
    g_mask = offs_g < GROUP
    heads = h * GROUP + offs_g                  # [G_PAD] absolute query head

    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None], other=0.0)            # [G_PAD, D]
    if DOT_F32:
        q = q.to(tl.float32)
    # The reference only sees max_pages * S positions: clamp like it does.
    seq_len = tl.minimum(tl.load(sl_ptr + b), max_pages * PAGE_SIZE)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([GROUP_PAD], tl.float32)                 # running sum of exp2
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)       # [G_PAD, D]

    for start in range(0, seq_len, BLOCK_N):
        pos = start + offs_n                                # [BLOCK_N]
        valid = pos < seq_len
        # Page id of each position; pages past seq_len are never read.
        page = tl.load(pt_ptr + b * stride_ptb + pos // PAGE_SIZE, mask=valid, other=0)
        page = page.to(tl.int64)
        slot = pos % PAGE_SIZE
        k_off = page * stride_kp + slot * stride_ks + h * stride_kh     # [BLOCK_N]
        v_off = page * stride_vp + slot * stride_vs + h * stride_vh
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :],
                    mask=valid[:, None], other=0.0)          # [BLOCK_N, D]
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :],
                    mask=valid[:, None], other=0.0)          # [BLOCK_N, D]
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [G_PAD, BLOCK_N] fp32
        s = tl.where(valid[None, :], s, float("-inf"))
        # Every block holds >= 1 valid position, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))          # [G_PAD]
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])                     # [G_PAD, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc / l_i[:, None]                                # seq_len 0 -> NaN, like the reference
    tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=g_mask[:, None])


# The interpreter (TRITON_INTERPRET=1, read when the kernel is decorated) multiplies the raw
# bits of bfloat16 tl.dot operands (triton-lang/triton#11584): upcast them to fp32 there.
_INTERPRETED = not isinstance(_paged_decode_kernel, triton.runtime.jit.JITFunction)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, *, window: int | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention (one query per request at position seq_len - 1) over paged K/V.

    q: [B, Hq, D]; k_cache, v_cache: [num_pages, page_size, Hkv, D] (same dtype as q:
    fp32, fp16 or bf16); page_table: [B, max_pages] int32; seq_lens: [B] int32, each >= 1.
    Returns [B, Hq, D] in q's dtype.
    Raises ValueError on a wrong rank, shape, dtype or device, Hq % Hkv != 0, a head_dim
    that is not a power of two in [16, 256], or caches whose last dim is not contiguous.
    """
    if window is not None or sinks is not None:
        raise ValueError("this Triton decode kernel has no window or sinks yet; use attention='torch'")
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"expected q [B, Hq, D] and k_cache [P, S, Hkv, D], got "
                         f"{tuple(q.shape)} and {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    bsz, hq, d = q.shape
    _, page_size, hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"head_dim mismatch: q has {d}, caches have {dk}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"Hq={hq} is not a multiple of Hkv={hkv}")
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {d}")
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q/k_cache/v_cache must share one dtype among {_DTYPES}, got "
                         f"{q.dtype}/{k_cache.dtype}/{v_cache.dtype}")
    if page_table.dim() != 2 or page_table.shape[0] != bsz or seq_lens.shape != (bsz,):
        raise ValueError(f"expected page_table [{bsz}, max_pages] and seq_lens [{bsz}], got "
                         f"{tuple(page_table.shape)} and {tuple(seq_lens.shape)}")
    if page_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError(f"page_table and seq_lens must be int32, got {page_table.dtype} and {seq_lens.dtype}")
    devices = {t.device for t in (q, k_cache, v_cache, page_table, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous in the last (head_dim) dim")
    q = q if q.stride(-1) == 1 else q.contiguous()
    page_table = page_table.contiguous()
    seq_lens = seq_lens.contiguous()

    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [B, Hq, D]
    if bsz == 0 or hq == 0:
        return out
    group = hq // hkv
    block_n = max(16, min(triton.next_power_of_2(page_size), 64 if d <= 128 else 32))
    _paged_decode_kernel[(bsz, hkv)](
        q, k_cache, v_cache, page_table, seq_lens, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0),
        out.stride(0), out.stride(1),
        page_table.shape[1], scale * 1.4426950408889634,
        PAGE_SIZE=page_size, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d, BLOCK_N=block_n, DOT_F32=_INTERPRETED and q.dtype == torch.bfloat16,
    )
    return out
