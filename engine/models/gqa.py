"""Grouped-query attention over the paged KV cache, with the options the families use:
q/k/v and output biases (Qwen2-MoE, gpt-oss), per-head q/k RMSNorm (Qwen3, GLM), full or
partial rotary (GLM), a sliding window (Mixtral, gpt-oss) and attention sinks (gpt-oss).

Its page layout: kv_layer [2, P, S, Hkv, D], K then V.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.config import ModelConfig
from engine.layers import rms_norm
from engine.models.decoder import StepContext
from engine.quant.dense import DenseWeight, join_rows, linear, take_linear
from engine.rope import Rope


class GqaAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, wqkv: DenseWeight,
                 wo: DenseWeight, rope: Rope, *, bqkv: torch.Tensor | None = None,
                 bo: torch.Tensor | None = None, qk_norm: torch.Tensor | None = None, eps: float = 1e-6,
                 window: int | None = None, sinks: torch.Tensor | None = None,
                 scale: float | None = None) -> None:
        """wqkv [(Hq + 2 Hkv) D, H] (q rows, then k, then v); wo [H, Hq D] (either plain, or kept
        quantized: engine/quant/dense.py); qk_norm
        [Hq + Hkv, D] (q_norm for the query heads, k_norm for the key heads); sinks [Hq]."""
        self.hq, self.hkv, self.d = num_heads, num_kv_heads, head_dim
        self.wqkv, self.wo, self.bqkv, self.bo = wqkv, wo, bqkv, bo
        self.rope, self.qk_norm, self.eps = rope, qk_norm, eps
        self.scale = head_dim ** -0.5 if scale is None else scale
        self._options: dict[str, Any] = {}
        if window is not None:
            self._options["window"] = window
        if sinks is not None:
            self._options["sinks"] = sinks.float()

    def __call__(self, h: torch.Tensor, kv_layer: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t, qk_heads = h.shape[0], self.hq + self.hkv
        qkv = linear(h, self.wqkv, self.bqkv).view(t, -1, self.d)  # [T, Hq + 2 Hkv, D]
        qk = qkv[:, :qk_heads]
        if self.qk_norm is not None:
            qk = rms_norm(qk, self.qk_norm, self.eps)
        qk = self.rope.apply(qk, *ctx.tables(self.rope))
        q, k = qk[:, :self.hq], qk[:, self.hq:]  # [T, Hq, D], [T, Hkv, D]
        v = qkv[:, qk_heads:]  # [T, Hkv, D]
        ctx.store(torch.stack((k, v)))  # [2, T, Hkv, D]: one write for K and V at every token's slot
        if ctx.plan is not None:  # planned exactly when the batch is a decode
            out = ctx.attention.decode(q, kv_layer, ctx.plan, self.scale, **self._options)  # [B, Hq, D]
        else:
            out = ctx.attention.prefill(q, kv_layer, ctx.batch, self.scale, **self._options)  # [T, Hq, D]
        return linear(out.reshape(t, -1), self.wo, self.bo)


def gqa_shapes(cfg: ModelConfig, prefix: str, *, bias: bool = False, o_bias: bool = False,
               qk_norm: bool = False) -> dict[str, tuple[int, ...]]:
    """The `{prefix}self_attn.*` tensors of one GQA layer, with their shapes."""
    h, d = cfg.hidden_size, cfg.head_dim
    hq, hkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    p = prefix + "self_attn."
    out: dict[str, tuple[int, ...]] = {p + "q_proj.weight": (hq, h), p + "k_proj.weight": (hkv, h),
           p + "v_proj.weight": (hkv, h), p + "o_proj.weight": (h, hq)}
    if bias:
        out.update({p + "q_proj.bias": (hq,), p + "k_proj.bias": (hkv,), p + "v_proj.bias": (hkv,)})
    if o_bias:
        out[p + "o_proj.bias"] = (h,)
    if qk_norm:
        out.update({p + "q_norm.weight": (d,), p + "k_norm.weight": (d,)})
    return out


def pop_gqa(cfg: ModelConfig, t: dict[str, torch.Tensor], prefix: str, rope: Rope, *,
            bias: bool = False, o_bias: bool = False, qk_norm: bool = False,
            window: int | None = None, sinks: torch.Tensor | None = None) -> GqaAttention:
    """Pop one layer's attention tensors (as `gqa_shapes` names them) from `t` and fuse them."""
    p = prefix + "self_attn."
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    norm = torch.cat([t.pop(p + "q_norm.weight").expand(hq, -1),
                      t.pop(p + "k_norm.weight").expand(hkv, -1)]) if qk_norm else None
    return GqaAttention(
        hq, hkv, cfg.head_dim, wqkv=join_rows([take_linear(t, p + f"{n}_proj.weight") for n in "qkv"]),
        wo=take_linear(t, p + "o_proj.weight"), rope=rope, eps=cfg.rms_norm_eps, qk_norm=norm,
        bqkv=torch.cat([t.pop(p + f"{n}_proj.bias") for n in "qkv"]) if bias else None,
        bo=t.pop(p + "o_proj.bias") if o_bias else None, window=window, sinks=sinks)
