"""Small building blocks shared by the models: RMSNorm and rotary embeddings."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 and cast back (as HF does)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class Rotary:
    """Rotary position embedding (non-interleaved halves, the HF/Qwen layout)."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, device: torch.device | str):
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
        pos = torch.arange(max_positions, device=device).float()
        freqs = pos[:, None] * inv[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos, self.sin = emb.cos(), emb.sin()
        self.max_positions = max_positions

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D]; positions: [T]."""
        cos = self.cos[positions].to(x.dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin[positions].to(x.dtype)[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
