"""DeepSeek-V3 (`DeepseekV3ForCausalLM`, also Kimi-K2-shaped configs): multi-head latent
attention (engine/models/mla.py) with YaRN rope on the decoupled key, the first
`first_k_dense_replace` layers dense, the rest MoE with a sigmoid group-limited router
(e_score_correction_bias, n_group / topk_group, routed_scaling_factor) and shared experts
that are always resident.  The checkpoint's names and shapes (HF layout) and how they are
fused.  FP8 weights and the multi-token-prediction layers are the loader's concern.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.attention import TorchAttention
from engine.config import ModelConfig
from engine.models.decoder import DecoderModel
from engine.models.mla import MlaAttention, MlaDims, MlaWeights, softmax_scale
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
)
from engine.models.weights import keeps_router_fp32 as keeps_fp32
from engine.models.weights import silu_expert_bytes as expert_bytes
from engine.quant.dense import join_rows, take_linear
from engine.rope import Rope, rope_params

__all__ = ["assemble", "attention_layer", "expected_tensors", "expert_bytes", "ignorable", "is_routed_expert",
           "keeps_fp32", "make_rope"]

# HF DeepseekV3Config's defaults, for config.json files that leave a field out
DEFAULTS: dict[str, Any] = {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
                            "norm_topk_prob": True, "rope_interleave": True}


def _get(cfg: ModelConfig, key: str) -> Any:
    value = cfg.raw.get(key)
    return DEFAULTS[key] if value is None else value


def check_supported(cfg: ModelConfig) -> None:
    """Refuse, naming the field, what this module does not run (DeepSeek-V2's routing, a
    hidden_act other than SiLU (`check_silu_gated`), a MoE layer frequency other than every layer)."""
    raw = cfg.raw
    check_silu_gated(cfg)
    limits = {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",), "moe_layer_freq": (1,)}
    for key, allowed in limits.items():
        if key in raw and raw[key] not in allowed:
            raise ValueError(f"{cfg.architecture}: {key}={raw[key]!r} is not supported "
                             f"(supported: {', '.join(map(repr, allowed))})")
    for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        if not raw.get(key):
            raise ValueError(f"{cfg.architecture}: config.json lacks {key}, which latent attention needs")


def _attention_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    d, h = MlaDims.from_raw(cfg.raw), cfg.hidden_size
    a = p + "self_attn."
    q_out = d.heads * (d.nope + d.rope)
    out: dict[str, tuple[int, ...]] = {
        a + "kv_a_proj_with_mqa.weight": (d.row, h), a + "kv_a_layernorm.weight": (d.kv_lora_rank,),
        a + "kv_b_proj.weight": (d.heads * (d.nope + d.v), d.kv_lora_rank),
        a + "o_proj.weight": (h, d.heads * d.v)}
    if d.q_lora_rank:
        out.update({a + "q_a_proj.weight": (d.q_lora_rank, h), a + "q_a_layernorm.weight": (d.q_lora_rank,),
                    a + "q_b_proj.weight": (q_out, d.q_lora_rank)})
    else:
        out[a + "q_proj.weight"] = (q_out, h)
    if cfg.raw.get("attention_bias"):
        out.update({a + "kv_a_proj_with_mqa.bias": (d.row,), a + "o_proj.bias": (h,)})
        if d.q_lora_rank:
            out[a + "q_a_proj.bias"] = (d.q_lora_rank,)
    return out


def expected_tensors(cfg: ModelConfig) -> Shapes:
    """Every tensor the checkpoint must hold, with the shape the config implies."""
    check_supported(cfg)
    return decoder_shapes(cfg, lambda li, p: {**_attention_shapes(cfg, p), **grouped_moe_shapes(cfg, li, p)})


def make_rope(cfg: ModelConfig, device: torch.device | str) -> Rope:
    """The rope of the decoupled key/query parts: qk_rope_head_dim dims, DeepSeek's pairing
    unless `rope_interleave` is false, YaRN where the config scales it."""
    return Rope(int(cfg.raw["qk_rope_head_dim"]), rope_params(cfg.raw), cfg.max_position_embeddings, device,
                interleaved=bool(_get(cfg, "rope_interleave")))


def attention_layer(cfg: ModelConfig, t: dict[str, torch.Tensor], p: str, rope: Rope,
                    absorbed: bool | None = None) -> MlaAttention:
    """Pop layer `p`'s (e.g. "model.layers.3.") attention weights from `t` into its block."""
    d, a = MlaDims.from_raw(cfg.raw), p + "self_attn."
    bias = bool(cfg.raw.get("attention_bias"))
    q_lora = [a + "q_a_proj"] if d.q_lora_rank else []
    w_a = join_rows([take_linear(t, n + ".weight") for n in q_lora + [a + "kv_a_proj_with_mqa"]])
    b_a = torch.cat([t.pop(n + ".bias") for n in q_lora + [a + "kv_a_proj_with_mqa"]]) if bias else None
    w = MlaWeights(
        w_a=w_a, b_a=b_a, q_norm=t.pop(a + "q_a_layernorm.weight") if d.q_lora_rank else None,
        w_q=take_linear(t, a + ("q_b_proj.weight" if d.q_lora_rank else "q_proj.weight")),
        kv_norm=t.pop(a + "kv_a_layernorm.weight"), w_kv_b=t.pop(a + "kv_b_proj.weight"),
        w_o=take_linear(t, a + "o_proj.weight"), b_o=t.pop(a + "o_proj.bias") if bias else None)
    return MlaAttention(w, d, rope, softmax_scale(cfg.raw), absorbed)


def kernel_variants(cfg: ModelConfig) -> set[str]:
    return {"latent"}


def assemble(cfg: ModelConfig, t: dict[str, torch.Tensor], attention: TorchAttention,
             make_experts: ExpertsFactory | None = None, moe_triton: bool = False) -> DecoderModel:
    """Fuse loaded tensors (already in the target dtype and place) into the model.

    `make_experts(layer, w13, w2, fingerprints)` builds each MoE layer's routed experts
    (default: all resident); shared experts are always resident.  Consumes `t`.
    """
    check_supported(cfg)
    rope = make_rope(cfg, t["model.embed_tokens.weight"].device)
    layers = []
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        layers.append(decoder_layer(t, p, attention_layer(cfg, t, p, rope),
                                    grouped_moe(cfg, t, li, DEFAULTS, make_experts, moe_triton)))
    return finish(cfg, t, layers, attention)
