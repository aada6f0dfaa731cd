"""What paged experts cost and buy on a device, before anything is loaded.

`preflight(...)` reads only config.json: every size comes from the architecture's family
module (its expected tensors and which of them are routed experts) and, for a quantized
checkpoint, its format (engine/quant/formats.py): routed experts are sized, held and paged in
their quantized bytes, the quantized attention and dense-MLP linears too where they are kept so
(`keep_dense_quantized`, the default on CUDA), every other weight at the serving dtype, the
KV bytes per token from the model's KV geometry (K and V per KV head, or one MLA latent row),
and the link speed from a measured copy.  Everything that is not a routed expert (attention,
embeddings, dense layers, routers, shared experts) stays resident on the device.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, TypedDict

import torch

from engine.config import EngineConfig, ModelConfig, parse_dtype
from engine.models import spec_for
from engine.options import default_of
from engine.quant.dense import is_kept_linear, not_converted
from engine.quant.formats import LinearFormat, quant_config
from engine.quant.load import dims

PROBE_BYTES = 256 << 20


class PreflightReport(TypedDict):
    """What `preflight` returns (sizes in bytes unless named otherwise)."""
    model: str
    dtype: str
    checkpoint_quantization: str | None
    expert_format: str
    dense_kept_quantized: bool
    device: str
    memory_gib: float
    num_experts: int
    top_k: int
    moe_layers: int
    kv_geometry: list[int]
    bytes_per_expert: int
    slot_cost_bytes: int
    slot_cost_kv_tokens: int
    kv_bytes_per_token: int
    non_expert_bytes: int
    host_store_bytes: int
    max_k_in_budget: int
    link_bytes_per_s: float
    link_measured_by: str
    target_tok_s: float
    max_miss_rate_for_target: float
    concurrency: int
    recommended_k: int
    single_wave_batch_cap: int
    kv_cache_tokens_at_recommended_k: int
    kv_cache_tokens_at_top_k: int


def measure_link(device: str, nbytes: int = PROBE_BYTES, repeats: int = 3) -> tuple[float, str]:
    """Host-to-device bytes/s: a pinned copy on CUDA, a memcpy between host buffers elsewhere."""
    dev = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8)
    if dev.type == "cuda":
        if dev.index is not None:
            torch.cuda.set_device(dev)  # the events below time the current device's stream
        src = src.pin_memory()
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        best = math.inf
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        return nbytes / best, "pinned host-to-device copy"
    src.fill_(1)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best, "host memcpy (no accelerator: not a PCIe figure)"


def preflight(model: str | Path, memory_gib: float, dtype: str = "bfloat16", device: str = "cpu",
              target_tok_s: float = 50.0, concurrency: int = 8, link_bytes_per_s: float | None = None,
              page_size: int = default_of(EngineConfig, "page_size"),
              keep_dense_quantized: bool | None = None) -> PreflightReport:
    """Sizes, costs and a recommended K.  `keep_dense_quantized` as EngineConfig's (None: on for a
    CUDA device): the quantized attention and dense-MLP linears sized in the checkpoint's format.
    Raises ValueError when the budget cannot hold the non-expert weights plus top_k slots per layer."""
    loaded = ModelConfig.from_path(model)
    # sized as served: routed experts in the checkpoint's quantized format, everything else at
    # `dtype` (the loader dequantizes the rest)
    quant = quant_config(loaded.raw)
    fmt = quant.format if quant is not None else None
    cfg = ModelConfig.from_dict({k: v for k, v in loaded.raw.items() if k != "quantization_config"})
    if not cfg.moe_layers:
        raise ValueError(f"{model} has no MoE layers: nothing to page")
    elt = torch.empty((), dtype=parse_dtype(dtype)).element_size()
    family = spec_for(cfg.architecture)
    shapes = family.expected_tensors(cfg)
    layers = len(cfg.moe_layers)
    expert_bytes = routed_bytes(family, shapes, fmt, elt) // (cfg.num_experts * layers)
    keeps_fp32 = getattr(family, "keeps_fp32", None) or (lambda name: False)  # loaded in fp32, as served
    keep = device.startswith("cuda") if keep_dense_quantized is None else keep_dense_quantized
    skip = quant.not_converted if quant is not None else ()

    kept = {n for n in shapes if fmt is not None and keep and not family.is_routed_expert(n)
            and is_kept_linear(n) and not not_converted(n, skip)}    # held as published on the device
    dense_bytes = sum(fmt.nbytes(*s) if n in kept and fmt is not None else math.prod(s) * (4 if keeps_fp32(n) else elt)
                      for n, s in shapes.items() if not family.is_routed_expert(n))
    slot_bytes = expert_bytes * layers  # one more resident expert in every MoE layer
    kv_bytes_per_token = cfg.kv_bytes_per_token(elt)
    budget = int(memory_gib * (1 << 30))
    k_min, e, top_k = cfg.num_experts_per_tok, cfg.num_experts, cfg.num_experts_per_tok
    k_fit = (budget - dense_bytes - kv_bytes_per_token * page_size) // slot_bytes
    if k_fit < k_min:
        raise ValueError(f"{memory_gib} GiB cannot hold the {_size(dense_bytes)} of non-expert weights "
                         f"plus top_k={top_k} experts per layer ({_size(k_min * slot_bytes)}); raise --memory-gib")
    if link_bytes_per_s is None:
        link_bytes_per_s, link_how = measure_link(device)
    else:
        link_how = "given"
    recommended = min(e, max(k_min, concurrency * top_k), int(k_fit))
    per_token_all = top_k * layers * expert_bytes  # bytes if every routed expert missed
    max_miss = min(1.0, link_bytes_per_s / (target_tok_s * per_token_all))
    kv_left = budget - dense_bytes - recommended * slot_bytes
    kv_left_top_k = budget - dense_bytes - top_k * slot_bytes
    return {
        "model": str(model), "dtype": dtype,
        "checkpoint_quantization": quant.describe() if quant is not None else None,
        "expert_format": fmt.describe() if fmt is not None else dtype,
        "dense_kept_quantized": bool(kept),
        "device": device, "memory_gib": memory_gib,
        "num_experts": e, "top_k": top_k, "moe_layers": layers, "kv_geometry": list(cfg.kv_geometry),
        "bytes_per_expert": expert_bytes, "slot_cost_bytes": slot_bytes,
        "slot_cost_kv_tokens": slot_bytes // kv_bytes_per_token,
        "kv_bytes_per_token": kv_bytes_per_token, "non_expert_bytes": dense_bytes,
        "host_store_bytes": e * slot_bytes, "max_k_in_budget": int(min(k_fit, e)),
        "link_bytes_per_s": link_bytes_per_s, "link_measured_by": link_how,
        "target_tok_s": target_tok_s, "max_miss_rate_for_target": max_miss,
        "concurrency": concurrency, "recommended_k": recommended,
        "single_wave_batch_cap": recommended // top_k,
        "kv_cache_tokens_at_recommended_k": max(0, kv_left) // kv_bytes_per_token,
        "kv_cache_tokens_at_top_k": max(0, kv_left_top_k) // kv_bytes_per_token,
    }


def routed_bytes(family: Any, shapes: dict[str, tuple[int, ...]], fmt: LinearFormat | None, elt: int) -> int:
    """All routed experts' bytes as held: each linear weight in `fmt` (when the checkpoint is
    quantized), every other routed tensor (gpt-oss's biases) at `elt` bytes an element."""
    transposed = getattr(family, "TRANSPOSED_EXPERTS", False)
    total = 0
    for name, shape in shapes.items():
        if not family.is_routed_expert(name):
            continue
        linear = (name.endswith(".weight") and len(shape) == 2) or (transposed and len(shape) == 3)
        if fmt is not None and linear:
            lead, out, in_ = dims(shape, transposed)
            total += math.prod(lead) * fmt.nbytes(out, in_)
        else:
            total += math.prod(shape) * elt
    return total


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def render(r: PreflightReport) -> str:
    quant = r["checkpoint_quantization"]
    return "\n".join(([] if quant is None else [
        f"the checkpoint is quantized ({quant}): routed experts are held and paged as {r['expert_format']}, "
        + ("its quantized attention and dense-MLP linears held as published, every other weight"
           if r["dense_kept_quantized"] else "every other weight") + f" is served at {r['dtype']}"]) + [
        f"model {r['model']} ({r['dtype']}): {r['num_experts']} experts x {r['moe_layers']} MoE layers, "
        f"top_k {r['top_k']}",
        f"one expert: {_size(r['bytes_per_expert'])}; one slot in every layer: "
        f"{_size(r['slot_cost_bytes'])} = {r['slot_cost_kv_tokens']:,} KV-cache tokens",
        f"non-expert weights on the device (attention, embeddings, dense layers, routers, shared "
        f"experts): {_size(r['non_expert_bytes'])}; host store for all routed experts: "
        f"{_size(r['host_store_bytes'])}",
        f"KV cache: {r['kv_bytes_per_token']:,} bytes per token ({_geometry(r['kv_geometry'])})",
        f"link: {r['link_bytes_per_s'] / 1e9:.2f} GB/s ({r['link_measured_by']})",
        f"at {r['target_tok_s']:g} tokens/s the link allows a miss rate of at most "
        f"{r['max_miss_rate_for_target']:.3f} (link time alone, compute not counted)",
        f"for {r['concurrency']} concurrent requests: K = {r['recommended_k']} "
        f"(K >= batch x top_k; at most {r['max_k_in_budget']} fit in {r['memory_gib']:g} GiB); "
        f"one wave serves up to {r['single_wave_batch_cap']} requests",
        f"KV cache left at that K: {r['kv_cache_tokens_at_recommended_k']:,} tokens "
        f"(at K = top_k: {r['kv_cache_tokens_at_top_k']:,})",
    ])


def _geometry(g: list[int]) -> str:
    c, h, d = g
    if c == 1:
        return f"one latent row of {d} values per layer"
    return f"K and V of {h} KV heads x {d} per layer"
