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
from engine.models.decoder import DecoderLayer, DecoderModel, DenseMlp, MoeBlock
from engine.models.gqa import gqa_shapes, pop_gqa
from engine.models.weights import ExpertNames, ExpertsFactory, build_experts, dense_mlp, mlp_shapes
from engine.moe import SoftmaxRouter
from engine.rope import Rope, rope_params


def _qkv_bias(cfg: ModelConfig) -> bool:
    return bool(cfg.raw.get("qkv_bias", True))


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with the shape the config implies."""
    h = cfg.hidden_size
    out = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        out.update(gqa_shapes(cfg, p, bias=_qkv_bias(cfg)))
        if cfg.is_moe_layer(li):
            out[p + "mlp.gate.weight"] = (cfg.num_experts, h)
            for e in range(cfg.num_experts):
                out.update(mlp_shapes(p + f"mlp.experts.{e}.", h, cfg.moe_intermediate_size))
            out.update(mlp_shapes(p + "mlp.shared_expert.", h, cfg.shared_expert_intermediate_size))
            out[p + "mlp.shared_expert_gate.weight"] = (1, h)
        else:
            out.update(mlp_shapes(p + "mlp.", h, cfg.intermediate_size))
    return out


def ignorable(cfg: ModelConfig, name: str) -> bool:
    """Tensors some checkpoints carry that the runtime does not use."""
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


def is_routed_expert(name: str) -> bool:
    """Whether a checkpoint tensor belongs to a routed expert (not the shared one, which stays resident)."""
    return ".mlp.experts." in name


def expert_bytes(cfg: ModelConfig, element_size: int) -> int:
    """One routed expert's weights: gate, up and down."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * element_size


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


def _expert_names(prefix: str) -> ExpertNames:
    return lambda e: tuple(f"{prefix}mlp.experts.{e}.{n}_proj.weight"  # type: ignore[return-value]
                           for n in ("gate", "up", "down"))


def _mlp(cfg: ModelConfig, t: dict[str, torch.Tensor], li: int, make_experts: ExpertsFactory | None,
         moe_triton: bool) -> MoeBlock | DenseMlp:
    p = f"model.layers.{li}.mlp."
    if not cfg.is_moe_layer(li):
        return dense_mlp(t, p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight")
    router = SoftmaxRouter(t.pop(p + "gate.weight"), cfg.num_experts_per_tok, cfg.norm_topk_prob)
    experts = build_experts(li, t, _expert_names(f"model.layers.{li}."), cfg.num_experts, make_experts, moe_triton)
    shared = dense_mlp(t, p + "shared_expert.gate_proj.weight", p + "shared_expert.up_proj.weight",
                       p + "shared_expert.down_proj.weight")
    return MoeBlock(router, experts, shared, t.pop(p + "shared_expert_gate.weight"))  # gate [1, H]


def assemble(cfg: ModelConfig, t: dict[str, torch.Tensor], attention: TorchAttention,
             make_experts: ExpertsFactory | None = None, moe_triton: bool = False) -> DecoderModel:
    """Fuse loaded tensors (already in the target dtype and place) into the model.

    `make_experts(layer, w13, w2, fingerprints)` builds each MoE layer's routed experts
    (default: all resident, run by the Triton kernel when `moe_triton`).  Consumes `t`:
    tensors are popped as they are fused.
    """
    device = t["model.embed_tokens.weight"].device
    rope = Rope(cfg.head_dim, rope_params(cfg.raw or {"rope_theta": cfg.rope_theta}),
                cfg.max_position_embeddings, device)
    bias, windows = _qkv_bias(cfg), layer_windows(cfg)
    layers = []
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        attn = pop_gqa(cfg, t, p, rope, bias=bias, window=windows[li])
        mlp = _mlp(cfg, t, li, make_experts, moe_triton)
        layers.append(DecoderLayer(t.pop(p + "input_layernorm.weight"), t.pop(p + "post_attention_layernorm.weight"),
                                   attn, mlp))
    embed = t.pop("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else t.pop("lm_head.weight")
    return DecoderModel(cfg, layers, embed, t.pop("model.norm.weight"), lm_head, attention)
