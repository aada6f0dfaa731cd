"""GLM-4.5 / 4.6 MoE (`Glm4MoeForCausalLM`): GQA attention with q/k/v biases when
`attention_bias`, per-head q/k RMSNorm when `use_qk_norm` (before RoPE, over the whole head),
and partial rotary: only the first `partial_rotary_factor` (default 0.5) of each head's dims
rotate, paired by halves.  The first `first_k_dense_replace` layers are dense; the rest are MoE:
sigmoid scores in fp32, the choice made on the scores plus `e_score_correction_bias` and limited
to the `topk_group` best of `n_group` groups, the weights the unbiased scores of the chosen
experts (renormalised when `norm_topk_prob`) times `routed_scaling_factor`; `n_shared_experts`
shared experts (one MLP of width n_shared_experts * moe_intermediate_size) added ungated.

Checkpoint names (HF layout): `mlp.gate.weight` [E, H], `mlp.gate.e_score_correction_bias` [E],
`mlp.experts.{e}.{gate,up,down}_proj`, `mlp.shared_experts.{gate,up,down}_proj`.  (The loader
skips the multi-token-prediction layers that follow the last decoder layer.)
"""

from __future__ import annotations

from typing import Any

import torch

from engine.attention import TorchAttention
from engine.config import ModelConfig
from engine.models.decoder import DecoderModel
from engine.models.gqa import gqa_shapes, pop_gqa
from engine.models.weights import (
    ExpertsFactory,
    Shapes,
    check_silu_gated,
    decoder_layer,
    decoder_shapes,
    finish,
    grouped_moe,
    grouped_moe_shapes,
    ignorable,
    is_routed_expert,
    make_rope,
)
from engine.models.weights import keeps_router_fp32 as keeps_fp32
from engine.models.weights import silu_expert_bytes as expert_bytes

__all__ = ["assemble", "expected_tensors", "expert_bytes", "ignorable", "is_routed_expert", "keeps_fp32",
           "rotary_dim"]

# Glm4MoeConfig's defaults, for config.json files that leave a routing field out
DEFAULTS = {"n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0}


def _options(cfg: ModelConfig) -> tuple[bool, bool]:
    """(q/k/v biases, q/k norm) as the config sets them (transformers' defaults: both off)."""
    return bool(cfg.raw.get("attention_bias", False)), bool(cfg.raw.get("use_qk_norm", False))


def rotary_dim(cfg: ModelConfig) -> int:
    """The rotated dims of each head: head_dim * partial_rotary_factor, read from the rope
    parameters (transformers 5) or the top level (the published configs); 0.5 when absent, as
    transformers defaults it for this family."""
    params: dict[str, Any] = cfg.raw.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", cfg.raw.get("partial_rotary_factor", 0.5))
    return int(cfg.head_dim * float(factor))


def expected_tensors(cfg: ModelConfig) -> Shapes:
    """Every tensor the checkpoint must hold, with the shape the config implies.  Raises
    ValueError naming `hidden_act` when it is not SiLU (the MLPs run SiLU-gated)."""
    check_silu_gated(cfg)
    bias, qk_norm = _options(cfg)
    return decoder_shapes(cfg, lambda li, p: {**gqa_shapes(cfg, p, bias=bias, qk_norm=qk_norm),
                                              **grouped_moe_shapes(cfg, li, p)})


def assemble(cfg: ModelConfig, t: dict[str, torch.Tensor], attention: TorchAttention,
             make_experts: ExpertsFactory | None = None, moe_triton: bool = False) -> DecoderModel:
    """Fuse loaded tensors (already in the target dtype and place) into the model.

    `make_experts(layer, w13, w2, fingerprints)` builds each MoE layer's routed experts
    (default: all resident, run by the Triton kernel when `moe_triton`).  Consumes `t`:
    tensors are popped as they are fused.
    """
    rope = make_rope(cfg, t["model.embed_tokens.weight"].device, rotary_dim(cfg))
    bias, qk_norm = _options(cfg)
    layers = []
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        attn = pop_gqa(cfg, t, p, rope, bias=bias, qk_norm=qk_norm)
        layers.append(decoder_layer(t, p, attn, grouped_moe(cfg, t, li, DEFAULTS, make_experts, moe_triton)))
    return finish(cfg, t, layers, attention)
