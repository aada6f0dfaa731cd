"""Qwen3-MoE (`Qwen3MoeForCausalLM`): GQA attention with per-head q/k RMSNorm and RoPE, q/k/v/o
biases when `attention_bias`, a sliding window on every layer when `use_sliding_window`; sparse
MoE layers (softmax top-k router, optional norm_topk_prob) and optional dense layers
(mlp_only_layers, decoder_sparse_step).  The checkpoint's names and shapes (HF layout) and
how they are fused: q/k/v as one matrix, each MoE layer's experts stacked."""

from __future__ import annotations

import torch

from engine.attention import TorchAttention
from engine.config import ModelConfig
from engine.models.decoder import DecoderModel, DenseMlp, MoeBlock
from engine.models.gqa import gqa_shapes, pop_gqa
from engine.models.weights import (
    ExpertsFactory,
    Shapes,
    build_experts,
    check_silu_gated,
    decoder_layer,
    decoder_shapes,
    dense_mlp,
    expert_names,
    experts_shapes,
    finish,
    ignorable,
    is_routed_expert,
    make_rope,
    mlp_shapes,
)
from engine.models.weights import silu_expert_bytes as expert_bytes
from engine.moe import SoftmaxRouter

__all__ = ["assemble", "expected_tensors", "expert_bytes", "ignorable", "is_routed_expert", "sliding_window"]


def _attention_bias(cfg: ModelConfig) -> bool:
    """q/k/v and output biases (transformers' default: off)."""
    return bool(cfg.raw.get("attention_bias", False))


def sliding_window(cfg: ModelConfig) -> int | None:
    """The window every layer attends over (None: full causal attention).  transformers'
    Qwen3MoeConfig keeps `sliding_window` only with `use_sliding_window` and then windows every
    layer (it reads no max_window_layers, unlike Qwen2-MoE)."""
    window = cfg.raw.get("sliding_window")
    return int(window) if cfg.raw.get("use_sliding_window") and window else None


def kernel_variants(cfg: ModelConfig) -> set[str]:
    return {"window"} if sliding_window(cfg) else set()


def expected_tensors(cfg: ModelConfig) -> Shapes:
    """Every tensor the checkpoint must hold, with the shape the config implies.  Raises
    ValueError naming `hidden_act` when it is not SiLU (the MLPs run SiLU-gated)."""
    check_silu_gated(cfg)

    def layer(li: int, p: str) -> Shapes:
        bias = _attention_bias(cfg)
        out = gqa_shapes(cfg, p, bias=bias, o_bias=bias, qk_norm=True)
        if cfg.is_moe_layer(li):
            out[p + "mlp.gate.weight"] = (cfg.num_experts, cfg.hidden_size)
            out.update(experts_shapes(cfg, p + "mlp.experts."))
        else:
            out.update(mlp_shapes(p + "mlp.", cfg.hidden_size, cfg.intermediate_size))
        return out
    return decoder_shapes(cfg, layer)


def assemble(cfg: ModelConfig, t: dict[str, torch.Tensor], attention: TorchAttention,
             make_experts: ExpertsFactory | None = None, moe_triton: bool = False) -> DecoderModel:
    """Fuse loaded tensors (already in the target dtype and place) into the model.

    `make_experts(layer, w13, w2, fingerprints)` builds each MoE layer's experts object
    (default: all resident, run by the Triton kernel when `moe_triton`).  Consumes `t`:
    tensors are popped as they are fused.
    """
    rope = make_rope(cfg, t["model.embed_tokens.weight"].device)
    bias, window = _attention_bias(cfg), sliding_window(cfg)
    layers = []
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        attn = pop_gqa(cfg, t, p, rope, bias=bias, o_bias=bias, qk_norm=True, window=window)
        mlp: MoeBlock | DenseMlp
        if cfg.is_moe_layer(li):
            router = SoftmaxRouter(t.pop(p + "mlp.gate.weight"), cfg.num_experts_per_tok, cfg.norm_topk_prob)
            mlp = MoeBlock(router, build_experts(li, t, expert_names(p + "mlp.experts."), cfg.num_experts,
                                                 make_experts, moe_triton))
        else:
            mlp = dense_mlp(t, p + "mlp.")
        layers.append(decoder_layer(t, p, attn, mlp))
    return finish(cfg, t, layers, attention)
