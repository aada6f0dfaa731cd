"""Expert-routing locality of a trained MoE: reuse between consecutive tokens and
the hit rate of a per-layer LRU of K resident experts, measured on held-out text."""

from __future__ import annotations

from collections import OrderedDict

import torch


def consecutive_reuse(topk: torch.Tensor) -> float:
    """Mean share of token t's experts that token t-1 also used. topk: [T, k]."""
    k = topk.shape[1]
    same = (topk[1:, :, None] == topk[:-1, None, :]).any(-1).sum(-1)  # [T-1]
    return float(same.float().mean() / k)


def lru_hit_rate(topk: torch.Tensor, slots: int) -> float:
    """Hit rate of an LRU of `slots` experts serving one token per step. topk: [T, k]."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for row in topk.tolist():
        for e in row:
            total += 1
            if e in cache:
                hits += 1
                cache.move_to_end(e)
        for e in row:
            if e not in cache:
                if len(cache) >= slots:
                    victim = next(v for v in cache if v not in row)
                    del cache[victim]
                cache[e] = None
                cache.move_to_end(e)
    return hits / max(total, 1)


@torch.no_grad()
def layer_locality(model, windows: list[torch.Tensor], slots: int = 16) -> list[dict]:
    """Per MoE layer: reuse and LRU hit rate averaged over held-out windows."""
    per_layer: dict[int, list[tuple[float, float]]] = {}
    for ids in windows:
        model(ids.unsqueeze(0))
        for li, layer in enumerate(model.layers):
            topk = layer.mlp.last_topk
            per_layer.setdefault(li, []).append((consecutive_reuse(topk), lru_hit_rate(topk, slots)))
    out = []
    for li in sorted(per_layer):
        vals = per_layer[li]
        out.append({"layer": li,
                    "reuse": sum(v[0] for v in vals) / len(vals),
                    f"lru{slots}_hit_rate": sum(v[1] for v in vals) / len(vals)})
    return out
