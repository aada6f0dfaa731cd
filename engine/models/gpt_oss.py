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
rows), w2 [E, H, I], b13 [E, 2I] (gate, then up), b2 [E, H].  MXFP4 checkpoints (the
published gpt-oss weights: `*_blocks` / `*_scales` expert tensors) are refused.
"""

from __future__ import annotations

import torch

from engine.attention import TorchAttention
from engine.checkpoint import CheckpointError
from engine.config import ModelConfig
from engine.experts.check import fingerprint
from engine.kernels.fused_moe import ClampedSwiGLU
from engine.models.decoder import DecoderModel, MoeBlock
from engine.models.gqa import gqa_shapes, pop_gqa
from engine.models.weights import Shapes, decoder_layer, decoder_shapes, finish, is_routed_expert, make_rope
from engine.models.weights import ignorable as _plain_ignorable
from engine.moe import Experts, ExpertsFactory, LogitTopkRouter, ResidentExperts

__all__ = ["assemble", "expected_tensors", "expert_bytes", "ignorable", "is_routed_expert", "stack_fused_experts"]

MXFP4_SUFFIXES = ("_blocks", "_scales")


def _mxfp4_error(detail: str) -> CheckpointError:
    return CheckpointError(
        f"this gpt-oss checkpoint is MXFP4-quantized ({detail}): Tandem serves gpt-oss from "
        "bfloat16, float16 or float32 weights only (quantized experts are not supported yet). "
        "Use a bf16 copy, e.g. loaded with transformers' Mxfp4Config(dequantize=True) and saved "
        "with save_pretrained")


def check_supported(cfg: ModelConfig) -> None:
    """Raise CheckpointError for an MXFP4 checkpoint (config.json quantization_config)."""
    method = (cfg.raw.get("quantization_config") or {}).get("quant_method")
    if method == "mxfp4":
        raise _mxfp4_error("config.json quantization_config.quant_method='mxfp4'")


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
    return ClampedSwiGLU(alpha=float(cfg.raw.get("swiglu_alpha", 1.702)),
                         limit=float(cfg.raw.get("swiglu_limit", 7.0)))


def _attention_bias(cfg: ModelConfig) -> bool:
    return bool(cfg.raw.get("attention_bias", True))


def expected_tensors(cfg: ModelConfig) -> Shapes:
    """Every tensor the checkpoint must hold, with the shape the config implies.
    Raises CheckpointError for an MXFP4 checkpoint."""
    check_supported(cfg)
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


def ignorable(cfg: ModelConfig, name: str) -> bool:
    """Tensors some checkpoints carry that the runtime does not use.  Raises CheckpointError
    on an MXFP4 expert tensor (a quantized checkpoint whose config.json does not say so)."""
    if ".mlp.experts." in name and name.endswith(MXFP4_SUFFIXES):
        raise _mxfp4_error(f"tensor {name}")
    return _plain_ignorable(cfg, name)


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


def kernel_variants(cfg: ModelConfig) -> set[str]:
    return {"window", "sinks", "clamped_swiglu"}


def assemble(cfg: ModelConfig, t: dict[str, torch.Tensor], attention: TorchAttention,
             make_experts: ExpertsFactory | None = None, moe_triton: bool = False) -> DecoderModel:
    """Fuse loaded tensors (already in the target dtype and place) into the model.

    `make_experts(layer, w13, w2, fingerprints, b13=, b2=, act=)` builds each layer's experts
    (default: all resident, run by the Triton kernel when `moe_triton`).  Consumes `t`."""
    check_supported(cfg)
    rope = make_rope(cfg, t["model.embed_tokens.weight"].device)
    act, bias = _activation(cfg), _attention_bias(cfg)
    layers = []
    for li, window in enumerate(_layer_windows(cfg)):
        p = f"model.layers.{li}."
        attn = pop_gqa(cfg, t, p, rope, bias=bias, o_bias=bias, window=window, sinks=t.pop(p + "self_attn.sinks"))
        q = p + "mlp."
        router = LogitTopkRouter(t.pop(q + "router.weight"), t.pop(q + "router.bias"), cfg.num_experts_per_tok)
        w13, w2, b13, b2, prints = stack_fused_experts(
            t.pop(q + "experts.gate_up_proj"), t.pop(q + "experts.gate_up_proj_bias"),
            t.pop(q + "experts.down_proj"), t.pop(q + "experts.down_proj_bias"), make_experts is not None)
        experts: Experts = (make_experts(li, w13, w2, prints, b13=b13, b2=b2, act=act) if make_experts
                            else ResidentExperts(w13, w2, moe_triton, b13=b13, b2=b2, act=act))
        layers.append(decoder_layer(t, p, attn, MoeBlock(router, experts)))
    return finish(cfg, t, layers, attention)
