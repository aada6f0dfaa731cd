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
from engine.models.decoder import DecoderLayer, DecoderModel, DenseMlp, MoeBlock
from engine.models.mla import MlaAttention, MlaDims, MlaWeights, softmax_scale
from engine.models.weights import ExpertNames, ExpertsFactory, build_experts, dense_mlp, mlp_shapes
from engine.moe import GroupedSigmoidRouter
from engine.rope import Rope, rope_params

# HF DeepseekV3Config's defaults, for config.json files that leave a field out
DEFAULTS: dict[str, Any] = {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
                            "norm_topk_prob": True, "rope_interleave": True}


def _get(cfg: ModelConfig, key: str) -> Any:
    value = cfg.raw.get(key)
    return DEFAULTS[key] if value is None else value


def check_supported(cfg: ModelConfig) -> None:
    """Refuse, naming the field, what this module does not run (DeepSeek-V2's routing, other
    activations, a MoE layer frequency other than every layer)."""
    raw = cfg.raw
    limits = {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",), "hidden_act": ("silu",),
              "moe_layer_freq": (1,)}
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


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with the shape the config implies."""
    check_supported(cfg)
    h, e = cfg.hidden_size, cfg.num_experts
    out = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        out.update(_attention_shapes(cfg, p))
        if cfg.is_moe_layer(li):
            out.update({p + "mlp.gate.weight": (e, h), p + "mlp.gate.e_score_correction_bias": (e,)})
            for x in range(e):
                out.update(mlp_shapes(p + f"mlp.experts.{x}.", h, cfg.moe_intermediate_size))
            if cfg.num_shared_experts:
                out.update(mlp_shapes(p + "mlp.shared_experts.", h, cfg.shared_expert_intermediate_size))
        else:
            out.update(mlp_shapes(p + "mlp.", h, cfg.intermediate_size))
    return out


def ignorable(cfg: ModelConfig, name: str) -> bool:
    """Tensors some checkpoints carry that the runtime does not use (transformers writes the
    shared experts with zero rows when n_shared_experts is 0)."""
    return (name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")
            or (not cfg.num_shared_experts and ".mlp.shared_experts." in name))


def keeps_fp32(name: str) -> bool:
    """Tensors transformers keeps in fp32 whatever the serving dtype: the router's weight and
    correction bias (routing runs in fp32; a bf16 bias would move near-tie choices)."""
    return name.endswith((".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"))


def is_routed_expert(name: str) -> bool:
    """Whether a checkpoint tensor belongs to a routed expert (paged experts keep those on the
    host); the shared experts (`mlp.shared_experts.`) stay resident."""
    return ".mlp.experts." in name


def expert_bytes(cfg: ModelConfig, element_size: int) -> int:
    """One routed expert's weights: gate, up and down."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * element_size


def _experts(p: str) -> ExpertNames:
    def names(e: int) -> tuple[str, str, str]:
        q = p + f"mlp.experts.{e}."
        return q + "gate_proj.weight", q + "up_proj.weight", q + "down_proj.weight"
    return names


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
    w_a = torch.cat([t.pop(n + ".weight") for n in q_lora + [a + "kv_a_proj_with_mqa"]])
    b_a = torch.cat([t.pop(n + ".bias") for n in q_lora + [a + "kv_a_proj_with_mqa"]]) if bias else None
    w = MlaWeights(
        w_a=w_a, b_a=b_a, q_norm=t.pop(a + "q_a_layernorm.weight") if d.q_lora_rank else None,
        w_q=t.pop(a + ("q_b_proj.weight" if d.q_lora_rank else "q_proj.weight")),
        kv_norm=t.pop(a + "kv_a_layernorm.weight"), w_kv_b=t.pop(a + "kv_b_proj.weight"),
        w_o=t.pop(a + "o_proj.weight"), b_o=t.pop(a + "o_proj.bias") if bias else None)
    return MlaAttention(w, d, rope, softmax_scale(cfg.raw), absorbed)


def _moe(cfg: ModelConfig, t: dict[str, torch.Tensor], li: int, make_experts: ExpertsFactory | None,
         moe_triton: bool) -> MoeBlock:
    p = f"model.layers.{li}."
    router = GroupedSigmoidRouter(
        t.pop(p + "mlp.gate.weight"), t.pop(p + "mlp.gate.e_score_correction_bias"), cfg.num_experts_per_tok,
        int(_get(cfg, "n_group")), int(_get(cfg, "topk_group")), bool(_get(cfg, "norm_topk_prob")),
        float(_get(cfg, "routed_scaling_factor")))
    experts = build_experts(li, t, _experts(p), cfg.num_experts, make_experts, moe_triton)
    shared = None
    if cfg.num_shared_experts:
        q = p + "mlp.shared_experts."
        shared = dense_mlp(t, q + "gate_proj.weight", q + "up_proj.weight", q + "down_proj.weight")
    return MoeBlock(router, experts, shared)


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
        attn = attention_layer(cfg, t, p, rope)
        mlp: MoeBlock | DenseMlp = (_moe(cfg, t, li, make_experts, moe_triton) if cfg.is_moe_layer(li) else
                                    dense_mlp(t, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight",
                                              p + "mlp.down_proj.weight"))
        layers.append(DecoderLayer(t.pop(p + "input_layernorm.weight"), t.pop(p + "post_attention_layernorm.weight"),
                                   attn, mlp))
    embed = t.pop("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else t.pop("lm_head.weight")
    return DecoderModel(cfg, layers, embed, t.pop("model.norm.weight"), lm_head, attention)
