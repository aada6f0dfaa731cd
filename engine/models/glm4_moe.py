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
from engine.models.decoder import DecoderLayer, DecoderModel, DenseMlp, MoeBlock
from engine.models.gqa import gqa_shapes, pop_gqa
from engine.models.weights import ExpertNames, ExpertsFactory, build_experts, dense_mlp, mlp_shapes
from engine.moe import GroupedSigmoidRouter
from engine.rope import Rope, rope_params


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


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with the shape the config implies."""
    h = cfg.hidden_size
    bias, qk_norm = _options(cfg)
    out = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        out.update(gqa_shapes(cfg, p, bias=bias, qk_norm=qk_norm))
        if cfg.is_moe_layer(li):
            out.update({p + "mlp.gate.weight": (cfg.num_experts, h),
                        p + "mlp.gate.e_score_correction_bias": (cfg.num_experts,)})
            for e in range(cfg.num_experts):
                out.update(mlp_shapes(p + f"mlp.experts.{e}.", h, cfg.moe_intermediate_size))
            if cfg.num_shared_experts:
                out.update(mlp_shapes(p + "mlp.shared_experts.", h, cfg.shared_expert_intermediate_size))
        else:
            out.update(mlp_shapes(p + "mlp.", h, cfg.intermediate_size))
    return out


def ignorable(cfg: ModelConfig, name: str) -> bool:
    """Tensors some checkpoints carry that the runtime does not use."""
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


def keeps_fp32(name: str) -> bool:
    """Tensors transformers keeps in fp32 whatever the serving dtype: the router's weight and
    correction bias (routing runs in fp32; a bf16 bias would move near-tie choices)."""
    return name.endswith((".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"))


def is_routed_expert(name: str) -> bool:
    """Whether a checkpoint tensor belongs to a routed expert (not the shared ones, which stay resident)."""
    return ".mlp.experts." in name


def expert_bytes(cfg: ModelConfig, element_size: int) -> int:
    """One routed expert's weights: gate, up and down."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * element_size


def _expert_names(prefix: str) -> ExpertNames:
    return lambda e: tuple(f"{prefix}mlp.experts.{e}.{n}_proj.weight"  # type: ignore[return-value]
                           for n in ("gate", "up", "down"))


def _router(cfg: ModelConfig, t: dict[str, torch.Tensor], p: str) -> GroupedSigmoidRouter:
    raw = cfg.raw
    return GroupedSigmoidRouter(t.pop(p + "gate.weight"), t.pop(p + "gate.e_score_correction_bias"),
                                cfg.num_experts_per_tok, int(raw.get("n_group") or 1),
                                int(raw.get("topk_group") or 1), bool(raw.get("norm_topk_prob", True)),
                                float(raw.get("routed_scaling_factor", 1.0)))


def _mlp(cfg: ModelConfig, t: dict[str, torch.Tensor], li: int, make_experts: ExpertsFactory | None,
         moe_triton: bool) -> MoeBlock | DenseMlp:
    p = f"model.layers.{li}.mlp."
    if not cfg.is_moe_layer(li):
        return dense_mlp(t, p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight")
    router = _router(cfg, t, p)
    experts = build_experts(li, t, _expert_names(f"model.layers.{li}."), cfg.num_experts, make_experts, moe_triton)
    shared = dense_mlp(t, p + "shared_experts.gate_proj.weight", p + "shared_experts.up_proj.weight",
                       p + "shared_experts.down_proj.weight") if cfg.num_shared_experts else None
    return MoeBlock(router, experts, shared)


def assemble(cfg: ModelConfig, t: dict[str, torch.Tensor], attention: TorchAttention,
             make_experts: ExpertsFactory | None = None, moe_triton: bool = False) -> DecoderModel:
    """Fuse loaded tensors (already in the target dtype and place) into the model.

    `make_experts(layer, w13, w2, fingerprints)` builds each MoE layer's routed experts
    (default: all resident, run by the Triton kernel when `moe_triton`).  Consumes `t`:
    tensors are popped as they are fused.
    """
    device = t["model.embed_tokens.weight"].device
    rope = Rope(rotary_dim(cfg), rope_params(cfg.raw or {"rope_theta": cfg.rope_theta}),
                cfg.max_position_embeddings, device)
    bias, qk_norm = _options(cfg)
    layers = []
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        attn = pop_gqa(cfg, t, p, rope, bias=bias, qk_norm=qk_norm)
        mlp = _mlp(cfg, t, li, make_experts, moe_triton)
        layers.append(DecoderLayer(t.pop(p + "input_layernorm.weight"), t.pop(p + "post_attention_layernorm.weight"),
                                   attn, mlp))
    embed = t.pop("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else t.pop("lm_head.weight")
    return DecoderModel(cfg, layers, embed, t.pop("model.norm.weight"), lm_head, attention)
