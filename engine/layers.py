"""Small building blocks shared by the models: RMSNorm (rotary embeddings: engine/rope.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 and cast back before the weight
    (as HF does).  `weight` may be [..., D] to give each head its own weight."""
    if x.dtype == torch.float32:
        if weight.dim() == 1:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return F.rms_norm(x, (x.shape[-1],), None, eps) * weight
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
