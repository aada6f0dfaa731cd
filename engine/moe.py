"""The MoE layer's math around the experts: top-k routing, the choice of expert
computation for a step, and the weighted combination.

Expert weights are stacked per layer:
    w13: [E, 2*I, H]  gate_proj rows first, then up_proj rows
    w2:  [E, H, I]    down_proj
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from engine.kernels.fused_moe import ClampedSwiGLU, fused_moe_ref, gathered_all, moe_gathered, moe_padded
from engine.quant.stack import ExpertWeight, JoinedRows, QuantStack, num_rows

if TYPE_CHECKING:
    from engine.quant.formats import LinearFormat

# How a step's (token, expert) pairs are computed on the CPU path (`StepPlan.for_step`): the
# path with the lowest predicted cost, from a cost model fixed in code (never re-timed, so every
# process picks the same path for the same routing):
#   "gathered" (always up to GATHER_MAX_PAIRS, never beyond): each pair's weights gathered, one
#       batched matmul; cost ~ the number of pairs (single-stream decode).
#   "padded": pairs grouped by expert into a zero-padded [num_experts, cap, H] block (cap = the
#       most pairs routed to one expert), two batched matmuls over all experts; cost ~ the
#       padded rows num_experts * cap, which routing decides, not the number of pairs.
#   "grouped": one GEMM per used expert; cost ~ the number of used experts (a Python loop).
# Before issue 17 the choice was by the number of pairs alone (padded up to 1,024): a prefill of
# ordinary text routes many tokens to a few experts (cap ~ T/2), so a 256-token prompt
# (1,024 pairs) ran 64 x 209 padded rows, 17.6 ms a layer against 2.0 ms grouped, and took
# longer than a 257-token one.
# The coefficients (microseconds) are least-squares fits to 251 timed MoE calls: the real inputs
# of all six MoE layers of the shipped model (64 experts, H=128, I=64, top-4; fp32, 2 CPU
# threads) for prompts of 8-384 tokens of code text and of random token ids and for batches of
# 3-64 decoding requests, each path timed on the same input (median of 11 calls); gathered fits
# 87 + 11.7 per pair.  Choosing by
# this model costs 1.6% more than the per-call fastest path over that set (the old rule: far
# more, up to 8x a layer).  The gathered path would pay up to ~32 pairs (32 pairs: 420-496
# gathered, 650-850 padded, 380-920 grouped) but stays at 8: computed in waves over paged
# expert slots, its result for more pairs is not bit-identical to all-resident (with it at 32,
# tests/test_paged_experts.py fails at K=4 on a 3-request decode step, 12 pairs).
GATHER_MAX_PAIRS = 8
PADDED_COST = (584.0, 0.364, 0.134)     # + per padded row (num_experts * cap), + per pair
GROUPED_COST = (70.0, 40.7, 0.692)      # + per used expert, + per pair


def choose_strategy(pairs: int, cap: int, used: int, num_experts: int) -> str:
    """The CPU path with the lowest predicted cost for a step of `pairs` (token, expert) pairs,
    at most `cap` to one expert, `used` experts of `num_experts` (see the cost model above)."""
    if pairs <= GATHER_MAX_PAIRS:  # the cheapest there in every measurement
        return "gathered"
    padded = PADDED_COST[0] + PADDED_COST[1] * num_experts * cap + PADDED_COST[2] * pairs
    grouped = GROUPED_COST[0] + GROUPED_COST[1] * used + GROUPED_COST[2] * pairs
    return "padded" if padded <= grouped else "grouped"


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


class Router(Protocol):
    """A MoE layer's choice of experts: h [T, H] -> (weights [T, k] in h's dtype, ids [T, k] int64)."""

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def _in(dtype: torch.dtype, weights: torch.Tensor) -> torch.Tensor:
    return weights if dtype == torch.float32 else weights.to(dtype)


class SoftmaxRouter:
    """Qwen-MoE, Mixtral (norm_topk_prob=True): softmax over every expert, top-k."""

    def __init__(self, weight: torch.Tensor, top_k: int, norm_topk_prob: bool) -> None:
        self.weight, self.top_k, self.norm = weight, top_k, norm_topk_prob  # weight [E, H]

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(h, self.weight, self.top_k, self.norm)


class GroupedSigmoidRouter:
    """GLM-4.5 and DeepSeek-V3: sigmoid scores in fp32; the choice adds a per-expert correction
    bias and is limited to the `topk_group` groups (of `n_group`) whose two best biased scores
    sum highest; the weights are the unbiased scores of the chosen experts, renormalised when
    `norm` and multiplied by `scale` (routed_scaling_factor)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                 topk_group: int, norm: bool, scale: float) -> None:
        e = weight.shape[0]
        if n_group < 1 or e % n_group or e // n_group < 2 or not 1 <= topk_group <= n_group:
            raise ValueError(f"n_group={n_group}, topk_group={topk_group} do not fit {e} experts "
                             "(groups of at least two experts, 1 <= topk_group <= n_group)")
        if top_k > topk_group * (e // n_group):
            raise ValueError(f"top_k={top_k} exceeds the {topk_group * (e // n_group)} experts of "
                             f"topk_group={topk_group} groups")
        self.weight, self.bias = weight.float(), bias.float()  # [E, H], [E]
        self.top_k, self.n_group, self.topk_group, self.norm, self.scale = top_k, n_group, topk_group, norm, scale

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t, e = h.shape[0], self.weight.shape[0]
        scores = F.linear(h.float(), self.weight).sigmoid()  # [T, E]
        biased = scores + self.bias
        groups = biased.view(t, self.n_group, e // self.n_group)
        best = groups.topk(2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
        chosen = torch.topk(best, self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, chosen, True)
        biased = biased.masked_fill(~keep.repeat_interleave(e // self.n_group, dim=1), float("-inf"))
        ids = torch.topk(biased, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return _in(h.dtype, weights * self.scale), ids


class LogitTopkRouter:
    """gpt-oss: top-k of the router's logits (with its bias), softmax over those k."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, top_k: int) -> None:
        self.weight, self.bias, self.top_k = weight, bias, top_k  # [E, H], [E]

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, ids = torch.topk(F.linear(h, self.weight, self.bias), self.top_k, dim=-1)
        return F.softmax(values, dim=1, dtype=values.dtype), ids


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
        # a compiled step (engine/compiled): one graph for every routing, with no host
        # synchronisation (the Triton kernel reads its slot range on the host)
        if torch.compiler.is_compiling():
            return cls("gathered", 0)
        if triton:
            return cls("triton", 0)
        if ids.numel() <= GATHER_MAX_PAIRS:     # single-stream decode: no counting on its hot path
            return cls("gathered", 0)
        counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
        cap, used = int(counts.max()), int((counts > 0).sum())
        strategy = choose_strategy(ids.numel(), cap, used, num_experts)
        return cls(strategy, cap if strategy == "padded" else 0)


def expert_outputs(x: torch.Tensor, w13: ExpertWeight, w2: ExpertWeight, slot_ids: torch.Tensor,
                   out: torch.Tensor, plan: StepPlan, *, b13: torch.Tensor | None = None,
                   b2: torch.Tensor | None = None, act: ClampedSwiGLU | None = None) -> torch.Tensor:
    """Compute the pairs whose slot id is >= 0 into out [T*k, H] (see engine/kernels/fused_moe.py;
    b13 [S, 2I] / b2 [S, H]: optional per-slot biases, act: the gated activation)."""
    if plan.strategy == "gathered":
        return moe_gathered(x, w13, w2, slot_ids, out, b13=b13, b2=b2, act=act)
    if plan.strategy == "padded":
        return moe_padded(x, w13, w2, slot_ids, out, plan.cap, b13=b13, b2=b2, act=act)
    if plan.strategy == "triton":   # quantized experts are dequantized tile by tile inside the kernel
        from engine.kernels.triton.fused_moe import fused_moe
        return fused_moe(x, w13, w2, slot_ids, out, b13=b13, b2=b2, act=act)
    return fused_moe_ref(x, w13, w2, slot_ids, out, b13=b13, b2=b2, act=act)


def select_moe_kernel(device: torch.device | str, clamped: bool = True,
                      expert_format: LinearFormat | None = None) -> bool:
    """Whether the Triton fused-MoE kernel runs the experts (CUDA), chosen once at start-up.

    On CUDA the kernel is compiled now (silu without biases; with `clamped`, also the biased
    clamped SwiGLU of gpt-oss; with `expert_format`, over experts quantized in that layout, its
    group size fitted to the check's small shapes) and compared with the reference on a small
    input; raises RuntimeError when they differ."""
    if torch.device(device).type != "cuda":
        return False
    check_moe_kernel(device, clamped, expert_format)
    return True


def check_moe_kernel(device: torch.device | str, clamped: bool = True,
                     expert_format: LinearFormat | None = None) -> None:
    """`select_moe_kernel`'s comparison of the Triton kernel with the reference, on any device
    (a CPU runs it under TRITON_INTERPRET=1).  Raises RuntimeError when they differ."""
    from engine.kernels.triton.fused_moe import fused_moe
    gen = torch.Generator().manual_seed(0)
    x, w13, w2, b13, b2 = (torch.randn(*s, generator=gen).to(device)
                           for s in ((5, 64), (4, 64, 64), (4, 64, 32), (4, 64), (4, 64)))
    ids = torch.tensor([[0, 1], [1, 2], [3, -1], [0, 3], [2, 2]], device=device)
    weights: list[tuple[str, ExpertWeight, ExpertWeight]] = [("plain", w13, w2)]
    if expert_format is not None:
        weights.append((expert_format.describe(), *_quantized_like(expert_format, w13, w2)))
    variants: list[tuple[str, torch.Tensor | None, torch.Tensor | None, ClampedSwiGLU | None]] = [
        ("silu", None, None, None), ("biased clamped SwiGLU", b13, b2, ClampedSwiGLU())]
    for kind, q13, q2 in weights:
        for name, bias13, bias2, act in variants[:2 if clamped else 1]:
            got = fused_moe(x, q13, q2, ids, torch.zeros(10, 64, device=device), b13=bias13, b2=bias2, act=act)
            want = fused_moe_ref(x, q13, q2, ids, torch.zeros(10, 64, device=device), b13=bias13, b2=bias2, act=act)
            err = (got - want).abs().max().item()
            if not err < 1e-3:
                raise RuntimeError(f"Triton fused MoE ({name}, {kind} experts) differs from the reference "
                                   f"by {err} at start-up")


def _quantized_like(fmt: LinearFormat, w13: torch.Tensor, w2: torch.Tensor) -> tuple[ExpertWeight, ExpertWeight]:
    """w13 (as gate and up) and w2 quantized in `fmt`, a group size above 32 brought down to 32
    (the check's w2 has 32 input columns)."""
    if fmt.group_size > 32:
        fmt = replace(fmt, group_size=32)
    _, i2, h = w13.shape
    gate, up = (QuantStack(fmt, fmt.quantize(w), i2 // 2, h) for w in w13.chunk(2, dim=1))
    return JoinedRows([gate, up]), QuantStack(fmt, fmt.quantize(w2), h, i2 // 2)


class Experts(Protocol):
    """One MoE layer's experts, as the model calls them (resident, or paged)."""

    def __call__(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; ids: [T, k] expert ids.  Returns y: [T, k, H] (unweighted)."""
        ...


class ExpertsFactory(Protocol):
    """Builds one MoE layer's experts object from its stacked tensors (the loader's
    `make_experts`: paged experts; default all resident).  `fingerprints`: per expert, of the
    checkpoint's own bytes in the order w13, w2, b13, b2 (see engine/experts/check.py)."""

    def __call__(self, layer: int, w13: ExpertWeight, w2: ExpertWeight, fingerprints: list[int], *,
                 b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                 act: ClampedSwiGLU | None = None) -> Experts: ...


class ResidentExperts:
    """All E experts of one layer on the device; the expert id is the slot id.
    b13 [E, 2I] / b2 [E, H]: optional biases; act: the gated activation (None: silu)."""

    def __init__(self, w13: ExpertWeight, w2: ExpertWeight, triton: bool = False, *,
                 b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                 act: ClampedSwiGLU | None = None) -> None:
        self.w13, self.w2 = w13, w2  # [E, 2I, H], [E, H, I]
        self.b13, self.b2, self.act = b13, b2, act
        self.triton = triton

    def __call__(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; ids: [T, k] expert ids.  Returns y: [T, k, H] (unweighted)."""
        t, k = ids.shape
        plan = StepPlan.for_step(ids, num_rows(self.w13), self.triton)
        if plan.strategy == "gathered":  # every pair is selected: no output buffer needed
            return gathered_all(x, self.w13, self.w2, ids, b13=self.b13, b2=self.b2, act=self.act).view(t, k, -1)
        out = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
        expert_outputs(x, self.w13, self.w2, ids, out, plan, b13=self.b13, b2=self.b2, act=self.act)
        return out.view(t, k, -1)
