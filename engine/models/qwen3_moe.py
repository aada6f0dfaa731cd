"""Qwen3-MoE (`Qwen3MoeForCausalLM`): GQA attention with per-head q/k RMSNorm and RoPE, sparse
MoE layers (softmax top-k router, optional norm_topk_prob) and optional dense layers
(mlp_only_layers, decoder_sparse_step).  The checkpoint's names and shapes (HF layout) and
how they are fused: q/k/v as one matrix, each MoE layer's experts stacked."""

from __future__ import annotations

import torch

from engine.attention import TorchAttention
from engine.config import ModelConfig
from engine.models.decoder import DecoderLayer, DecoderModel, DenseMlp, MoeBlock
from engine.models.gqa import gqa_shapes, pop_gqa
from engine.models.weights import ExpertNames, ExpertsFactory, build_experts, dense_mlp, mlp_shapes
from engine.moe import SoftmaxRouter
from engine.rope import Rope, rope_params


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with the shape the config implies."""
    h = cfg.hidden_size
    out = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        out.update(gqa_shapes(cfg, p, qk_norm=True))
        if cfg.is_moe_layer(li):
            out[p + "mlp.gate.weight"] = (cfg.num_experts, h)
            for e in range(cfg.num_experts):
                out.update(mlp_shapes(p + f"mlp.experts.{e}.", h, cfg.moe_intermediate_size))
        else:
            out.update(mlp_shapes(p + "mlp.", h, cfg.intermediate_size))
    return out


def ignorable(cfg: ModelConfig, name: str) -> bool:
    """Tensors some checkpoints carry that the runtime does not use."""
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


def is_routed_expert(name: str) -> bool:
    """Whether a checkpoint tensor belongs to a routed expert (paged experts keep those on the host)."""
    return ".mlp.experts." in name


def expert_bytes(cfg: ModelConfig, element_size: int) -> int:
    """One routed expert's weights: gate, up and down."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * element_size


def _experts(p: str) -> ExpertNames:
    def names(e: int) -> tuple[str, str, str]:
        q = p + f"mlp.experts.{e}."
        return q + "gate_proj.weight", q + "up_proj.weight", q + "down_proj.weight"
    return names


def assemble(cfg: ModelConfig, t: dict[str, torch.Tensor], attention: TorchAttention,
             make_experts: ExpertsFactory | None = None, moe_triton: bool = False) -> DecoderModel:
    """Fuse loaded tensors (already in the target dtype and place) into the model.

    `make_experts(layer, w13, w2, fingerprints)` builds each MoE layer's experts object
    (default: all resident, run by the Triton kernel when `moe_triton`).  Consumes `t`:
    tensors are popped as they are fused.
    """
    device = t["model.embed_tokens.weight"].device
    rope = Rope(cfg.head_dim, {**rope_params(cfg.raw), "rope_theta": cfg.rope_theta},
                cfg.max_position_embeddings, device)
    layers = []
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        attn = pop_gqa(cfg, t, p, rope, qk_norm=True)
        if cfg.is_moe_layer(li):
            router = SoftmaxRouter(t.pop(p + "mlp.gate.weight"), cfg.num_experts_per_tok, cfg.norm_topk_prob)
            mlp: MoeBlock | DenseMlp = MoeBlock(router, build_experts(li, t, _experts(p), cfg.num_experts,
                                                                      make_experts, moe_triton))
        else:
            mlp = dense_mlp(t, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight")
        layers.append(DecoderLayer(t.pop(p + "input_layernorm.weight"), t.pop(p + "post_attention_layernorm.weight"),
                                   attn, mlp))
    embed = t.pop("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else t.pop("lm_head.weight")
    return DecoderModel(cfg, layers, embed, t.pop("model.norm.weight"), lm_head, attention)
