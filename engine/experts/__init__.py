"""Paged experts: K of each MoE layer's E experts on the device, all E in a host store."""

from __future__ import annotations

import torch

from engine.experts.check import check_independence
from engine.experts.copy import CudaStreamCopy, DirectCopy, EmulatedLink
from engine.experts.paged import PagedExperts
from engine.experts.slots import ExpertSlots, LRUPolicy
from engine.experts.store import ExpertCounters, ExpertStore
from engine.kernels.fused_moe import ClampedSwiGLU
from engine.moe import ExpertsFactory
from engine.quant.stack import ExpertWeight, pinned

SUPPORTED_EXPERT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The devices (torch.cuda.get_device_name) on which `bench.experts --device cuda` measured paged
# experts faster with the next layer's prefetch than without: prefetch is on by default there
# only.  None yet: on an NVIDIA H200 (issue 23's check, the shipped model at K = 16) prefetch
# made batch 1 slower (0.77 of resident against 0.84) and batch 16 too (0.45 against 0.52).
PREFETCH_FASTER_ON: frozenset[str] = frozenset()

__all__ = ["CudaStreamCopy", "DirectCopy", "EmulatedLink", "ExpertCounters", "ExpertSlots",
           "ExpertStore", "LRUPolicy", "PagedExperts", "check_independence", "paged_factory",
           "prefetch_default", "validate_num_resident"]


def prefetch_default(device: torch.device | str) -> bool:
    """Whether paged experts prefetch by default on `device`: only a CUDA device listed in
    PREFETCH_FASTER_ON (a measured gain, written here, never timed at start-up)."""
    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.get_device_name(dev) in PREFETCH_FASTER_ON


def validate_num_resident(k: int | None, num_experts: int, top_k: int, dtype: torch.dtype) -> None:
    """Refuse settings paged experts cannot serve; the message names the setting."""
    if k is None:
        return
    if num_experts == 0:
        raise ValueError("paged_experts_num_resident is set but the model has no MoE layers")
    if not isinstance(k, int) or k < top_k:
        raise ValueError(f"paged_experts_num_resident={k} is below top_k={top_k}: one token needs "
                         f"{top_k} experts at once")
    if k > num_experts:
        raise ValueError(f"paged_experts_num_resident={k} is above the {num_experts} experts per layer")
    if dtype not in SUPPORTED_EXPERT_DTYPES:
        raise ValueError(f"paged experts compute in fp32, bf16 or fp16, not {dtype} (--dtype is the "
                         "compute dtype; quantized checkpoints page their experts as published)")


def paged_factory(num_resident: int, device: torch.device | str, triton: bool = False) -> ExpertsFactory:
    """A `make_experts` for the loader: each layer gets a host store (with the experts' biases
    and clamped activation where the family has them: gpt-oss), K slots on `device` (copies on
    a side CUDA stream on a GPU, direct copies elsewhere) and LRU eviction."""
    dev = torch.device(device)

    def make(layer: int, w13: ExpertWeight, w2: ExpertWeight, fingerprints: list[int], *,
             b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
             act: ClampedSwiGLU | None = None) -> PagedExperts:
        copier = CudaStreamCopy(dev) if dev.type == "cuda" else DirectCopy()
        if dev.type == "cuda":  # page-locked, so copies are true async DMA
            w13, w2 = pinned(w13), pinned(w2)
            if b13 is not None and b2 is not None:
                b13, b2 = b13.pin_memory(), b2.pin_memory()
        store = ExpertStore(w13, w2, fingerprints, b13=b13, b2=b2, act=act)
        return PagedExperts(ExpertSlots(store, num_resident, dev, copier=copier), triton=triton)
    return make
