"""MoE experts over device slots: the torch reference (also the CPU path).

    x:        [T, H]        token activations
    w13:      [S, 2I, H]    per slot: gate_proj rows, then up_proj rows
    w2:       [S, H, I]     per slot: down_proj
    slot_ids: [T, k] int    the slot serving each (token, rank) pair; -1 = not in this call
    out:      [T*k, H]      row t*k + r receives down(silu(gate(x_t)) * up(x_t)) of slot
                            slot_ids[t, r]; rows of pairs with slot -1 are left untouched

Every slot's tokens are computed together in one GEMM, so a pair's result depends only
on its expert's weights and the set of tokens routed to that expert, never on which slot
holds the expert or on which other slots run in the same call (paged experts rely on
this for bit-exact results with any number of resident slots).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _selected_by_slot(slot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair indices (t*k + r) with a slot >= 0, and their slots, sorted stably by slot."""
    flat = slot_ids.reshape(-1)
    pairs = (flat >= 0).nonzero().squeeze(1)  # [P]
    slots = flat[pairs]
    order = slots.argsort(stable=True)
    return pairs[order], slots[order]


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, slot_ids: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    """Write each selected pair's expert output into `out` (see the module doc); returns `out`."""
    k = slot_ids.shape[1]
    pairs, slots = _selected_by_slot(slot_ids)
    if pairs.numel() == 0:
        return out
    counts = torch.bincount(slots, minlength=w13.shape[0]).tolist()
    xs = x.index_select(0, pairs // k)  # [P, H], grouped by slot
    start = 0
    for s, n in enumerate(counts):
        if n == 0:
            continue
        chunk = xs[start:start + n]
        gate, up = F.linear(chunk, w13[s]).chunk(2, dim=-1)
        out[pairs[start:start + n]] = F.linear(F.silu(gate) * up, w2[s])
        start += n
    return out


def gathered_all(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """Every pair selected (no -1): each pair is one item of a batched matmul over its slot's
    gathered weights.  x: [T, H]; slot_ids: [T, k].  Returns [T*k, H]."""
    flat = slot_ids.reshape(-1)
    xs = x.repeat_interleave(slot_ids.shape[1], 0).unsqueeze(-1)  # [T*k, H, 1]
    gate, up = torch.bmm(w13.index_select(0, flat), xs).squeeze(-1).chunk(2, dim=-1)  # [T*k, I]
    return torch.bmm(w2.index_select(0, flat), (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)


def moe_gathered(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, slot_ids: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
    """Same contract as `fused_moe_ref`, for a few pairs: each selected pair is one item of
    a batched matmul over its slot's gathered weights (no per-slot Python loop)."""
    k = slot_ids.shape[1]
    flat = slot_ids.reshape(-1)
    if bool((flat >= 0).all()):
        return out.copy_(gathered_all(x, w13, w2, slot_ids))
    pairs = (flat >= 0).nonzero().squeeze(1)  # [P]
    if pairs.numel() > 0:  # the selected pairs as one token each
        out[pairs] = gathered_all(x.index_select(0, pairs // k), w13, w2, flat[pairs].unsqueeze(1))
    return out


def moe_padded(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, slot_ids: torch.Tensor,
               out: torch.Tensor, cap: int) -> torch.Tensor:
    """Same contract as `fused_moe_ref`, for a batch of decodes: pairs grouped by slot into
    a zero-padded [S, cap, H] block, then two batched matmuls over all slots (no weight is
    copied).  `cap` must be at least the largest group; callers pass one value for a whole
    step so that every group's matmul has the same shape in every call."""
    k = slot_ids.shape[1]
    pairs, slots = _selected_by_slot(slot_ids)
    if pairs.numel() == 0:
        return out
    counts = torch.bincount(slots, minlength=w13.shape[0])  # [S]
    rank = torch.arange(pairs.numel(), device=x.device) - (counts.cumsum(0) - counts)[slots]
    grouped = x.new_zeros(w13.shape[0], cap, x.shape[1])  # [S, cap, H]
    grouped[slots, rank] = x.index_select(0, pairs // k)
    gate, up = torch.bmm(grouped, w13.transpose(1, 2)).chunk(2, dim=-1)  # [S, cap, I]
    y = torch.bmm(F.silu(gate) * up, w2.transpose(1, 2))  # [S, cap, H]
    out[pairs] = y[slots, rank]
    return out
