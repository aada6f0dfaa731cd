"""The MoE layer's math around the experts: top-k routing, the choice of expert
computation for a step, and the weighted combination.

Expert weights are stacked per layer:
    w13: [E, 2*I, H]  gate_proj rows first, then up_proj rows
    w2:  [E, H, I]    down_proj
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.kernels.fused_moe import fused_moe_ref, gathered_all, moe_gathered, moe_padded

# How a step's (token, expert) pairs are computed on the CPU path, by their number
# (measured with experts of the shipped model's size): up to GATHER_MAX_PAIRS, gather
# each pair's weights (single-stream decode); up to PADDED_MAX_PAIRS, one batched
# matmul over all slots with tokens grouped and padded (batched decode); beyond, one
# GEMM per used expert (prefill).
GATHER_MAX_PAIRS = 8
PADDED_MAX_PAIRS = 1024


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router in fp32, top-k, optional renormalisation.

    x: [T, H]; router: [E, H].  Returns (weights [T, k] in x's dtype, ids [T, k] int64).
    """
    probs = F.softmax(F.linear(x, router), dim=-1, dtype=torch.float)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if x.dtype == torch.float32 else weights.to(x.dtype)), ids


def combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over the k experts of each token. y: [T, k, H] -> [T, H]."""
    return torch.bmm(weights.unsqueeze(1), y).squeeze(1)


@dataclass(frozen=True)
class StepPlan:
    """How every call of one step computes its pairs: fixed for the whole step, so a pair's
    result does not depend on how the step is split into waves."""
    strategy: str   # "gathered" | "padded" | "grouped" (CPU) | "triton" (CUDA)
    cap: int        # largest number of pairs routed to one expert in the step

    @classmethod
    def for_step(cls, ids: torch.Tensor, num_experts: int, triton: bool = False) -> "StepPlan":
        if triton:
            return cls("triton", 0)
        pairs = ids.numel()
        strategy = "gathered" if pairs <= GATHER_MAX_PAIRS else \
            "padded" if pairs <= PADDED_MAX_PAIRS else "grouped"
        cap = int(torch.bincount(ids.reshape(-1), minlength=num_experts).max()) if strategy == "padded" else 0
        return cls(strategy, cap)


def expert_outputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, slot_ids: torch.Tensor,
                   out: torch.Tensor, plan: StepPlan) -> torch.Tensor:
    """Compute the pairs whose slot id is >= 0 into out [T*k, H] (see engine/kernels/fused_moe.py)."""
    if plan.strategy == "gathered":
        return moe_gathered(x, w13, w2, slot_ids, out)
    if plan.strategy == "padded":
        return moe_padded(x, w13, w2, slot_ids, out, plan.cap)
    if plan.strategy == "triton":
        from engine.kernels.triton.fused_moe import fused_moe
        return fused_moe(x, w13, w2, slot_ids, out)
    return fused_moe_ref(x, w13, w2, slot_ids, out)


def select_moe_kernel(device: torch.device | str) -> bool:
    """Whether the Triton fused-MoE kernel runs the experts (CUDA), chosen once at start-up.

    On CUDA the kernel is compiled now and compared with the reference on a small input;
    raises RuntimeError when they differ."""
    if torch.device(device).type != "cuda":
        return False
    from engine.kernels.triton.fused_moe import fused_moe
    gen = torch.Generator().manual_seed(0)
    x, w13, w2 = (torch.randn(*s, generator=gen).to(device) for s in ((5, 64), (4, 64, 64), (4, 64, 32)))
    ids = torch.tensor([[0, 1], [1, 2], [3, -1], [0, 3], [2, 2]], device=device)
    got = fused_moe(x, w13, w2, ids, torch.zeros(10, 64, device=device))
    want = fused_moe_ref(x, w13, w2, ids, torch.zeros(10, 64, device=device))
    err = (got - want).abs().max().item()
    if not err < 1e-3:
        raise RuntimeError(f"Triton fused MoE differs from the reference by {err} at start-up")
    return True


class Experts(Protocol):
    """One MoE layer's experts, as the model calls them (resident, or paged)."""

    def __call__(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; ids: [T, k] expert ids.  Returns y: [T, k, H] (unweighted)."""
        ...


class ResidentExperts:
    """All E experts of one layer on the device; the expert id is the slot id."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, triton: bool = False) -> None:
        self.w13, self.w2 = w13, w2  # [E, 2I, H], [E, H, I]
        self.triton = triton

    def __call__(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; ids: [T, k] expert ids.  Returns y: [T, k, H] (unweighted)."""
        t, k = ids.shape
        plan = StepPlan.for_step(ids, self.w13.shape[0], self.triton)
        if plan.strategy == "gathered":  # every pair is selected: no output buffer needed
            return gathered_all(x, self.w13, self.w2, ids).view(t, k, -1)
        out = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
        expert_outputs(x, self.w13, self.w2, ids, out, plan)
        return out.view(t, k, -1)
