"""Qwen3-MoE's on-disk tensor names and shapes (HF layout), and how they are fused."""

from __future__ import annotations

from typing import Callable

import torch

from engine.attention import TorchAttention
from engine.config import ModelConfig
from engine.experts.check import fingerprint
from engine.models.qwen3_moe import LayerWeights, Qwen3MoeModel
from engine.moe import Experts, ResidentExperts

ExpertsFactory = Callable[[int, torch.Tensor, torch.Tensor, list[int]], Experts]


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with the shape the config implies."""
    h, d = cfg.hidden_size, cfg.head_dim
    hq, hkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    out = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (hq, h), p + "self_attn.k_proj.weight": (hkv, h),
                    p + "self_attn.v_proj.weight": (hkv, h), p + "self_attn.o_proj.weight": (h, hq),
                    p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if cfg.is_moe_layer(li):
            i = cfg.moe_intermediate_size
            out[p + "mlp.gate.weight"] = (cfg.num_experts, h)
            for e in range(cfg.num_experts):
                q = p + f"mlp.experts.{e}."
                out.update({q + "gate_proj.weight": (i, h), q + "up_proj.weight": (i, h),
                            q + "down_proj.weight": (h, i)})
        else:
            i = cfg.intermediate_size
            out.update({p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                        p + "mlp.down_proj.weight": (h, i)})
    return out


def ignorable(cfg: ModelConfig, name: str) -> bool:
    """Tensors some checkpoints carry that the runtime does not use."""
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


def assemble(cfg: ModelConfig, t: dict[str, torch.Tensor], attention: TorchAttention,
             make_experts: ExpertsFactory | None = None, moe_triton: bool = False) -> Qwen3MoeModel:
    """Fuse loaded tensors (already in the target dtype and place) into the model.

    `make_experts(layer, w13, w2, fingerprints)` builds each MoE layer's experts object
    (default: all resident, run by the Triton kernel when `moe_triton`); fingerprints are
    per expert, taken from the checkpoint's own tensors before stacking.  Consumes `t`:
    tensors are popped as they are fused.
    """
    layers = []
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        layer = LayerWeights(
            input_norm=t.pop(p + "input_layernorm.weight"),
            post_norm=t.pop(p + "post_attention_layernorm.weight"),
            wqkv=torch.cat([t.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
            wo=t.pop(p + "self_attn.o_proj.weight"),
            qk_norm=torch.cat([t.pop(p + "self_attn.q_norm.weight").expand(cfg.num_attention_heads, -1),
                               t.pop(p + "self_attn.k_norm.weight").expand(cfg.num_key_value_heads, -1)]))
        if cfg.is_moe_layer(li):
            layer.router = t.pop(p + "mlp.gate.weight")
            w13, w2, prints = _stack_experts(cfg, t, p, with_fingerprints=make_experts is not None)
            layer.experts = make_experts(li, w13, w2, prints) if make_experts else \
                ResidentExperts(w13, w2, moe_triton)
        else:
            layer.dense_w13 = torch.cat([t.pop(p + "mlp.gate_proj.weight"), t.pop(p + "mlp.up_proj.weight")])
            layer.dense_w2 = t.pop(p + "mlp.down_proj.weight")
        layers.append(layer)
    embed = t.pop("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else t.pop("lm_head.weight")
    return Qwen3MoeModel(cfg, layers, embed, t.pop("model.norm.weight"), lm_head, attention)


def _stack_experts(cfg: ModelConfig, t: dict[str, torch.Tensor], prefix: str, with_fingerprints: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    e_count, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    first = t[prefix + "mlp.experts.0.down_proj.weight"]
    w13 = torch.empty(e_count, 2 * i, h, dtype=first.dtype, device=first.device)  # [E, 2I, H]
    w2 = torch.empty(e_count, h, i, dtype=first.dtype, device=first.device)       # [E, H, I]
    prints = []
    for e in range(e_count):
        q = prefix + f"mlp.experts.{e}."
        gate, up, down = (t.pop(q + f"{n}_proj.weight") for n in ("gate", "up", "down"))
        if with_fingerprints:
            prints.append(fingerprint(gate, up, down))
        w13[e, :i], w13[e, i:], w2[e] = gate, up, down
    return w13, w2, prints
