"""The MoE layer's math: top-k routing and the expert computation (torch reference).

Expert weights are stacked per layer:
    w13: [E, 2*I, H]  gate_proj rows first, then up_proj rows
    w2:  [E, H, I]    down_proj
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# How a layer's (token, expert) pairs are computed, by their number (measured on CPU,
# experts of the shipped model's size): up to GATHER_MAX_PAIRS, gather each pair's
# weights (single-stream decode); up to PADDED_MAX_PAIRS, one batched matmul over
# all experts with tokens grouped and padded (batched decode, no weight copy);
# beyond, one GEMM per used expert (prefill).
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
    return weights.to(x.dtype), ids


def experts_gathered(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     ids: torch.Tensor) -> torch.Tensor:
    """Every (token, k) pair as one batched matmul over gathered weights.

    x: [T, H]; ids: [T, k] indexes dim 0 of w13/w2.  Returns y: [T, k, H] (unweighted).
    """
    t, k = ids.shape
    flat = ids.reshape(-1)  # [T*k]
    xr = x.unsqueeze(1).expand(t, k, x.shape[1]).reshape(t * k, x.shape[1], 1)  # [T*k, H, 1]
    h = torch.bmm(w13.index_select(0, flat), xr).squeeze(-1)  # [T*k, 2I]
    gate, up = h.chunk(2, dim=-1)
    act = (F.silu(gate) * up).unsqueeze(-1)  # [T*k, I, 1]
    y = torch.bmm(w2.index_select(0, flat), act).squeeze(-1)  # [T*k, H]
    return y.view(t, k, -1)


def experts_padded(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   ids: torch.Tensor) -> torch.Tensor:
    """Tokens grouped by expert into a zero-padded [E, C, H] block (C = the largest
    group), then two batched matmuls over all E experts: no weight is copied.

    Returns y: [T, k, H] (unweighted).
    """
    t, k = ids.shape
    flat = ids.reshape(-1)  # [P]
    order = flat.argsort(stable=True)
    expert = flat[order]  # [P], ascending
    counts = torch.bincount(flat, minlength=w13.shape[0])  # [E]
    rank = torch.arange(flat.numel(), device=x.device) - (counts.cumsum(0) - counts)[expert]
    grouped = x.new_zeros(w13.shape[0], int(counts.max()), x.shape[1])  # [E, C, H]
    grouped[expert, rank] = x[order // k]
    gate, up = torch.bmm(grouped, w13.transpose(1, 2)).chunk(2, dim=-1)  # [E, C, I] each
    y = torch.bmm(F.silu(gate) * up, w2.transpose(1, 2))  # [E, C, H]
    out = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    out[order] = y[expert, rank]
    return out.view(t, k, -1)


def experts_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
    """Tokens sorted by expert, one GEMM per expert that the batch uses.

    Returns y: [T, k, H] (unweighted), the same layout as `experts_gathered`.
    """
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    xs = x.index_select(0, order // k)  # [T*k, H], grouped by expert
    outs = []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        chunk = xs[start:start + n]
        gate, up = F.linear(chunk, w13[e]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, w2[e]))
        start += n
    y = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    y[order] = torch.cat(outs)
    return y.view(t, k, -1)


def combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over the k experts of each token, in rank order. y: [T, k, H]."""
    return (y * weights.unsqueeze(-1)).sum(dim=1)


def moe_forward(x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                top_k: int, norm_topk_prob: bool) -> torch.Tensor:
    """The whole sparse MLP with every expert resident. x: [T, H] -> [T, H]."""
    weights, ids = route(x, router, top_k, norm_topk_prob)
    return combine(run_experts(x, w13, w2, ids), weights)


def run_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Pick the computation by the number of (token, expert) pairs. Returns [T, k, H]."""
    pairs = ids.numel()
    if pairs <= GATHER_MAX_PAIRS:
        return experts_gathered(x, w13, w2, ids)
    if pairs <= PADDED_MAX_PAIRS:
        return experts_padded(x, w13, w2, ids)
    return experts_grouped(x, w13, w2, ids)
