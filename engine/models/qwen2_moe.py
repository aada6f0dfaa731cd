"""Qwen2-MoE (`Qwen2MoeForCausalLM`, Qwen1.5-MoE and Qwen2-57B-A14B): GQA attention with
q/k/v biases (`qkv_bias`, on unless the config says otherwise) and RoPE; sparse MoE layers
(softmax over all experts, top-k, renormalised when `norm_topk_prob`) with one shared expert
beside the routed ones, its output scaled per token by sigmoid(h @ shared_expert_gate.T); dense
layers where `mlp_only_layers` or `decoder_sparse_step` say so.  Sliding-window layers only when
`use_sliding_window` (the even layers below `max_window_layers`, or as `layer_types` lists them).

Checkpoint names (HF layout): `mlp.gate` [E, H], `mlp.experts.{e}.{gate,up,down}_proj`,
`mlp.shared_expert.{gate,up,down}_proj` (width `shared_expert_intermediate_size`) and
`mlp.shared_expert_gate` [1, H].  The shared expert stays resident; routed experts may be paged.
"""

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

__all__ = ["assemble", "expected_tensors", "expert_bytes", "ignorable", "is_routed_expert", "layer_windows"]


def _qkv_bias(cfg: ModelConfig) -> bool:
    return bool(cfg.raw.get("qkv_bias", True))


def expected_tensors(cfg: ModelConfig) -> Shapes:
    """Every tensor the checkpoint must hold, with the shape the config implies.  Raises
    ValueError naming `hidden_act` when it is not SiLU (the MLPs run SiLU-gated)."""
    check_silu_gated(cfg)
    h = cfg.hidden_size

    def layer(li: int, p: str) -> Shapes:
        out = gqa_shapes(cfg, p, bias=_qkv_bias(cfg))
        if cfg.is_moe_layer(li):
            out[p + "mlp.gate.weight"] = (cfg.num_experts, h)
            out.update(experts_shapes(cfg, p + "mlp.experts."))
            out.update(mlp_shapes(p + "mlp.shared_expert.", h, cfg.shared_expert_intermediate_size))
            out[p + "mlp.shared_expert_gate.weight"] = (1, h)
        else:
            out.update(mlp_shapes(p + "mlp.", h, cfg.intermediate_size))
        return out
    return decoder_shapes(cfg, layer)


def layer_windows(cfg: ModelConfig) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers assigns them: only
    with `use_sliding_window`, on the layers `layer_types` marks "sliding_attention" (by
    default the even layers below `max_window_layers`)."""
    raw, n = cfg.raw, cfg.num_hidden_layers
    window = raw.get("sliding_window")
    if not raw.get("use_sliding_window") or not window:
        return [None] * n
    types = raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 and i < raw.get("max_window_layers", 28)
                                       else "full_attention" for i in range(n)]
    return [int(window) if kind == "sliding_attention" else None for kind in types]


def kernel_variants(cfg: ModelConfig) -> set[str]:
    return {"window"} if any(w is not None for w in layer_windows(cfg)) else set()


def _mlp(cfg: ModelConfig, t: dict[str, torch.Tensor], li: int, make_experts: ExpertsFactory | None,
         moe_triton: bool) -> MoeBlock | DenseMlp:
    p = f"model.layers.{li}.mlp."
    if not cfg.is_moe_layer(li):
        return dense_mlp(t, p)
    router = SoftmaxRouter(t.pop(p + "gate.weight"), cfg.num_experts_per_tok, cfg.norm_topk_prob)
    experts = build_experts(li, t, expert_names(p + "experts."), cfg.num_experts, make_experts, moe_triton)
    shared = dense_mlp(t, p + "shared_expert.")
    return MoeBlock(router, experts, shared, t.pop(p + "shared_expert_gate.weight"))  # gate [1, H]


def assemble(cfg: ModelConfig, t: dict[str, torch.Tensor], attention: TorchAttention,
             make_experts: ExpertsFactory | None = None, moe_triton: bool = False) -> DecoderModel:
    """Fuse loaded tensors (already in the target dtype and place) into the model.

    `make_experts(layer, w13, w2, fingerprints)` builds each MoE layer's routed experts
    (default: all resident, run by the Triton kernel when `moe_triton`).  Consumes `t`:
    tensors are popped as they are fused.
    """
    rope = make_rope(cfg, t["model.embed_tokens.weight"].device)
    bias, windows = _qkv_bias(cfg), layer_windows(cfg)
    layers = []
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        attn = pop_gqa(cfg, t, p, rope, bias=bias, window=windows[li])
        layers.append(decoder_layer(t, p, attn, _mlp(cfg, t, li, make_experts, moe_triton)))
    return finish(cfg, t, layers, attention)
