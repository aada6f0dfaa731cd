"""Small building blocks shared by the models: RMSNorm and rotary embeddings."""

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


class Rotary:
    """Rotary position embedding (non-interleaved halves, the HF/Qwen layout)."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, device: torch.device | str) -> None:
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
        pos = torch.arange(max_positions, device=device).float()
        freqs = pos[:, None] * inv[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        half = head_dim // 2
        self.cos = emb.cos()
        # sin with the sign of rotate_half folded in: rotate_half(x) * sin == roll(x) * signed_sin
        self.sin = torch.cat((-emb.sin()[:, :half], emb.sin()[:, half:]), dim=-1)
        self.max_positions = max_positions

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a batch's positions: [T, 1, D] each (computed once per forward)."""
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        return (cos, sin) if dtype == torch.float32 else (cos.to(dtype), sin.to(dtype))

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] -> rotated, same shape (sin as `tables` gives it, signed)."""
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
