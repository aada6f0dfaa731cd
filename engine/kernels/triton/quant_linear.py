"""Triton linear over a quantized weight in its published parts: y = x @ W.T, W [out, in]
dequantized tile by tile in registers by `weight_tile` (engine/kernels/triton/weight_tiles.py),
the same arithmetic element by element as the format's torch codec.

One program per (BLOCK_M rows of x, BLOCK_N output columns), fp32 accumulation over the input in
BLOCK_K steps, the block sizes fixed by the dtype: a row's result never depends on how many rows
share the call (decode batches of any composition give each request the same bits).

`quant_linear_op` is the same launch as a custom op (`tandem::quant_linear`), so that a
torch.compile'd step (the CUDA-graph decode step) calls it as one opaque node.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.quant_consts import CONST_NAMES
from engine.kernels.triton.weight_tiles import TileSource, source_of_parts, weight_tile

BLOCK_M = 16
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _linear_kernel(
    x_ptr: tl.tensor, y_ptr: tl.tensor, w_parts: tuple, w_strides: tuple,
    stride_xm: tl.tensor, stride_xk: tl.tensor, stride_ym: tl.tensor, stride_yn: tl.tensor,
    M: tl.tensor, N: tl.tensor, K: tl.tensor,                              # x [M, K], W [N, K], y [M, N]
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
    FMT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, ZERO_ADD: tl.constexpr,
    DESC_ACT: tl.constexpr, SYM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
) -> None:
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                 # [BM] rows of x
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                 # [BN] output columns
    m_mask, n_mask = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm        # [BM, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < K
        a = tl.load(x_rows + kk[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = weight_tile(w_parts, w_strides, 0, offs_n, kk, n_mask, k_mask, FMT, BITS, GROUP, ZERO_ADD,
                        DESC_ACT, SYM, BLOCK_R, BLOCK_C, x_ptr.dtype.element_ty)       # [BK, BN]
        if DOT_F32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision="ieee")
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :] * stride_yn,
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# The interpreter multiplies the raw bits of bfloat16 tl.dot operands (see fused_moe.py).
_INTERPRETED = not isinstance(_linear_kernel, triton.runtime.jit.JITFunction)


def quant_linear(x: torch.Tensor, w: TileSource, out: int) -> torch.Tensor:
    """x [M, in] (fp32, fp16 or bf16) @ W.T for the quantized W [out, in] that `w` reads
    (`source_of_parts`), on x's device: [M, out] in x's dtype.  Raises ValueError on a wrong
    rank or dtype, or parts on another device."""
    if x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"expected x [M, in] in one of {_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    if any(p.device != x.device for p in w.parts):
        raise ValueError(f"the weight's parts are on {w.parts[0].device}, x on {x.device}")
    m, k = x.shape
    y = x.new_empty(m, out)
    if m == 0 or out == 0:
        return y
    bk, bn = (32 if x.dtype == torch.float32 else 64), 64
    _linear_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(out, bn))](
        x, y, w.parts, w.strides, x.stride(0), x.stride(1), y.stride(0), y.stride(1), m, out, k,
        BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, DOT_F32=_INTERPRETED and x.dtype == torch.bfloat16, **w.consts)
    return y


# registered at import (creating an op while dynamo traces is not traceable): engine/quant/dense.py
# calls it as torch.ops.tandem.quant_linear
@torch.library.custom_op("tandem::quant_linear", mutates_args=())
def quant_linear_op(x: torch.Tensor, parts: list[torch.Tensor], consts: list[int], out: int) -> torch.Tensor:
    """`quant_linear` over one linear's parts (its format's order) and its format constants
    (engine/kernels/quant_consts.py CONST_NAMES order)."""
    return quant_linear(x, source_of_parts(parts, dict(zip(CONST_NAMES, consts))), out)


@quant_linear_op.register_fake
def _(x: torch.Tensor, parts: list[torch.Tensor], consts: list[int], out: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out)
