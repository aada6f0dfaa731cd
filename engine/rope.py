"""Rotary position embeddings for every family: full or partial, paired by halves (HF/Qwen)
or interleaved (DeepSeek), unscaled or YaRN-scaled.

The formulas follow transformers' rope utilities (`_compute_default_rope_parameters`,
`_compute_yarn_parameters`) so that positions rotate exactly as the reference models do.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """The rope dictionary of a config.json in one spelling: transformers 5's
    `rope_parameters`, or the older `rope_scaling` beside a top-level `rope_theta`."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    return params


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_mscale(params: dict[str, Any]) -> float:
    """DeepSeek's extra softmax scale under YaRN: mscale(factor, mscale_all_dim) squared is
    what its attention multiplies `1/sqrt(d)` by (1.0 without YaRN or mscale_all_dim)."""
    if params.get("rope_type") != "yarn" or not params.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"])) ** 2


def _inv_freq(rot_dim: int, params: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rot_dim / 2] and the factor cos/sin are scaled by."""
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
    rope_type = params["rope_type"]
    if rope_type == "default":
        return 1.0 / (base ** exponents), 1.0
    if rope_type != "yarn":
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: 'default', 'yarn'")
    original = params.get("original_max_position_embeddings") or max_positions
    factor = params.get("factor") or max_positions / original
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return rot_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    pos_freqs = base ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attention)


class Rope:
    """Rotates the first `rot_dim` dims of each head (the rest pass unchanged).

    `interleaved`: the rotated dims come as pairs (x0, x1), (x2, x3), ... (DeepSeek); they are
    regrouped into halves first, as transformers does, so the output is in halves order (the
    same for queries and keys, so their dot products are unchanged)."""

    def __init__(self, rot_dim: int, params: dict[str, Any], max_positions: int,
                 device: torch.device | str, interleaved: bool = False) -> None:
        if rot_dim % 2:
            raise ValueError(f"rotary dimension {rot_dim} must be even")
        inv, self.attention_factor = _inv_freq(rot_dim, params, max_positions)
        freqs = torch.arange(max_positions).float()[:, None] * inv[None, :]  # [P, rot/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, rot]
        half = rot_dim // 2
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        self.cos = cos.to(device)
        # sin with the sign of rotate_half folded in: rotate_half(x) * sin == roll(x) * signed_sin
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(device)
        self.rot_dim, self.interleaved, self.max_positions = rot_dim, interleaved, max_positions

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a batch's positions: [T, 1, rot_dim] each (computed once per forward)."""
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        return (cos, sin) if dtype == torch.float32 else (cos.to(dtype), sin.to(dtype))

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] with D >= rot_dim -> rotated, same shape."""
        d = x.shape[-1]
        rot = x if d == self.rot_dim else x[..., :self.rot_dim]
        if self.interleaved:
            rot = rot.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        out = torch.addcmul(rot * cos, rot.roll(self.rot_dim // 2, dims=-1), sin)
        return out if d == self.rot_dim else torch.cat((out, x[..., self.rot_dim:]), dim=-1)
