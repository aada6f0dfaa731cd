"""gpt-oss (`GptOssForCausalLM`): GQA attention with q/k/v/o biases, a learned attention sink
per query head, sliding-window and full layers alternating (`layer_types`), YaRN rope; every
layer MoE with a biased router (top-k of the logits, softmax over those k) and experts with
biases and gpt-oss's clamped SwiGLU.

The checkpoint (transformers' layout, bf16/fp16/fp32) stores each layer's experts fused:

    mlp.experts.gate_up_proj       [E, H, 2I]  gate and up interleaved in the last dim:
                                               gate = [..., ::2], up = [..., 1::2]
    mlp.experts.gate_up_proj_bias  [E, 2I]     interleaved the same way
    mlp.experts.down_proj          [E, I, H]
    mlp.experts.down_proj_bias     [E, H]

and they run from the layout every family stacks to: w13 [E, 2I, H] (gate rows, then up
rows), w2 [E, H, I], b13 [E, 2I] (gate, then up), b2 [E, H].

The published gpt-oss weights are MXFP4 (`quantization_config.quant_method: mxfp4`): the
experts' `gate_up_proj_blocks` / `_scales` [E, 2I, H/32, 16] / [E, 2I, H/32] (rows out, not
transposed; gate and up interleaved the same way) and `down_proj_blocks` / `_scales`.  They stay
MXFP4 (engine/quant/), the biases stay as published.
"""

from __future__ import annotations

import torch

from engine.attention import TorchAttention
from engine.config import ModelConfig
from engine.experts.check import fingerprint
from engine.kernels.fused_moe import ClampedSwiGLU
from engine.models.decoder import DecoderModel, MoeBlock
from engine.models.gqa import gqa_shapes, pop_gqa
from engine.models.weights import Shapes, decoder_layer, decoder_shapes, finish, ignorable, is_routed_expert, make_rope
from engine.moe import Experts, ExpertsFactory, LogitTopkRouter, ResidentExperts
from engine.quant.load import LoadedTensors
from engine.quant.stack import ExpertWeight, JoinedRows, QuantStack

__all__ = ["TRANSPOSED_EXPERTS", "assemble", "expected_tensors", "expert_bytes", "ignorable", "is_routed_expert",
           "stack_fused_experts"]

# the dense expert weights are stored [E, in, out] (the loader reads a quantized one's parts as [E, out, in])
TRANSPOSED_EXPERTS = True


def _layer_windows(cfg: ModelConfig) -> list[int | None]:
    """Each layer's sliding window (None: full attention).  transformers' default when
    config.json has no layer_types: sliding on even layers, full on odd ones."""
    n = cfg.num_hidden_layers
    types = cfg.raw.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                           for i in range(n)]
    if len(types) != n:
        raise ValueError(f"config.json layer_types has {len(types)} entries for {n} layers")
    window = cfg.raw.get("sliding_window")
    out: list[int | None] = []
    for i, kind in enumerate(types):
        if kind == "full_attention":
            out.append(None)
        elif kind == "sliding_attention":
            if not window:
                raise ValueError(f"layer {i} is sliding_attention but config.json sets no sliding_window")
            out.append(int(window))
        else:
            raise ValueError(f"layer {i} has layer_type {kind!r}; gpt-oss layers are "
                             "'sliding_attention' or 'full_attention'")
    return out


def _activation(cfg: ModelConfig) -> ClampedSwiGLU:
    """The experts' activation, read from swiglu_alpha / swiglu_limit.  config.json's
    `hidden_act` is not read: transformers' GptOss writes it but runs this activation whatever it says."""
    return ClampedSwiGLU(alpha=float(cfg.raw.get("swiglu_alpha", 1.702)),
                         limit=float(cfg.raw.get("swiglu_limit", 7.0)))


def _attention_bias(cfg: ModelConfig) -> bool:
    return bool(cfg.raw.get("attention_bias", True))


def expected_tensors(cfg: ModelConfig) -> Shapes:
    """Every tensor the checkpoint must hold, with the shape the config implies (the dense
    shape of a quantized one)."""
    if not cfg.num_experts:
        raise ValueError("gpt-oss config.json has no num_local_experts")
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    bias = _attention_bias(cfg)

    def layer(li: int, p: str) -> Shapes:
        q = p + "mlp."
        return {**gqa_shapes(cfg, p, bias=bias, o_bias=bias), p + "self_attn.sinks": (cfg.num_attention_heads,),
                q + "router.weight": (e, h), q + "router.bias": (e,),
                q + "experts.gate_up_proj": (e, h, 2 * i), q + "experts.gate_up_proj_bias": (e, 2 * i),
                q + "experts.down_proj": (e, i, h), q + "experts.down_proj_bias": (e, h)}
    return decoder_shapes(cfg, layer)


def expert_bytes(cfg: ModelConfig, element_size: int) -> int:
    """One routed expert, all its tensors: gate/up [2I, H] with bias [2I], down [H, I] with bias [H]."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    return (3 * h * i + 2 * i + h) * element_size


def stack_fused_experts(gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor,
                        down_bias: torch.Tensor, with_fingerprints: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """gpt-oss's fused expert tensors (module doc) -> (w13 [E, 2I, H], w2 [E, H, I], b13 [E, 2I],
    b2 [E, H], fingerprints).  Each expert's fingerprint is taken from its own slices of the
    checkpoint's tensors, laid out as the store holds them (w13, w2, b13, b2; see
    engine/experts/check.py), independently of the stacking, so a stacking bug that mixes
    experts is caught by the start-up check."""
    w13 = torch.cat((gate_up[..., ::2], gate_up[..., 1::2]), dim=2).transpose(1, 2).contiguous()
    w2 = down.transpose(1, 2).contiguous()
    b13 = torch.cat((gate_up_bias[:, ::2], gate_up_bias[:, 1::2]), dim=1).contiguous()
    b2 = down_bias.contiguous()
    prints = [fingerprint(gate_up[e][:, ::2].t(), gate_up[e][:, 1::2].t(), down[e].t(),
                          gate_up_bias[e][::2], gate_up_bias[e][1::2], down_bias[e])
              for e in range(gate_up.shape[0])] if with_fingerprints else []
    return w13, w2, b13, b2, prints


def _experts(t: dict[str, torch.Tensor], p: str, with_fingerprints: bool
             ) -> tuple[ExpertWeight, ExpertWeight, torch.Tensor, torch.Tensor, list[int]]:
    """Pop one layer's experts `{p}gate_up_proj...` from `t`: `stack_fused_experts`, or for
    MXFP4 experts kept quantized (in `t.quantized`) the published parts as they are."""
    if not (isinstance(t, LoadedTensors) and p + "gate_up_proj" in t.quantized):
        return stack_fused_experts(t.pop(p + "gate_up_proj"), t.pop(p + "gate_up_proj_bias"),
                                   t.pop(p + "down_proj"), t.pop(p + "down_proj_bias"), with_fingerprints)
    gate_up, down = t.quantized.pop(p + "gate_up_proj"), t.quantized.pop(p + "down_proj")
    gate_up_bias, down_bias = t.pop(p + "gate_up_proj_bias"), t.pop(p + "down_proj_bias")
    b13 = torch.cat((gate_up_bias[:, ::2], gate_up_bias[:, 1::2]), dim=1).contiguous()
    prints = [fingerprint(*(part[e] for part in gate_up.tensors() + down.tensors()),
                          gate_up_bias[e][::2], gate_up_bias[e][1::2], down_bias[e])
              for e in range(b13.shape[0])] if with_fingerprints else []
    w13 = JoinedRows([QuantStack(gate_up.fmt, gate_up.parts, gate_up.out, gate_up.in_)], interleaved=True)
    return w13, QuantStack(down.fmt, down.parts, down.out, down.in_), b13, down_bias.contiguous(), prints


def kernel_variants(cfg: ModelConfig) -> set[str]:
    return {"window", "sinks", "clamped_swiglu"}


def assemble(cfg: ModelConfig, t: dict[str, torch.Tensor], attention: TorchAttention,
             make_experts: ExpertsFactory | None = None, moe_triton: bool = False) -> DecoderModel:
    """Fuse loaded tensors (already in the target dtype and place) into the model.

    `make_experts(layer, w13, w2, fingerprints, b13=, b2=, act=)` builds each layer's experts
    (default: all resident, run by the Triton kernel when `moe_triton`).  Consumes `t`."""
    rope = make_rope(cfg, t["model.embed_tokens.weight"].device)
    act, bias = _activation(cfg), _attention_bias(cfg)
    layers = []
    for li, window in enumerate(_layer_windows(cfg)):
        p = f"model.layers.{li}."
        attn = pop_gqa(cfg, t, p, rope, bias=bias, o_bias=bias, window=window, sinks=t.pop(p + "self_attn.sinks"))
        q = p + "mlp."
        router = LogitTopkRouter(t.pop(q + "router.weight"), t.pop(q + "router.bias"), cfg.num_experts_per_tok)
        w13, w2, b13, b2, prints = _experts(t, q + "experts.", make_experts is not None)
        experts: Experts = (make_experts(li, w13, w2, prints, b13=b13, b2=b2, act=act) if make_experts
                            else ResidentExperts(w13, w2, moe_triton, b13=b13, b2=b2, act=act))
        layers.append(decoder_layer(t, p, attn, MoeBlock(router, experts)))
    return finish(cfg, t, layers, attention)
