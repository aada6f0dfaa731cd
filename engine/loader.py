"""Load a HF-layout checkpoint into a runtime model, checking every tensor."""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from engine.checkpoint import CheckpointError, iter_tensors, weight_files
from engine.config import ModelConfig
from engine.attention import TorchAttention
from engine.models import spec_for

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PROGRESS_MIN_TENSORS = 2000


def load_model(path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device,
               attention: TorchAttention, progress: bool | None = None, make_experts=None,
               moe_triton: bool = False):
    """Read every tensor, check its name and shape, cast to `dtype` on `device`, fuse.

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
        if make_experts is not None and ".mlp.experts." in name:
            loaded[name] = tensor.to(dtype=dtype)  # host; the store is pinned once stacked
        else:
            loaded[name] = tensor.to(device=device, dtype=dtype)
    missing = [n for n in expected if n not in loaded]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]} (expected shape {list(expected[missing[0]])})"
                              f"{more} in {path}")
    return spec.assemble(cfg, loaded, attention, make_experts, moe_triton)
