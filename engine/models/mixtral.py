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
from engine.models.decoder import DecoderLayer, DecoderModel, MoeBlock
from engine.models.gqa import gqa_shapes, pop_gqa
from engine.models.weights import ExpertNames, ExpertsFactory, build_experts, mlp_shapes
from engine.moe import SoftmaxRouter
from engine.rope import Rope, rope_params

EXPERT_WEIGHTS = ("w1", "w3", "w2")  # gate, up, down


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with the shape the config implies."""
    h = cfg.hidden_size
    out = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        out.update(gqa_shapes(cfg, p))
        out[p + "block_sparse_moe.gate.weight"] = (cfg.num_experts, h)
        for e in range(cfg.num_experts):
            out.update(mlp_shapes(p + f"block_sparse_moe.experts.{e}.", h, cfg.moe_intermediate_size,
                                  EXPERT_WEIGHTS))
    return out


def ignorable(cfg: ModelConfig, name: str) -> bool:
    """Tensors some checkpoints carry that the runtime does not use."""
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


def is_routed_expert(name: str) -> bool:
    """Whether a checkpoint tensor belongs to a routed expert (paged experts keep those on the host)."""
    return ".block_sparse_moe.experts." in name


def expert_bytes(cfg: ModelConfig, element_size: int) -> int:
    """One routed expert's weights: w1, w3 and w2."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * element_size


def sliding_window(cfg: ModelConfig) -> int | None:
    """The window every layer attends over (None: full causal attention)."""
    window = cfg.raw.get("sliding_window")
    return int(window) if window else None


def _expert_names(prefix: str) -> ExpertNames:
    return lambda e: tuple(f"{prefix}block_sparse_moe.experts.{e}.{n}.weight"  # type: ignore[return-value]
                           for n in EXPERT_WEIGHTS)


def assemble(cfg: ModelConfig, t: dict[str, torch.Tensor], attention: TorchAttention,
             make_experts: ExpertsFactory | None = None, moe_triton: bool = False) -> DecoderModel:
    """Fuse loaded tensors (already in the target dtype and place) into the model.

    `make_experts(layer, w13, w2, fingerprints)` builds each layer's experts (default: all
    resident, run by the Triton kernel when `moe_triton`); fingerprints are per expert, over
    the checkpoint's w1, w3, w2.  Consumes `t`: tensors are popped as they are fused.
    """
    device = t["model.embed_tokens.weight"].device
    rope = Rope(cfg.head_dim, rope_params(cfg.raw or {"rope_theta": cfg.rope_theta}),
                cfg.max_position_embeddings, device)
    window = sliding_window(cfg)
    layers = []
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        attn = pop_gqa(cfg, t, p, rope, window=window)
        router = SoftmaxRouter(t.pop(p + "block_sparse_moe.gate.weight"), cfg.num_experts_per_tok, True)
        experts = build_experts(li, t, _expert_names(p), cfg.num_experts, make_experts, moe_triton)
        layers.append(DecoderLayer(t.pop(p + "input_layernorm.weight"), t.pop(p + "post_attention_layernorm.weight"),
                                   attn, MoeBlock(router, experts)))
    embed = t.pop("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else t.pop("lm_head.weight")
    return DecoderModel(cfg, layers, embed, t.pop("model.norm.weight"), lm_head, attention)
