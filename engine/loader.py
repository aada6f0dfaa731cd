"""Load a HF-layout checkpoint into a runtime model, checking every tensor.

Every tensor is copied once, here, into memory the engine allocates: the model never holds a
view into the memory-mapped file.  Such a view sits at the tensor's offset in the file, so its
alignment (and with it the order in which MKL's SGEMM sums) would depend on how the checkpoint
happens to be sharded, and rewriting the file would change the live weights.

Real checkpoints carry more than the model runs.  Quantized linears (config.json's
`quantization_config`: block FP8, GPTQ, AWQ, compressed-tensors, MXFP4; engine/quant/) are
gathered part by part: a routed expert's stay quantized as published (its experts compute and
page from those bytes), every other one is dequantized to the serving dtype here.  The
multi-token-prediction layers
of DeepSeek-V3 and GLM-4.5 (`num_nextn_predict_layers` layers numbered from num_hidden_layers
on) are skipped with one log line.

`load_engine_model` is what an `EngineCore` loads: the model its `EngineConfig` asks for, with
every kernel choice made once, here, at start-up (attention backend, fused-MoE kernel), and
with paged experts their slots checked and their prefetcher set.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from engine.attention import TorchAttention, select_attention
from engine.checkpoint import CheckpointError, iter_tensors, weight_files
from engine.config import EngineConfig, ModelConfig
from engine.experts import check_independence, paged_factory, prefetch_default
from engine.models import kernel_variants, spec_for
from engine.models.decoder import DecoderModel
from engine.models.weights import ExpertsFactory
from engine.moe import select_moe_kernel
from engine.quant.dense import QuantLinear
from engine.quant.formats import LinearFormat, format_named, quant_config
from engine.quant.load import LoadedTensors, QuantParts, dims, grouped, items

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PROGRESS_MIN_TENSORS = 2000
WEIGHT_ALIGNMENT = 64  # bytes; torch's CPU allocator gives 64, CUDA's caching allocator 512
LAYER = re.compile(r"^model\.layers\.(\d+)\.")

log = logging.getLogger(__name__)


def load_engine_model(config: EngineConfig, cfg: ModelConfig, attention: str | None = None) -> DecoderModel:
    """The model of checkpoint `config.model` (its config.json read as `cfg`) on
    `config.device`, its kernels chosen once: the attention backend (`attention` forces one;
    `model.attention.name` says which), the fused-MoE kernel, and with paged experts
    (`config.paged_experts_num_resident`) each layer's slots, checked by paging every expert
    through one, and the prefetcher (default: on CUDA).  Raises CheckpointError naming the
    tensor, ExpertCheckError when the check of paged experts fails."""
    device, k = config.device, config.paged_experts_num_resident
    variants = kernel_variants(cfg)
    attn = select_attention(device, config.page_size, attention, variants)
    quant = quant_config(cfg.raw)
    triton_moe = select_moe_kernel(device, clamped="clamped_swiglu" in variants,
                                   expert_format=quant.format if quant is not None else None)
    cuda = torch.device(device).type == "cuda"
    keep_dense = cuda if config.keep_dense_quantized is None else config.keep_dense_quantized
    if keep_dense and cuda:
        import engine.kernels.triton.quant_linear  # noqa: F401  (registers tandem::quant_linear)
    model = load_model(Path(config.model), cfg, config.torch_dtype, device, attn, moe_triton=triton_moe,
                       make_experts=paged_factory(k, device, triton_moe) if k is not None else None,
                       keep_dense_quantized=keep_dense)
    if k is not None:
        for layer, experts in model.paged_experts().items():
            check_independence(experts.slots, layer)
        prefetch = config.paged_experts_prefetch
        model.prefetch_experts = prefetch_default(device) if prefetch is None else prefetch
    return model


def load_model(path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device,
               attention: TorchAttention, progress: bool | None = None,
               make_experts: ExpertsFactory | None = None, moe_triton: bool = False,
               keep_dense_quantized: bool = False) -> DecoderModel:
    """Read every tensor, check its name and shape, copy it in `dtype` to `device`, fuse.

    With `make_experts` (paged experts) the expert tensors stay in host memory and the
    factory builds each layer's experts from them.

    Quantized linears: routed experts kept as published (in `loaded.quantized`); with
    `keep_dense_quantized` every other one too (`loaded.dense`: the family keeps those it computes
    through engine.quant.dense.linear, and gets the rest dequantized), else the rest dequantized
    to `dtype`; multi-token-prediction layers are
    skipped (one log line says how many tensors); the tensors the family's `keeps_fp32(name)`
    names (grouped routers) are copied in float32.

    Raises CheckpointError naming the tensor (and both shapes) when a tensor is missing,
    misshapen, of an unsupported dtype, not part of the architecture, or a float8 weight
    without its scale (or a scale without its weight).
    """
    spec = spec_for(cfg.architecture)
    expected = spec.expected_tensors(cfg)
    fmt = linear_format(cfg.raw)
    # grouped sigmoid routers (GLM-4.5, DeepSeek-V3) stay in fp32 whatever the serving dtype, as
    # in transformers: their correction bias decides near-ties
    keeps_fp32 = getattr(spec, "keeps_fp32", None) or (lambda name: False)
    transposed = getattr(spec, "TRANSPOSED_EXPERTS", False)  # gpt-oss: dense experts stored [E, in, out]
    total = items((n for n in weight_files(path) if mtp_layer(cfg, n) is None), fmt)
    show = progress if progress is not None else total >= PROGRESS_MIN_TENSORS
    skipped: Counter[int] = Counter()
    loaded = LoadedTensors(dtype)
    for name, item in tqdm(grouped(without_mtp(cfg, iter_tensors(path), skipped), fmt), total=total,
                           desc="loading weights", unit="tensor", disable=not show):
        if isinstance(item, QuantParts):
            name = item.dense_name(expected)
            expert = spec.is_routed_expert(name)
            lead, item.out, item.in_ = dims(expected[name], transposed and expert)
            fmt.check(item.base, item.parts, item.out, item.in_, lead)
            if expert:  # kept as published: the experts compute (and page) from these bytes
                place = "cpu" if make_experts is not None else device
                item.parts = {s: owned_copy(t, t.dtype, place) for s, t in item.parts.items()}
                loaded.quantized[name] = item
                continue
            if keep_dense_quantized and not lead and not keeps_fp32(name):
                parts = {s: owned_copy(t, t.dtype, device) for s, t in item.parts.items()}
                loaded.dense[name] = QuantLinear(fmt, parts, item.out, item.in_)
                continue
            dense = fmt.dequantize(item.parts, item.out, item.in_)
            loaded[name] = owned_copy(dense, torch.float32 if keeps_fp32(name) else dtype, device)
            continue
        tensor = item
        if name not in expected:
            if spec.ignorable(cfg, name):
                continue
            raise CheckpointError(f"unexpected tensor {name} (shape {list(tensor.shape)}) in {path}: "
                                  f"not part of {cfg.architecture} with this config.json")
        want = expected[name]
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"tensor {name} has shape {list(tensor.shape)}, "
                                  f"config.json implies {list(want)}")
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise CheckpointError(f"tensor {name} has dtype {tensor.dtype}; supported: "
                                  "float32, bfloat16, float16 (quantized linears: in the format config.json's "
                                  "quantization_config names)")
        on_host = make_experts is not None and spec.is_routed_expert(name)  # the store is pinned once stacked
        loaded[name] = owned_copy(tensor, torch.float32 if keeps_fp32(name) else dtype, "cpu" if on_host else device)
    if skipped:
        layers = sorted(skipped)
        log.info("skipped %d tensors of %d multi-token-prediction layer%s (model.layers.%s): "
                 "the engine does not run them", sum(skipped.values()), len(layers),
                 "s" if len(layers) > 1 else "", ",".join(map(str, layers)))
    missing = [n for n in expected if n not in loaded and n not in loaded.quantized]   # `in` covers .dense
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]} (expected shape {list(expected[missing[0]])})"
                              f"{more} in {path}")
    return spec.assemble(cfg, loaded, attention, make_experts, moe_triton)


def linear_format(raw: dict) -> LinearFormat:
    """The format of the checkpoint's quantized linears, from config.json's quantization_config
    (block-wise fp8 when it has none: float8 weights with `_scale_inv` blocks, as DeepSeek
    writes them).  Raises CheckpointError naming a setting that is not supported."""
    q = quant_config(raw)
    return q.format if q is not None else format_named("fp8-block")


def mtp_layer(cfg: ModelConfig, name: str) -> int | None:
    """The multi-token-prediction layer `name` belongs to (layers num_hidden_layers ..
    num_hidden_layers + num_nextn_predict_layers - 1 of DeepSeek-V3 / GLM-4.5), or None."""
    extra = int(cfg.raw.get("num_nextn_predict_layers") or 0)
    m = LAYER.match(name) if extra else None
    if m is None:
        return None
    layer = int(m.group(1))
    return layer if cfg.num_hidden_layers <= layer < cfg.num_hidden_layers + extra else None


def without_mtp(cfg: ModelConfig, tensors: Iterator[tuple[str, torch.Tensor]], skipped: Counter[int]
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors` less those of multi-token-prediction layers (counted per layer in `skipped`)."""
    for name, tensor in tensors:
        layer = mtp_layer(cfg, name)
        if layer is None:
            yield name, tensor
        else:
            skipped[layer] += 1


def owned_copy(tensor: torch.Tensor, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """`tensor` cast to `dtype`, in a fresh allocation on `device` (never sharing the storage
    of `tensor`, even where `.to()` would return it as is), aligned to WEIGHT_ALIGNMENT.

    Raises RuntimeError when the allocator hands back memory that is not aligned."""
    out = torch.empty(tensor.shape, dtype=dtype, device=device)
    out.copy_(tensor)
    if out.data_ptr() % WEIGHT_ALIGNMENT:
        raise RuntimeError(f"allocator returned a {list(out.shape)} {dtype} tensor on {device} at "
                           f"{out.data_ptr():#x}, not {WEIGHT_ALIGNMENT}-byte aligned")
    return out
