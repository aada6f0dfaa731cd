"""Load-time helpers the family modules share: the activation their MLPs run (SiLU-gated), the
tensors every decoder checkpoint holds, stacking per-expert checkpoint tensors into the layout
the experts run from, and building a layer's MLP (dense, routed experts resident or paged,
shared experts).

    w13: [E, 2I, H]  gate_proj rows first, then up_proj rows
    w2:  [E, H, I]   down_proj
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from engine.attention import TorchAttention
from engine.config import ModelConfig
from engine.experts.check import fingerprint
from engine.models.decoder import DecoderLayer, DecoderModel, DenseMlp, Mixer, MoeBlock
from engine.moe import Experts, ExpertsFactory, GroupedSigmoidRouter, ResidentExperts
from engine.quant.dense import join_rows, take_linear
from engine.quant.load import LoadedTensors, QuantParts
from engine.quant.stack import ExpertWeight, JoinedRows, QuantStack
from engine.rope import Rope, rope_params

__all__ = ["SILU_ACTIVATIONS", "ExpertNames", "ExpertsFactory", "Shapes", "build_experts", "check_silu_gated",
           "decoder_layer", "decoder_shapes", "dense_mlp", "expert_names", "experts_shapes", "finish", "grouped_moe",
           "grouped_moe_shapes", "ignorable", "is_routed_expert", "keeps_router_fp32", "make_rope", "mlp_shapes",
           "silu_expert_bytes", "stack_experts"]

Shapes = dict[str, tuple[int, ...]]
# expert e -> the checkpoint names of its (gate, up, down) weights
ExpertNames = Callable[[int], tuple[str, str, str]]
SILU_NAMES = ("gate_proj", "up_proj", "down_proj")
# the config.json `hidden_act` values that are the SiLU the experts and dense MLPs run
# (transformers' ACT2FN: "silu" and "swish" are both torch's silu)
SILU_ACTIVATIONS = ("silu", "swish")


def check_silu_gated(cfg: ModelConfig) -> None:
    """Refuse a config whose `hidden_act` (transformers' default when absent: "silu") is not
    the SiLU every SiLU-gated MLP here runs.  Raises ValueError naming the field, its value
    and the supported values; the families call it from `expected_tensors`, before any
    tensor is read."""
    act = cfg.raw.get("hidden_act", "silu")
    if act not in SILU_ACTIVATIONS:
        raise ValueError(f"{cfg.architecture}: hidden_act={act!r} is not supported: its experts and dense "
                         f"MLPs run SiLU-gated (supported: {', '.join(map(repr, SILU_ACTIVATIONS))})")


# ---- what the checkpoint holds ------------------------------------------------------------
def decoder_shapes(cfg: ModelConfig, layer: Callable[[int, str], Shapes]) -> Shapes:
    """The embedding, final norm and LM head (unless tied), and per layer its two norms plus
    what `layer(index, "model.layers.{index}.")` names (attention and MLP)."""
    h = cfg.hidden_size
    out: Shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    for li in range(cfg.num_hidden_layers):
        p = f"model.layers.{li}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        out.update(layer(li, p))
    return out


def mlp_shapes(prefix: str, hidden: int, width: int, names: tuple[str, str, str] = SILU_NAMES) -> Shapes:
    """The expected shapes of a SiLU-gated MLP's weights `{prefix}{name}.weight`."""
    g, u, d = names
    return {f"{prefix}{g}.weight": (width, hidden), f"{prefix}{u}.weight": (width, hidden),
            f"{prefix}{d}.weight": (hidden, width)}


def experts_shapes(cfg: ModelConfig, prefix: str, names: tuple[str, str, str] = SILU_NAMES) -> Shapes:
    """Every routed expert's weights, `{prefix}{e}.{name}.weight` (prefix ends in "experts.")."""
    out: Shapes = {}
    for e in range(cfg.num_experts):
        out.update(mlp_shapes(f"{prefix}{e}.", cfg.hidden_size, cfg.moe_intermediate_size, names))
    return out


def grouped_moe_shapes(cfg: ModelConfig, li: int, p: str) -> Shapes:
    """A GLM-4.5 / DeepSeek-V3 layer's MLP: dense, or the sigmoid router with its correction
    bias, the routed experts and the shared experts (`mlp.shared_experts.`, when configured)."""
    h = cfg.hidden_size
    if not cfg.is_moe_layer(li):
        return mlp_shapes(p + "mlp.", h, cfg.intermediate_size)
    out: Shapes = {p + "mlp.gate.weight": (cfg.num_experts, h),
                   p + "mlp.gate.e_score_correction_bias": (cfg.num_experts,)}
    out.update(experts_shapes(cfg, p + "mlp.experts."))
    if cfg.num_shared_experts:
        out.update(mlp_shapes(p + "mlp.shared_experts.", h, cfg.shared_expert_intermediate_size))
    return out


def ignorable(cfg: ModelConfig, name: str) -> bool:
    """Tensors checkpoints carry that the runtime does not use: rotary caches, a tied LM head,
    and the shared experts transformers writes with zero rows when n_shared_experts is 0
    (GLM-4.5, DeepSeek-V3: an MLP of width 0, whose output is zero)."""
    return (name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")
            or (not cfg.num_shared_experts and ".mlp.shared_experts." in name))


def is_routed_expert(name: str) -> bool:
    """Whether a checkpoint tensor belongs to a routed expert (paged experts keep those on the
    host); shared experts (`mlp.shared_expert(s).`) stay resident."""
    return ".mlp.experts." in name


def keeps_router_fp32(name: str) -> bool:
    """GLM-4.5's and DeepSeek-V3's tensors transformers keeps in fp32 whatever the serving dtype:
    the router's weight and correction bias (routing runs in fp32; a bf16 bias would move
    near-tie choices)."""
    return name.endswith((".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"))


def silu_expert_bytes(cfg: ModelConfig, element_size: int) -> int:
    """One routed SiLU-gated expert's weights: gate, up and down."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * element_size


# ---- fusing loaded tensors ---------------------------------------------------------------
def make_rope(cfg: ModelConfig, device: torch.device | str, rot_dim: int | None = None) -> Rope:
    """The config's rope over `rot_dim` dims of each head (default: all of head_dim)."""
    return Rope(rot_dim or cfg.head_dim, {**rope_params(cfg.raw), "rope_theta": cfg.rope_theta},
                cfg.max_position_embeddings, device)


def expert_names(prefix: str, names: tuple[str, str, str] = SILU_NAMES) -> ExpertNames:
    """Expert e -> its `{prefix}{e}.{gate,up,down}.weight` names (prefix ends in "experts.")."""
    def of(e: int) -> tuple[str, str, str]:
        g, u, d = (f"{prefix}{e}.{n}.weight" for n in names)
        return g, u, d
    return of


def stack_experts(t: dict[str, torch.Tensor], names: ExpertNames, num_experts: int,
                  with_fingerprints: bool) -> tuple[ExpertWeight, ExpertWeight, list[int]]:
    """Pop every expert's gate/up/down from `t` into w13 [E, 2I, H] and w2 [E, H, I], with
    each expert's fingerprint over the checkpoint's own tensors (before stacking, so a
    stacking bug that mixes experts is caught by the independence check).  Experts the
    loader kept quantized (`t.quantized`) stack into quantized weights, their parts as published."""
    gate0, _, down0 = names(0)
    if isinstance(t, LoadedTensors) and gate0 in t.quantized:
        return stack_quantized_experts(t.quantized, names, num_experts, with_fingerprints)
    i, h = t[gate0].shape
    first = t[down0]
    w13 = torch.empty(num_experts, 2 * i, h, dtype=first.dtype, device=first.device)
    w2 = torch.empty(num_experts, h, i, dtype=first.dtype, device=first.device)
    prints = []
    for e in range(num_experts):
        gate, up, down = (t.pop(n) for n in names(e))
        if with_fingerprints:
            prints.append(fingerprint(gate, up, down))
        w13[e, :i], w13[e, i:], w2[e] = gate, up, down
    return w13, w2, prints


def stack_quantized_experts(q: dict[str, QuantParts], names: ExpertNames, num_experts: int,
                            with_fingerprints: bool) -> tuple[ExpertWeight, ExpertWeight, list[int]]:
    """`stack_experts` for quantized experts: each of gate, up and down stacked part by part
    over the experts (w13 joins gate's and up's rows); an expert's fingerprint covers every
    part of its three linears, in the format's order."""
    linears: list[list[QuantParts]] = [[], [], []]    # gate, up, down; expert by expert
    prints = []
    for e in range(num_experts):
        three = [q.pop(n) for n in names(e)]
        if with_fingerprints:
            prints.append(fingerprint(*(p for lin in three for p in lin.tensors())))
        for stacked, lin in zip(linears, three):
            stacked.append(lin)
    gate, up, down = (_stack(lins) for lins in linears)
    return JoinedRows([gate, up]), down, prints


def _stack(linears: list[QuantParts]) -> QuantStack:
    """One linear of every expert, each part stacked over the experts ([E, ...])."""
    first = linears[0]
    parts = {s: torch.stack([lin.parts[s] for lin in linears]) for s in first.fmt.parts()}
    return QuantStack(first.fmt, parts, first.out, first.in_)


def build_experts(layer: int, t: dict[str, torch.Tensor], names: ExpertNames, num_experts: int,
                  make_experts: ExpertsFactory | None, moe_triton: bool) -> Experts:
    """A layer's routed experts: all resident (run by the Triton kernel when `moe_triton`), or
    what `make_experts` builds (paged experts) from the stacked weights and fingerprints."""
    w13, w2, prints = stack_experts(t, names, num_experts, with_fingerprints=make_experts is not None)
    return make_experts(layer, w13, w2, prints) if make_experts else ResidentExperts(w13, w2, moe_triton)


def dense_mlp(t: dict[str, torch.Tensor], prefix: str, names: tuple[str, str, str] = SILU_NAMES) -> DenseMlp:
    """Pop a SiLU-gated MLP's three weights `{prefix}{name}.weight` from `t`."""
    gate, up, down = (take_linear(t, f"{prefix}{n}.weight") for n in names)
    return DenseMlp(join_rows([gate, up]), down)


def grouped_moe(cfg: ModelConfig, t: dict[str, torch.Tensor], li: int, defaults: dict[str, Any],
                make_experts: ExpertsFactory | None, moe_triton: bool) -> MoeBlock | DenseMlp:
    """A GLM-4.5 / DeepSeek-V3 layer's MLP (see `grouped_moe_shapes`); routing settings the
    config leaves out take the family's `defaults` (n_group, topk_group, norm_topk_prob,
    routed_scaling_factor)."""
    p = f"model.layers.{li}.mlp."
    if not cfg.is_moe_layer(li):
        return dense_mlp(t, p)

    def get(key: str) -> Any:
        value = cfg.raw.get(key)
        return defaults[key] if value is None else value
    router = GroupedSigmoidRouter(t.pop(p + "gate.weight"), t.pop(p + "gate.e_score_correction_bias"),
                                  cfg.num_experts_per_tok, int(get("n_group")), int(get("topk_group")),
                                  bool(get("norm_topk_prob")), float(get("routed_scaling_factor")))
    experts = build_experts(li, t, expert_names(p + "experts."), cfg.num_experts, make_experts, moe_triton)
    shared = dense_mlp(t, p + "shared_experts.") if cfg.num_shared_experts else None
    return MoeBlock(router, experts, shared)


def decoder_layer(t: dict[str, torch.Tensor], p: str, attn: Mixer, mlp: MoeBlock | DenseMlp) -> DecoderLayer:
    """Layer `p` ("model.layers.{i}.") with its two norms popped from `t`."""
    return DecoderLayer(t.pop(p + "input_layernorm.weight"), t.pop(p + "post_attention_layernorm.weight"), attn, mlp)


def finish(cfg: ModelConfig, t: dict[str, torch.Tensor], layers: list[DecoderLayer],
           attention: TorchAttention) -> DecoderModel:
    """The model around `layers`: embedding, final norm and LM head (the embedding when tied)."""
    embed = t.pop("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else t.pop("lm_head.weight")
    return DecoderModel(cfg, layers, embed, t.pop("model.norm.weight"), lm_head, attention)
