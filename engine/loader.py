"""Load a HF-layout checkpoint into a runtime model, checking every tensor.

Every tensor is copied once, here, into memory the engine allocates: the model never holds a
view into the memory-mapped file.  Such a view sits at the tensor's offset in the file, so its
alignment (and with it the order in which MKL's SGEMM sums) would depend on how the checkpoint
happens to be sharded, and rewriting the file would change the live weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from engine.attention import TorchAttention
from engine.checkpoint import CheckpointError, iter_tensors, weight_files
from engine.config import ModelConfig
from engine.models import spec_for
from engine.models.decoder import DecoderModel
from engine.models.weights import ExpertsFactory

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PROGRESS_MIN_TENSORS = 2000
WEIGHT_ALIGNMENT = 64  # bytes; torch's CPU allocator gives 64, CUDA's caching allocator 512


def load_model(path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device,
               attention: TorchAttention, progress: bool | None = None,
               make_experts: ExpertsFactory | None = None, moe_triton: bool = False) -> DecoderModel:
    """Read every tensor, check its name and shape, copy it in `dtype` to `device`, fuse.

    With `make_experts` (paged experts) the expert tensors stay in host memory and the
    factory builds each layer's experts from them.

    Raises CheckpointError naming the tensor (and both shapes) when a tensor is missing,
    misshapen, of an unsupported dtype, or not part of the architecture.
    """
    spec = spec_for(cfg.architecture)
    expected = spec.expected_tensors(cfg)
    total = len(weight_files(path))
    show = progress if progress is not None else total >= PROGRESS_MIN_TENSORS
    loaded: dict[str, torch.Tensor] = {}
    for name, tensor in tqdm(iter_tensors(path), total=total, desc="loading weights",
                             unit="tensor", disable=not show):
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
                                  "float32, bfloat16, float16")
        on_host = make_experts is not None and ".mlp.experts." in name  # the store is pinned once stacked
        loaded[name] = owned_copy(tensor, dtype, "cpu" if on_host else device)
    missing = [n for n in expected if n not in loaded]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]} (expected shape {list(expected[missing[0]])})"
                              f"{more} in {path}")
    return spec.assemble(cfg, loaded, attention, make_experts, moe_triton)


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
