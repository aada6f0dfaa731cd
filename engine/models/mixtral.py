"""Mixtral (`MixtralForCausalLM`): GQA attention with RoPE, a sliding window on every layer
when `sliding_window` is set, and a sparse MoE block in every layer: softmax over all
`num_local_experts` experts, top-k (2), the k weights renormalised to sum to one; no shared
expert.  The experts' width is `intermediate_size`.

Checkpoint names (HF layout): `block_sparse_moe.gate` [E, H] and per expert
`block_sparse_moe.experts.{e}.w1` (gate), `.w3` (up), `.w2` (down), stacked here to
w13 [E, 2I, H] (w1 rows, then w3 rows) and w2 [E, H, I].
"""

from __future__ import annotations

import torch

from engine.attention import TorchAttention
from engine.config import ModelConfig
from engine.models.decoder import DecoderModel, MoeBlock
from engine.models.gqa import gqa_shapes, pop_gqa
from engine.models.weights import (
    ExpertsFactory,
    Shapes,
    build_experts,
    check_silu_gated,
    decoder_layer,
    decoder_shapes,
    expert_names,
    experts_shapes,
    finish,
    ignorable,
    make_rope,
)
from engine.models.weights import silu_expert_bytes as expert_bytes
from engine.moe import SoftmaxRouter

__all__ = ["assemble", "expected_tensors", "expert_bytes", "ignorable", "is_routed_expert", "sliding_window"]

EXPERT_WEIGHTS = ("w1", "w3", "w2")  # gate, up, down


def expected_tensors(cfg: ModelConfig) -> Shapes:
    """Every tensor the checkpoint must hold, with the shape the config implies.  Raises
    ValueError naming `hidden_act` when it is not SiLU (the MLPs run SiLU-gated)."""
    check_silu_gated(cfg)

    def layer(li: int, p: str) -> Shapes:
        out = gqa_shapes(cfg, p)
        out[p + "block_sparse_moe.gate.weight"] = (cfg.num_experts, cfg.hidden_size)
        out.update(experts_shapes(cfg, p + "block_sparse_moe.experts.", EXPERT_WEIGHTS))
        return out
    return decoder_shapes(cfg, layer)


def is_routed_expert(name: str) -> bool:
    """Whether a checkpoint tensor belongs to a routed expert (paged experts keep those on the host)."""
    return ".block_sparse_moe.experts." in name


def sliding_window(cfg: ModelConfig) -> int | None:
    """The window every layer attends over (None: full causal attention)."""
    window = cfg.raw.get("sliding_window")
    return int(window) if window else None


def kernel_variants(cfg: ModelConfig) -> set[str]:
    return {"window"} if sliding_window(cfg) else set()


def assemble(cfg: ModelConfig, t: dict[str, torch.Tensor], attention: TorchAttention,
             make_experts: ExpertsFactory | None = None, moe_triton: bool = False) -> DecoderModel:
    """Fuse loaded tensors (already in the target dtype and place) into the model.

    `make_experts(layer, w13, w2, fingerprints)` builds each layer's experts (default: all
    resident, run by the Triton kernel when `moe_triton`); fingerprints are per expert, over
    the checkpoint's w1, w3, w2.  Consumes `t`: tensors are popped as they are fused.
    """
    rope = make_rope(cfg, t["model.embed_tokens.weight"].device)
    window = sliding_window(cfg)
    layers = []
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        attn = pop_gqa(cfg, t, p, rope, window=window)
        router = SoftmaxRouter(t.pop(p + "block_sparse_moe.gate.weight"), cfg.num_experts_per_tok, True)
        experts = build_experts(li, t, expert_names(p + "block_sparse_moe.experts.", EXPERT_WEIGHTS),
                                cfg.num_experts, make_experts, moe_triton)
        layers.append(decoder_layer(t, p, attn, MoeBlock(router, experts)))
    return finish(cfg, t, layers, attention)
