"""Load-time helpers the family modules share: stacking per-expert checkpoint tensors into
the layout the experts run from, and building a layer's experts (resident or paged).

    w13: [E, 2I, H]  gate_proj rows first, then up_proj rows
    w2:  [E, H, I]   down_proj
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.experts.check import fingerprint
from engine.models.decoder import DenseMlp
from engine.moe import Experts, ExpertsFactory, ResidentExperts

__all__ = ["ExpertNames", "ExpertsFactory", "build_experts", "dense_mlp", "mlp_shapes", "stack_experts"]

# expert e -> the checkpoint names of its (gate, up, down) weights
ExpertNames = Callable[[int], tuple[str, str, str]]


def stack_experts(t: dict[str, torch.Tensor], names: ExpertNames, num_experts: int,
                  with_fingerprints: bool) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Pop every expert's gate/up/down from `t` into w13 [E, 2I, H] and w2 [E, H, I], with
    each expert's fingerprint over the checkpoint's own tensors (before stacking, so a
    stacking bug that mixes experts is caught by the independence check)."""
    gate0, _, down0 = names(0)
    i, h = t[gate0].shape
    first = t[down0]
    w13 = torch.empty(num_experts, 2 * i, h, dtype=first.dtype, device=first.device)
    w2 = torch.empty(num_experts, h, i, dtype=first.dtype, device=first.device)
    prints = []
    for e in range(num_experts):
        gate, up, down = (t.pop(n) for n in names(e))
        if with_fingerprints:
            prints.append(fingerprint(gate, up, down))
        w13[e, :i], w13[e, i:], w2[e] = gate, up, down
    return w13, w2, prints


def build_experts(layer: int, t: dict[str, torch.Tensor], names: ExpertNames, num_experts: int,
                  make_experts: ExpertsFactory | None, moe_triton: bool) -> Experts:
    """A layer's routed experts: all resident (run by the Triton kernel when `moe_triton`), or
    what `make_experts` builds (paged experts) from the stacked weights and fingerprints."""
    w13, w2, prints = stack_experts(t, names, num_experts, with_fingerprints=make_experts is not None)
    return make_experts(layer, w13, w2, prints) if make_experts else ResidentExperts(w13, w2, moe_triton)


def dense_mlp(t: dict[str, torch.Tensor], gate: str, up: str, down: str) -> DenseMlp:
    """Pop a SiLU-gated MLP's three weights from `t`."""
    return DenseMlp(torch.cat([t.pop(gate), t.pop(up)]), t.pop(down))


def mlp_shapes(prefix: str, hidden: int, width: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
               ) -> dict[str, tuple[int, ...]]:
    """The expected shapes of a SiLU-gated MLP's weights `{prefix}{name}.weight`."""
    g, u, d = names
    return {f"{prefix}{g}.weight": (width, hidden), f"{prefix}{u}.weight": (width, hidden),
            f"{prefix}{d}.weight": (hidden, width)}
