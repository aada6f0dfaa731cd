"""MoE experts over device slots: the torch reference (also the CPU path).

    x:        [T, H]        token activations
    w13:      [S, 2I, H]    per slot: gate_proj rows, then up_proj rows
    w2:       [S, H, I]     per slot: down_proj
                            (each a plain tensor, or quantized expert weights that are
                            dequantized for the slots a call reads: engine/quant/stack.py)
    slot_ids: [T, k] int    the slot serving each (token, rank) pair; -1 = not in this call
    out:      [T*k, H]      row t*k + r receives down(silu(gate(x_t)) * up(x_t)) of slot
                            slot_ids[t, r]; rows of pairs with slot -1 are left untouched
    b13:      [S, 2I]       optional per-slot biases of gate then up (gpt-oss), added after
                            the matmul: gate(x) = x @ w13[:I].T + b13[:I]
    b2:       [S, H]        optional per-slot bias of down
    act:      None (silu(gate) * up) or a `ClampedSwiGLU` (gpt-oss)

Every slot's tokens are computed together in one GEMM, so a pair's result depends only
on its expert's weights and the set of tokens routed to that expert, never on which slot
holds the expert or on which other slots run in the same call (paged experts rely on
this for bit-exact results with any number of resident slots).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from engine.quant.stack import ExpertWeight, dense_all, dense_at, dense_rows, num_rows


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation (transformers' GptOssExperts._apply_gate):
    gate.clamp(max=limit), up.clamp(-limit, limit), (up + 1) * gate * sigmoid(alpha * gate)."""
    alpha: float = 1.702   # config swiglu_alpha
    limit: float = 7.0     # config swiglu_limit


# torch's CPU elementwise kernels run the body of a contiguous range in SIMD vectors and its
# tail element by element, and the two round sigmoid differently (measured: about 2% of lanes
# differ by an ulp).  The clamped SwiGLU therefore runs on rows padded to a multiple of this
# many elements (64: two AVX-512 vectors of fp32, of bf16 too), so that every element takes the
# vector body whatever the number of rows, and a pair's result does not depend on how many
# other pairs share the call (paged experts stay bit-identical to all-resident).
LANE_ALIGN = 64


def glu(gate: torch.Tensor, up: torch.Tensor, act: ClampedSwiGLU | None = None) -> torch.Tensor:
    """The gated activation fed to down_proj: silu(gate) * up, or `act`'s clamped SwiGLU."""
    if act is None:
        return F.silu(gate) * up
    width = gate.shape[-1]
    pad = -width % LANE_ALIGN
    if pad:
        gate, up = F.pad(gate, (0, pad)), F.pad(up, (0, pad))
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    out = (up + 1) * (gate * torch.sigmoid(gate * act.alpha))
    return out[..., :width] if pad else out


def _selected_by_slot(slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair indices (t*k + r) with a slot >= 0, and their slots, sorted stably by slot."""
    flat = slot_ids.reshape(-1)
    pairs = (flat >= 0).nonzero().squeeze(1)  # [P]
    slots = flat[pairs]
    order = slots.argsort(stable=True)
    return pairs[order], slots[order]


def fused_moe_ref(x: torch.Tensor, w13: ExpertWeight, w2: ExpertWeight, slot_ids: torch.Tensor,
                  out: torch.Tensor, *, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                  act: ClampedSwiGLU | None = None) -> torch.Tensor:
    """Write each selected pair's expert output into `out` (see the module doc); returns `out`."""
    k = slot_ids.shape[1]
    pairs, slots = _selected_by_slot(slot_ids)
    if pairs.numel() == 0:
        return out
    counts = torch.bincount(slots, minlength=num_rows(w13)).tolist()
    used = [s for s, n in enumerate(counts) if n]
    w13s, w2s = dense_rows(w13, used, x.dtype), dense_rows(w2, used, x.dtype)   # quantized: one dequantize
    xs = x.index_select(0, pairs // k)  # [P, H], grouped by slot
    start = 0
    for s, g13, g2 in zip(used, w13s, w2s):
        n = counts[s]
        chunk = xs[start:start + n]
        h13 = F.linear(chunk, g13)
        if b13 is not None:
            h13 = h13 + b13[s]
        gate, up = h13.chunk(2, dim=-1)
        y = F.linear(glu(gate, up, act), g2)
        out[pairs[start:start + n]] = y if b2 is None else y + b2[s]
        start += n
    return out


def gathered_all(x: torch.Tensor, w13: ExpertWeight, w2: ExpertWeight, slot_ids: torch.Tensor, *,
                 b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                 act: ClampedSwiGLU | None = None) -> torch.Tensor:
    """Every pair selected (no -1): each pair is one item of a batched matmul over its slot's
    gathered weights.  x: [T, H]; slot_ids: [T, k].  Returns [T*k, H]."""
    flat = slot_ids.reshape(-1)
    xs = x.repeat_interleave(slot_ids.shape[1], 0).unsqueeze(-1)  # [T*k, H, 1]
    h13 = torch.bmm(dense_at(w13, flat, x.dtype), xs).squeeze(-1)  # [T*k, 2I]
    if b13 is not None:
        h13 = h13 + b13.index_select(0, flat)
    gate, up = h13.chunk(2, dim=-1)  # [T*k, I]
    y = torch.bmm(dense_at(w2, flat, x.dtype), glu(gate, up, act).unsqueeze(-1)).squeeze(-1)
    return y if b2 is None else y + b2.index_select(0, flat)


def moe_gathered(x: torch.Tensor, w13: ExpertWeight, w2: ExpertWeight, slot_ids: torch.Tensor,
                 out: torch.Tensor, *, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                 act: ClampedSwiGLU | None = None, kernel: Callable[..., torch.Tensor] | None = None
                 ) -> torch.Tensor:
    """Same contract as `fused_moe_ref`, for a few pairs: each selected pair is one item of
    a batched matmul over its slot's gathered weights (no per-slot Python loop).  `kernel`:
    what computes every pair (default `gathered_all`; a compiled step passes its compiled one).

    Every call runs the batched matmul over all T*k pairs (pairs outside the call through slot
    0, their rows discarded): a BLAS may sum differently for another batch count (seen at
    H=64, I=32: 1e-6 apart), so a wave of paged experts must see the same shapes as the
    all-resident step to stay bit-identical to it."""
    kernel = kernel or gathered_all
    flat = slot_ids.reshape(-1)
    if bool((flat >= 0).all()):
        return out.copy_(kernel(x, w13, w2, slot_ids, b13=b13, b2=b2, act=act))
    pairs = (flat >= 0).nonzero().squeeze(1)  # [P]
    if pairs.numel() > 0:
        out[pairs] = kernel(x, w13, w2, slot_ids.clamp(min=0), b13=b13, b2=b2, act=act)[pairs]
    return out


def moe_padded(x: torch.Tensor, w13: ExpertWeight, w2: ExpertWeight, slot_ids: torch.Tensor,
               out: torch.Tensor, cap: int, *, b13: torch.Tensor | None = None,
               b2: torch.Tensor | None = None, act: ClampedSwiGLU | None = None) -> torch.Tensor:
    """Same contract as `fused_moe_ref`, for a batch of decodes: pairs grouped by slot into
    a zero-padded [S, cap, H] block, then two batched matmuls over all slots (no weight is
    copied).  `cap` must be at least the largest group; callers pass one value for a whole
    step so that every group's matmul has the same shape in every call."""
    k = slot_ids.shape[1]
    pairs, slots = _selected_by_slot(slot_ids)
    if pairs.numel() == 0:
        return out
    s = num_rows(w13)
    counts = torch.bincount(slots, minlength=s)  # [S]
    rank = torch.arange(pairs.numel(), device=x.device) - (counts.cumsum(0) - counts)[slots]
    grouped = x.new_zeros(s, cap, x.shape[1])  # [S, cap, H]
    grouped[slots, rank] = x.index_select(0, pairs // k)
    h13 = torch.bmm(grouped, dense_all(w13, x.dtype).transpose(1, 2))  # [S, cap, 2I]
    if b13 is not None:
        h13 = h13 + b13.unsqueeze(1)
    gate, up = h13.chunk(2, dim=-1)  # [S, cap, I]
    y = torch.bmm(glu(gate, up, act), dense_all(w2, x.dtype).transpose(1, 2))  # [S, cap, H]
    if b2 is not None:
        y = y + b2.unsqueeze(1)
    out[pairs] = y[slots, rank]
    return out
