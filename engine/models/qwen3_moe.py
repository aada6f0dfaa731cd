"""Qwen3-MoE on a paged KV cache: GQA attention with q/k RMSNorm and RoPE, sparse
MoE layers (top-k router, optional norm_topk_prob) and optional dense layers.

Weights are held fused for few, large ops per layer: q/k/v as one matrix, and each
MoE layer's experts as stacked [E, ...] tensors behind an `Experts` object (the
seam where paged experts plug in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from engine.attention import AttentionPlan, TorchAttention
from engine.config import ModelConfig
from engine.experts.paged import PagedExperts
from engine.forward_batch import ForwardBatch
from engine.layers import Rotary, rms_norm
from engine.moe import Experts, combine, route


@dataclass
class LayerWeights:
    input_norm: torch.Tensor      # [H]
    post_norm: torch.Tensor       # [H]
    wqkv: torch.Tensor            # [(Hq + 2 Hkv) * D, H]
    wo: torch.Tensor              # [H, Hq * D]
    qk_norm: torch.Tensor         # [Hq + Hkv, D]: q_norm for the query heads, k_norm for the key heads
    router: torch.Tensor | None = None   # [E, H] (MoE layers)
    experts: Experts | None = None
    dense_w13: torch.Tensor | None = None  # [2I, H] (dense layers)
    dense_w2: torch.Tensor | None = None   # [H, I]


# A prefetch that guesses wrong holds the link when a demand page-in arrives.  Measured on
# the shipped model (bench.experts, K = 16, emulated link): prefetching every predicted
# expert was right about 35% of the time and slower than demand paging; guesses with at
# least 0.3 of the routing weight were right about 95% of the time, within a few percent
# of demand paging (docs/benchmarks.md).
PREFETCH_MIN_WEIGHT = 0.3


class Qwen3MoeModel:
    def __init__(self, cfg: ModelConfig, layers: list[LayerWeights], embed: torch.Tensor,
                 final_norm: torch.Tensor, lm_head: torch.Tensor, attention: TorchAttention) -> None:
        self.cfg = cfg
        self.layers = layers
        self.embed = embed            # [V, H]
        self.final_norm = final_norm  # [H]
        self.lm_head = lm_head        # [V, H]
        self.attention = attention
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, embed.device)
        self.scale = cfg.head_dim ** -0.5
        self._qk_heads = cfg.num_attention_heads + cfg.num_key_value_heads
        moe = [i for i, layer in enumerate(layers) if layer.experts is not None]
        self._next_moe = dict(zip(moe, moe[1:]))  # MoE layer -> the next MoE layer
        self.prefetch_experts = False  # paged experts: predict the next layer's experts

    def forward(self, batch: ForwardBatch, kv: torch.Tensor,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run every layer, writing this batch's K/V into `kv` at `batch.slot_mapping`.
        Call under torch.inference_mode() (the model runner does).

        kv: [L, 2, P, S, Hkv, D].  Returns the final hidden states of the tokens named by
        `batch.logits_indices`: [B, H].
        """
        eps = self.cfg.rms_norm_eps
        x = self.embed[batch.input_ids]  # [T, H]
        rope = self.rotary.tables(batch.positions, x.dtype)
        plan = self.attention.plan(batch) if batch.is_decode else None
        for li, layer in enumerate(self.layers):
            x = x + self._attention(rms_norm(x, layer.input_norm, eps), layer, kv[li], batch, rope, plan)
            h = rms_norm(x, layer.post_norm, eps)
            x = x + (self._moe(h, li) if layer.experts is not None else self._dense(h, layer))
            if self.prefetch_experts and li in self._next_moe:
                self._prefetch(x, self._next_moe[li])
            if on_layer is not None:
                on_layer(li)           # layer li's K/V are in the pool
        last = x if batch.is_decode else x[batch.logits_indices]  # decode: one token per request
        return rms_norm(last, self.final_norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, H] -> [B, V] in fp32."""
        return F.linear(hidden, self.lm_head).float()

    def _attention(self, h: torch.Tensor, layer: LayerWeights, kv: torch.Tensor,
                   batch: ForwardBatch, rope: tuple[torch.Tensor, torch.Tensor],
                   plan: AttentionPlan | None) -> torch.Tensor:
        cfg, t = self.cfg, h.shape[0]
        qkv = F.linear(h, layer.wqkv).view(t, -1, cfg.head_dim)  # [T, Hq + 2 Hkv, D]
        qk = rms_norm(qkv[:, :self._qk_heads], layer.qk_norm, cfg.rms_norm_eps)
        qk = self.rotary.apply(qk, *rope)
        q, k = qk[:, :cfg.num_attention_heads], qk[:, cfg.num_attention_heads:]  # [T, Hq, D], [T, Hkv, D]
        v = qkv[:, self._qk_heads:]  # [T, Hkv, D]
        # kv: [2, P, S, Hkv, D]; one write for K and V at every token's slot.
        kv.view(2, -1, cfg.num_key_value_heads, cfg.head_dim)[:, batch.slot_mapping] = torch.stack((k, v))
        if plan is not None:  # planned exactly when the batch is a decode
            out = self.attention.decode(q, kv, plan, self.scale)  # [B, Hq, D]
        else:
            out = self.attention.prefill(q, kv, batch, self.scale)  # [T, Hq, D]
        return F.linear(out.reshape(t, -1), layer.wo)

    def _moe(self, h: torch.Tensor, li: int) -> torch.Tensor:
        layer, cfg = self.layers[li], self.cfg
        assert layer.router is not None and layer.experts is not None  # a MoE layer
        weights, ids = route(h, layer.router, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        return combine(layer.experts(h, ids), weights)

    def _prefetch(self, x: torch.Tensor, nxt: int) -> None:
        """Predict layer `nxt`'s experts by applying its router to the residual stream as
        it leaves the current layer (normed as `nxt` will norm it, before `nxt`'s attention
        adds to it) and start their copies, which overlap `nxt`'s attention."""
        target = self.layers[nxt]
        # prefetch_experts is set only when every MoE layer's experts are paged
        assert target.router is not None and isinstance(target.experts, PagedExperts)
        h = rms_norm(x, target.post_norm, self.cfg.rms_norm_eps)
        weights, predicted = route(h, target.router, self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob)
        # Most confident first (every token's first choice, then every second choice, ...),
        # and only guesses with at least PREFETCH_MIN_WEIGHT of the token's routing weight.
        ranked = zip(predicted.t().reshape(-1).tolist(), weights.t().reshape(-1).tolist())
        target.experts.prefetch(list(dict.fromkeys(e for e, w in ranked if w >= PREFETCH_MIN_WEIGHT)))

    def _dense(self, h: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        assert layer.dense_w13 is not None and layer.dense_w2 is not None  # a dense layer
        gate, up = F.linear(h, layer.dense_w13).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.dense_w2)
