"""How the Triton fused-MoE kernels read one tile of an expert weight, plain or quantized.

An expert weight is [N, out, in] over N slots (engine/quant/stack.py): a plain tensor, or a
linear in one of the published layouts, stored as its own parts.  The kernels never see a
dense copy of a quantized weight: `weight_tile` loads the tile's packed words, scales and
zeros and dequantizes them in registers, with the same element-wise arithmetic as the
format's torch codec (engine/quant/int_codecs.py, float_codecs.py), so the dequantized value
of every element equals the reference's bit for bit and only the matmul's summation order
differs.

    tile[c, r] = W[slot, rows[r], cols[c]]     rows: [BN] output rows, cols: [BK] input columns

A `TileSource` is the launcher's side: the four part tensors (unused ones repeat the first),
three strides per part (slot, then the part's two dims; a [N, d] part has a zero third) and
the format's constants, which are constexprs of the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.quant_consts import format_consts
from engine.quant.stack import ExpertWeight, JoinedRows, QuantStack

DENSE = tl.constexpr(0)
GPTQ = tl.constexpr(1)
AWQ = tl.constexpr(2)
CT_INT = tl.constexpr(3)
FP8_BLOCK = tl.constexpr(4)
CT_FP8 = tl.constexpr(5)
MXFP4 = tl.constexpr(6)
MX_BLOCK = tl.constexpr(32)
MX_SUBNORMAL = tl.constexpr(2.0 ** -127)       # an E8M0 exponent of 0 (float_codecs.Mxfp4)


@triton.jit
def _field(words: tl.tensor, index: tl.tensor, BITS: tl.constexpr) -> tl.tensor:
    """Value `index % (32 / BITS)` of each int32 word, unsigned (int_codecs.unpack)."""
    return (words >> ((index % (32 // BITS)) * BITS).to(tl.int32)) & ((1 << BITS) - 1)


@triton.jit
def _e2m1(code: tl.tensor) -> tl.tensor:
    """E2M1 code (0..15) -> fp32, exactly float_codecs.E2M1[code]."""
    m = code & 7
    e = m >> 1
    half = (m & 1).to(tl.float32) * 0.5
    mag = tl.where(e == 0, half, (1 << tl.maximum(e - 1, 0)).to(tl.float32) * (1.0 + half))
    return tl.where(code >= 8, -mag, mag)


# Each format's tile: fp32 [BK, BN] at output rows n [1, BN] and input columns k [BK, 1] of one
# slot, whose parts start at p0.. (the slot's offset added); `mask` [BK, BN] covers both edges.

@triton.jit
def _gptq(p0: tl.tensor, p1: tl.tensor, p2: tl.tensor, p3: tl.tensor, strides: tuple, n: tl.tensor,
          k: tl.tensor, mask: tl.tensor, col_mask: tl.tensor, BITS: tl.constexpr, GROUP: tl.constexpr,
          ZERO_ADD: tl.constexpr, DESC_ACT: tl.constexpr) -> tl.tensor:
    """qweight [in/p, out], qzeros [G, out/p] (v1: zero - 1), scales [G, out], g_idx [in]."""
    PER: tl.constexpr = 32 // BITS
    q = _field(tl.load(p0 + (k // PER) * strides[1] + n * strides[2], mask=mask, other=0), k, BITS)
    if DESC_ACT:
        g = tl.load(p3 + k * strides[10], mask=col_mask[:, None], other=0).to(tl.int64)
    else:                                       # column // group size, as the codec reads it then
        g = k // GROUP
    z = _field(tl.load(p1 + g * strides[4] + (n // PER) * strides[5], mask=mask, other=0), n, BITS) + ZERO_ADD
    s = tl.load(p2 + g * strides[7] + n * strides[8], mask=mask, other=0.0).to(tl.float32)
    return (q - z).to(tl.float32) * s


@triton.jit
def _awq(p0: tl.tensor, p1: tl.tensor, p2: tl.tensor, strides: tuple, n: tl.tensor, k: tl.tensor,
         mask: tl.tensor, GROUP: tl.constexpr) -> tl.tensor:
    """qweight [in, out/8], qzeros [G, out/8], both in AWQ's nibble order; scales [G, out]."""
    shift = (((n % 8) // 2 + (n % 2) * 4) * 4).to(tl.int32)   # column c sits in nibble AWQ_REVERSE[c]
    g = k // GROUP
    q = (tl.load(p0 + k * strides[1] + (n // 8) * strides[2], mask=mask, other=0) >> shift) & 15
    z = (tl.load(p1 + g * strides[4] + (n // 8) * strides[5], mask=mask, other=0) >> shift) & 15
    s = tl.load(p2 + g * strides[7] + n * strides[8], mask=mask, other=0.0).to(tl.float32)
    return (q - z).to(tl.float32) * s


@triton.jit
def _ct_int(p0: tl.tensor, p1: tl.tensor, p3: tl.tensor, strides: tuple, n: tl.tensor, k: tl.tensor,
            mask: tl.tensor, BITS: tl.constexpr, GROUP: tl.constexpr, SYM: tl.constexpr) -> tl.tensor:
    """weight_packed [out, ceil(in/p)] (q + 2^(b-1)), weight_scale [out, G], zero point [ceil(out/p), G]."""
    PER: tl.constexpr = 32 // BITS
    g = k // GROUP
    q = _field(tl.load(p0 + n * strides[1] + (k // PER) * strides[2], mask=mask, other=0), k, BITS)
    if SYM:
        z = 1 << (BITS - 1)
    else:
        z = _field(tl.load(p3 + (n // PER) * strides[10] + g * strides[11], mask=mask, other=0), n, BITS)
    s = tl.load(p1 + n * strides[4] + g * strides[5], mask=mask, other=0.0).to(tl.float32)
    return (q - z).to(tl.float32) * s


@triton.jit
def _fp8(p0: tl.tensor, p1: tl.tensor, strides: tuple, n: tl.tensor, k: tl.tensor, mask: tl.tensor,
         BLOCKED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr) -> tl.tensor:
    """weight e4m3 [out, in] times weight_scale_inv [out/BLOCK_R, in/BLOCK_C] (block FP8), or times
    weight_scale [out, 1] (channel) / [1] (tensor: a zero stride) for compressed-tensors FP8."""
    if BLOCKED:
        s = tl.load(p1 + (n // BLOCK_R) * strides[4] + (k // BLOCK_C) * strides[5], mask=mask, other=0.0)
    else:
        s = tl.load(p1 + n * strides[4], mask=mask, other=0.0)
    return tl.load(p0 + n * strides[1] + k * strides[2], mask=mask, other=0.0).to(tl.float32) * s.to(tl.float32)


@triton.jit
def _mxfp4(p0: tl.tensor, p1: tl.tensor, strides: tuple, n: tl.tensor, k: tl.tensor,
           mask: tl.tensor) -> tl.tensor:
    """blocks uint8 [out, in/2] (two E2M1 codes a byte, the even element low), scales uint8
    [out, in/32] (E8M0): E2M1[code] * 2^(scale - 127)."""
    byte = tl.load(p0 + n * strides[1] + (k // 2) * strides[2], mask=mask, other=0).to(tl.int32)
    code = (byte >> ((k % 2) * 4).to(tl.int32)) & 15
    e = tl.load(p1 + n * strides[4] + (k // MX_BLOCK) * strides[5], mask=mask, other=0).to(tl.int32)
    scale = tl.where(e == 0, MX_SUBNORMAL, (e << 23).to(tl.float32, bitcast=True))
    return _e2m1(code) * scale


@triton.jit
def weight_tile(parts: tuple, strides: tuple, slot: tl.tensor, rows: tl.tensor, cols: tl.tensor,
                row_mask: tl.tensor, col_mask: tl.tensor,
                FMT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, ZERO_ADD: tl.constexpr,
                DESC_ACT: tl.constexpr, SYM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                OUT_DTYPE: tl.constexpr) -> tl.tensor:
    """The [BK, BN] tile W[slot, rows, cols]ᵀ (see the module doc): a plain weight in its own
    dtype, a quantized one dequantized in fp32 and cast to OUT_DTYPE (as the codec's result is
    cast to the compute dtype); zero outside the masks.  FMT is a constexpr: one branch compiles."""
    mask = col_mask[:, None] & row_mask[None, :]
    n = rows[None, :].to(tl.int64)                                  # [1, BN] output row
    k = cols[:, None].to(tl.int64)                                  # [BK, 1] input column
    p0, p1 = parts[0] + slot * strides[0], parts[1] + slot * strides[3]
    p2, p3 = parts[2] + slot * strides[6], parts[3] + slot * strides[9]
    if FMT == DENSE:
        tile = tl.load(p0 + n * strides[1] + k * strides[2], mask=mask, other=0.0)
    else:
        if FMT == GPTQ:
            w = _gptq(p0, p1, p2, p3, strides, n, k, mask, col_mask, BITS, GROUP, ZERO_ADD, DESC_ACT)
        elif FMT == AWQ:
            w = _awq(p0, p1, p2, strides, n, k, mask, GROUP)
        elif FMT == CT_INT:
            w = _ct_int(p0, p1, p3, strides, n, k, mask, BITS, GROUP, SYM)
        elif FMT == FP8_BLOCK or FMT == CT_FP8:
            w = _fp8(p0, p1, strides, n, k, mask, FMT == FP8_BLOCK, BLOCK_R, BLOCK_C)
        else:
            w = _mxfp4(p0, p1, strides, n, k, mask)
        tile = tl.where(mask, w, 0.0).to(OUT_DTYPE)
    return tile


@dataclass(frozen=True)
class TileSource:
    """One expert weight as `weight_tile` reads it: its rows r of a call are rows
    `r * row_step + row_start` of the stored linear."""
    parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    strides: tuple[int, ...]          # 12: (slot, dim 1, dim 2) for each part
    consts: dict[str, int]            # the constexprs FMT .. BLOCK_C
    row_step: int = 1
    row_start: int = 0


def _dense_consts() -> dict[str, int]:
    return dict(FMT=0, BITS=32, GROUP=1, ZERO_ADD=0, DESC_ACT=0, SYM=1, BLOCK_R=1, BLOCK_C=1)


def _three(t: torch.Tensor) -> tuple[int, int, int]:
    """(slot, dim 1, dim 2) strides of a part: [N, a, b], [N, a] (no dim 2) or, for MXFP4's
    blocks [N, out, G, 16], [N, out, in/2] (its last two dims contiguous with each other).  A
    dim of size 1 reads as stride 0: one group, one scale row or a per-tensor scale broadcasts."""
    if t.dim() == 4:
        if t.shape[2] > 1 and t.stride(2) != t.shape[3] * t.stride(3):
            raise ValueError(f"MXFP4 blocks of strides {t.stride()} cannot be read as [N, out, in/2]")
        dims = [(t.shape[0], t.stride(0)), (t.shape[1], t.stride(1)), (2, t.stride(3))]
    else:
        dims = [(t.shape[d], t.stride(d)) if d < t.dim() else (1, 0) for d in range(3)]
    slot, a, b = (0 if size == 1 else stride for size, stride in dims)
    return slot, a, b


def _source(tensors: list[torch.Tensor], consts: dict[str, int], row_step: int = 1, row_start: int = 0
            ) -> TileSource:
    """Parts [N, ...] each, in the format's order (at most four; the unused repeat the first)."""
    padded = (tensors + [tensors[0]] * 4)[:4]
    strides = [_three(t) for t in padded]
    return TileSource(tuple(padded), tuple(s for three in strides for s in three),   # type: ignore[arg-type]
                      consts, row_step, row_start)


def _quant_source(w: QuantStack, row_step: int = 1, row_start: int = 0) -> TileSource:
    return _source(w.tensors(), format_consts(w.fmt, w.in_), row_step, row_start)


def source_of_parts(parts: list[torch.Tensor], consts: dict[str, int]) -> TileSource:
    """One dense linear's parts (no expert dim; engine/quant/dense.py's QuantLinear.tensors()) as
    the source of slot 0."""
    return _source([p.unsqueeze(0) for p in parts], consts)


def _plain_source(w: torch.Tensor, row_start: int = 0) -> TileSource:
    return TileSource((w, w, w, w), (*w.stride(), 0, 0, 0, 0, 0, 0, 0, 0, 0), _dense_consts(), 1, row_start)


def gate_up_sources(w13: ExpertWeight) -> tuple[TileSource, TileSource]:
    """The gate rows and the up rows of w13 [N, 2I, H] as two sources over the same act columns."""
    if isinstance(w13, torch.Tensor):
        return _plain_source(w13), _plain_source(w13, w13.shape[1] // 2)
    if isinstance(w13, JoinedRows) and w13.interleaved and isinstance(w13.linears[0], QuantStack):
        return _quant_source(w13.linears[0], 2, 0), _quant_source(w13.linears[0], 2, 1)
    if (isinstance(w13, JoinedRows) and len(w13.linears) == 2
            and all(isinstance(w, QuantStack) for w in w13.linears)):
        gate, up = w13.linears
        assert isinstance(gate, QuantStack) and isinstance(up, QuantStack)
        if gate.fmt != up.fmt or gate.out != up.out:
            raise ValueError(f"gate ({gate.describe()}, {gate.out} rows) and up ({up.describe()}, {up.out} rows) "
                             "must share a format and a size for the fused kernel")
        return _quant_source(gate), _quant_source(up)
    raise ValueError(f"the fused kernel reads w13 as a plain tensor, gate and up QuantStacks or one "
                     f"interleaved gate_up, not {type(w13).__name__}")


def down_source(w2: ExpertWeight) -> TileSource:
    """w2 [N, H, I] as a source."""
    if isinstance(w2, torch.Tensor):
        return _plain_source(w2)
    if isinstance(w2, QuantStack):
        return _quant_source(w2)
    raise ValueError(f"the fused kernel reads w2 as a plain tensor or a QuantStack, not {type(w2).__name__}")
