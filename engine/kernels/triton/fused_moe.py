"""Triton fused MoE over expert slots: same semantics as
`engine.kernels.fused_moe.fused_moe_ref` (shapes and contract documented there).

The host sorts the selected (token, rank) pairs by slot and pads each slot's group to a
multiple of BLOCK_M (vLLM's "moe_align_block_size"), on the device and without a sync.
Two grouped GEMMs then run one program per (block of BLOCK_M pairs of one slot, column
tile): gate/up = x @ w13[slot].T with act = silu(gate) * up into an intermediate in x's
dtype, then out = act @ w2[slot].T. Accumulation is fp32. With biases (gpt-oss) the slot's b13
is added to gate/up and its b2 to out in fp32 before the store; the clamped-SwiGLU variant
computes act = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
(constexpr branches: the plain silu kernel is unchanged). Quantized experts are read in their
published parts and dequantized tile by tile in the kernel (engine/kernels/triton/weight_tiles.py):
no dense copy of a slot's weight is made. The block sizes depend only on
the dtype, never on T, k, S or the routing, and every row of a tile is computed
independently, so a pair's result depends only on its token and its expert's weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.fused_moe import ClampedSwiGLU
from engine.kernels.triton.weight_tiles import down_source, gate_up_sources, weight_tile
from engine.quant.stack import ExpertWeight, tensors_of, weight_format

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
BLOCK_M = 16


# Kernel parameters are annotated with their in-kernel types, tl.tensor (pointers and runtime
# scalars) or tl.constexpr, never `int`/`float`/`bool`: Triton reads those as forced i32/fp32/u1
# argument types (no 64-bit strides, no specialisation of integers equal to 1).  A weight's parts
# and strides are tuples (`tuple`, which Triton reads as no type: each element is specialised).
@triton.jit
def _gate_up_kernel(
    x_ptr: tl.tensor, act_ptr: tl.tensor, ids_ptr: tl.tensor, bslot_ptr: tl.tensor,
    g_parts: tuple, g_strides: tuple, g_step: tl.tensor, g_start: tl.tensor,            # w13's gate rows (weight_tiles)
    u_parts: tuple, u_strides: tuple, u_step: tl.tensor, u_start: tl.tensor,            # w13's up rows
    b_ptr: tl.tensor,                                                     # b13: [S, 2I] when HAS_BIAS
    stride_xt: tl.tensor, stride_xh: tl.tensor,                           # x:   [T, H]
    stride_am: tl.tensor, stride_an: tl.tensor,                           # act: [num_blocks * BLOCK_M, I]
    stride_bs: tl.tensor, stride_bn: tl.tensor,                           # b13
    num_pairs: tl.tensor, K: tl.tensor, H: tl.tensor, INTER: tl.tensor,   # INTER: I in the shapes
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
    HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    FMT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, ZERO_ADD: tl.constexpr,
    DESC_ACT: tl.constexpr, SYM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
) -> None:
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(bslot_ptr + pid_m).to(tl.int64)
    if slot < 0:                                # block past the last used one
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                 # [BM] padded row
    pair = tl.load(ids_ptr + offs_m)                                 # [BM] sentinel = num_pairs
    m_mask = pair < num_pairs
    tok = tl.where(m_mask, pair // K, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                 # [BN] column of act
    n_mask = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tok[:, None] * stride_xt                        # [BM, 1]
    g_rows = offs_n * g_step + g_start                               # [BN] gate rows of the linear
    u_rows = offs_n * u_step + u_start                               # [BN] up rows
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < H
        a = tl.load(x_rows + kk[None, :] * stride_xh,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)   # [BM, BK]
        g = weight_tile(g_parts, g_strides, slot, g_rows, kk, n_mask, k_mask, FMT, BITS, GROUP, ZERO_ADD,
                        DESC_ACT, SYM, BLOCK_R, BLOCK_C, x_ptr.dtype.element_ty)      # [BK, BN]
        u = weight_tile(u_parts, u_strides, slot, u_rows, kk, n_mask, k_mask, FMT, BITS, GROUP, ZERO_ADD,
                        DESC_ACT, SYM, BLOCK_R, BLOCK_C, x_ptr.dtype.element_ty)      # [BK, BN]
        if DOT_F32:
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_g = tl.dot(a, g, acc_g, input_precision="ieee")
        acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
    if HAS_BIAS:
        b_row = b_ptr + slot * stride_bs
        acc_g += tl.load(b_row + offs_n * stride_bn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_row + (offs_n + INTER) * stride_bn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if CLAMPED:                                                      # gpt-oss clamped SwiGLU, fp32
        g = tl.minimum(acc_g, LIMIT)
        u = tl.minimum(tl.maximum(acc_u, -LIMIT), LIMIT)
        act = (u + 1.0) * (g / (1.0 + tl.exp(-(g * ALPHA))))
    else:
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u                 # silu(gate) * up, fp32
    tl.store(act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_n[None, :] * stride_an,
             act.to(act_ptr.dtype.element_ty), mask=n_mask[None, :])


@triton.jit
def _down_kernel(
    act_ptr: tl.tensor, out_ptr: tl.tensor, ids_ptr: tl.tensor, bslot_ptr: tl.tensor,
    w_parts: tuple, w_strides: tuple,                                     # w2 [S, H, I] (weight_tiles)
    b_ptr: tl.tensor,                                                     # b2: [S, H] when HAS_BIAS
    stride_am: tl.tensor, stride_an: tl.tensor,                           # act: [num_blocks * BLOCK_M, I]
    stride_om: tl.tensor, stride_oh: tl.tensor,                           # out: [T*k, H]
    stride_bs: tl.tensor, stride_bn: tl.tensor,                           # b2
    num_pairs: tl.tensor, H: tl.tensor, INTER: tl.tensor,                 # INTER: I in the shapes
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FMT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, ZERO_ADD: tl.constexpr,
    DESC_ACT: tl.constexpr, SYM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
) -> None:
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(bslot_ptr + pid_m).to(tl.int64)
    if slot < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                 # [BM] padded row
    pair = tl.load(ids_ptr + offs_m)                                 # [BM]
    m_mask = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                 # [BN] column of out
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = act_ptr + offs_m[:, None].to(tl.int64) * stride_am      # [BM, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < INTER
        a = tl.load(a_rows + kk[None, :] * stride_an, mask=k_mask[None, :], other=0.0)  # [BM, BK]
        w = weight_tile(w_parts, w_strides, slot, offs_n, kk, n_mask, k_mask, FMT, BITS, GROUP, ZERO_ADD,
                        DESC_ACT, SYM, BLOCK_R, BLOCK_C, act_ptr.dtype.element_ty)    # [BK, BN]
        if DOT_F32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + slot * stride_bs + offs_n * stride_bn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    o_rows = tl.where(m_mask, pair, 0).to(tl.int64)
    tl.store(out_ptr + o_rows[:, None] * stride_om + offs_n[None, :] * stride_oh,
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# The interpreter (TRITON_INTERPRET=1, read when the kernel is decorated) multiplies the raw
# bits of bfloat16 tl.dot operands (triton-lang/triton#11584): upcast them to fp32 there.
_INTERPRETED = not isinstance(_gate_up_kernel, triton.runtime.jit.JITFunction)


def align_block_size(slot_ids: torch.Tensor, num_slots: int, block_m: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the pairs (t*k + r) with slot >= 0 by slot (stably) and pad each slot's group
    to a multiple of block_m, on slot_ids' device without a host sync.

    Returns (sorted_ids [num_blocks * block_m] int32, padding = T*k; block_slot
    [num_blocks] int32, the slot of each block, -1 past the last used block), where
    num_blocks = ceil(T*k / block_m) + min(S, T*k) bounds the blocks any routing needs.
    """
    flat = slot_ids.reshape(-1).long()                               # [P] pair -> slot
    num_pairs, dev = flat.numel(), flat.device
    key = torch.where(flat >= 0, flat, num_slots)                    # -1 sorts last
    order = key.argsort(stable=True)                                 # [P] pairs by slot
    counts = torch.bincount(key, minlength=num_slots + 1)[:num_slots]  # [S]
    blocks = (counts + block_m - 1) // block_m                       # [S] blocks per slot
    blk_end = blocks.cumsum(0)                                       # [S]
    num_blocks = -(-num_pairs // block_m) + min(num_slots, num_pairs)
    b = torch.arange(num_blocks, device=dev)
    bslot = torch.searchsorted(blk_end, b, right=True)               # [NB], S = unused
    bslot_c = bslot.clamp(max=num_slots - 1)
    row = torch.arange(num_blocks * block_m, device=dev)             # [NB*BM] padded row
    s = bslot_c.repeat_interleave(block_m)                           # [NB*BM]
    local = row - (blk_end - blocks)[s] * block_m                    # row within its slot
    valid = (bslot.repeat_interleave(block_m) < num_slots) & (local < counts[s])
    src = ((counts.cumsum(0) - counts)[s] + local).clamp(max=max(num_pairs - 1, 0))
    sorted_ids = torch.where(valid, order[src], num_pairs).to(torch.int32)
    block_slot = torch.where(bslot < num_slots, bslot, -1).to(torch.int32)
    return sorted_ids, block_slot


def fused_moe(x: torch.Tensor, w13: ExpertWeight, w2: ExpertWeight, slot_ids: torch.Tensor,
              out: torch.Tensor, *, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
              act: ClampedSwiGLU | None = None) -> torch.Tensor:
    """Write down(silu(gate(x_t)) * up(x_t)) of slot slot_ids[t, r] into out[t*k + r]
    (with `act`: its clamped SwiGLU; with b13 [S, 2I] / b2 [S, H]: the slot's biases added).

    x: [T, H]; w13: [S, 2I, H]; w2: [S, H, I] (plain tensors in x's dtype, or quantized expert
    weights of one format: engine/quant/stack.py); out: [T*k, H] in x's dtype (fp32, fp16 or
    bf16), all on one device; slot_ids: [T, k] integer, values in -1..S-1 (-1: pair skipped).
    Returns `out`. Changes only the rows of `out` whose pair has a slot >= 0.
    Raises ValueError on a wrong rank, shape, dtype, format or device, or a slot id outside -1..S-1.
    """
    _check(x, w13, w2, slot_ids, out, b13, b2)
    t, h = x.shape
    s, i2, _ = w13.shape
    i, k = i2 // 2, slot_ids.shape[1]
    if slot_ids.numel() == 0:
        return out
    lo, hi = (int(v) for v in torch.aminmax(slot_ids))               # one host sync
    if lo < -1 or hi >= s:
        raise ValueError(f"slot_ids must lie in -1..{s - 1}, got values in {lo}..{hi}")
    if hi < 0 or h == 0:
        return out

    sorted_ids, block_slot = align_block_size(slot_ids, s, BLOCK_M)
    num_blocks = block_slot.numel()
    hidden = x.new_empty(num_blocks * BLOCK_M, i)                    # [NB*BM, I] activations
    dot_f32 = _INTERPRETED and x.dtype == torch.bfloat16
    bk = 32 if x.dtype == torch.float32 else 64
    bn = 64
    has_bias = b13 is not None
    bias13 = b13 if b13 is not None else x.new_empty(1, 1)   # not read without biases
    bias2 = b2 if b2 is not None else x.new_empty(1, 1)
    alpha, limit = (act.alpha, act.limit) if act is not None else (1.0, 0.0)
    gate, up = gate_up_sources(w13)
    down = down_source(w2)
    if i > 0:
        _gate_up_kernel[(num_blocks, triton.cdiv(i, bn))](
            x, hidden, sorted_ids, block_slot,
            gate.parts, gate.strides, gate.row_step, gate.row_start,
            up.parts, up.strides, up.row_step, up.row_start, bias13,
            x.stride(0), x.stride(1), hidden.stride(0), hidden.stride(1),
            bias13.stride(0), bias13.stride(1), t * k, k, h, i,
            BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, DOT_F32=dot_f32,
            HAS_BIAS=has_bias, CLAMPED=act is not None, ALPHA=float(alpha), LIMIT=float(limit), **gate.consts)
    _down_kernel[(num_blocks, triton.cdiv(h, bn))](
        hidden, out, sorted_ids, block_slot, down.parts, down.strides, bias2,
        hidden.stride(0), hidden.stride(1), out.stride(0), out.stride(1),
        bias2.stride(0), bias2.stride(1), t * k, h, i,
        BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, DOT_F32=dot_f32, HAS_BIAS=has_bias, **down.consts)
    return out


def _check(x: torch.Tensor, w13: ExpertWeight, w2: ExpertWeight, slot_ids: torch.Tensor, out: torch.Tensor,
           b13: torch.Tensor | None, b2: torch.Tensor | None) -> None:
    """fused_moe's argument checks (see its docstring); raises ValueError naming what is wrong."""
    if x.dim() != 2 or len(w13.shape) != 3 or len(w2.shape) != 3 or slot_ids.dim() != 2 or out.dim() != 2:
        raise ValueError(f"expected x [T, H], w13 [S, 2I, H], w2 [S, H, I], slot_ids [T, k], "
                         f"out [T*k, H], got {tuple(x.shape)}, {tuple(w13.shape)}, "
                         f"{tuple(w2.shape)}, {tuple(slot_ids.shape)}, {tuple(out.shape)}")
    t, h = x.shape
    s, i2, _ = w13.shape
    i = i2 // 2
    k = slot_ids.shape[1]
    if i2 % 2 or w13.shape[2] != h:
        raise ValueError(f"w13 shape {tuple(w13.shape)} is not [S, 2I, H={h}]")
    if tuple(w2.shape) != (s, h, i):
        raise ValueError(f"w2 shape {tuple(w2.shape)} != [S, H, I] = {(s, h, i)}")
    if slot_ids.shape[0] != t or out.shape != (t * k, h):
        raise ValueError(f"expected slot_ids [{t}, k] and out [T*k, {h}], got "
                         f"{tuple(slot_ids.shape)} and {tuple(out.shape)}")
    if (b13 is None) != (b2 is None):
        raise ValueError("pass both expert biases b13 and b2, or neither")
    biases = [b for b in (b13, b2) if b is not None]
    if b13 is not None and b2 is not None and (b13.shape != (s, i2) or b2.shape != (s, h)):
        raise ValueError(f"expected biases b13 [S, 2I] = {(s, i2)} and b2 [S, H] = {(s, h)}, got "
                         f"{tuple(b13.shape)} and {tuple(b2.shape)}")
    plain = [w for w in (w13, w2) if isinstance(w, torch.Tensor)]
    if x.dtype not in _DTYPES or any(v.dtype != x.dtype for v in (*plain, out, *biases)):
        raise ValueError(f"x/out, plain w13/w2 and biases must share one dtype among {_DTYPES}, got "
                         f"x {x.dtype}, out {out.dtype}, w13 {weight_format(w13)}, w2 {weight_format(w2)}"
                         + "".join(f", bias {b.dtype}" for b in biases))
    if len(plain) == 1:
        raise ValueError(f"w13 ({weight_format(w13)}) and w2 ({weight_format(w2)}) must both be plain "
                         "or both quantized")
    if slot_ids.dtype not in _INT_DTYPES:
        raise ValueError(f"slot_ids must be a signed integer tensor, got {slot_ids.dtype}")
    devices = {v.device for v in (x, *tensors_of(w13), *tensors_of(w2), slot_ids, out, *biases)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")

