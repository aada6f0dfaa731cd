"""Reading and writing checkpoints in the HF on-disk layout (safetensors).

A checkpoint directory holds `config.json` and either one `model.safetensors` or
several shards named by `model.safetensors.index.json` (`{"weight_map": {name: file}}`).

Block-wise FP8 checkpoints (DeepSeek-V3, Kimi-K2, GLM-4.5-FP8: config.json
`quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}`) store a
Linear weight W [..., N, K] as float8_e4m3fn beside `<name>_scale_inv` S
[..., ceil(N / bn), ceil(K / bk)] (fp32); the real weight is

    W[..., r, c] = float(W8[..., r, c]) * S[..., r // bn, c // bk]

(the last blocks of a row or column are cropped).  `dequantized` pairs each weight with its
scale and yields that product in fp32; the loader casts it to the serving dtype.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"
DEFAULT_FP8_BLOCK = (128, 128)


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or malformed."""


def weight_files(path: str | Path) -> dict[str, Path]:
    """Map every tensor name to the file that holds it.

    Raises CheckpointError when neither a single file nor an index is present, or
    when the index names a shard that does not exist.
    """
    root = Path(path)
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: root / fname for name, fname in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(f"{index} names shard {shard.name}, which does not exist")
        return files
    single = root / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root}")


def iter_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor, one shard open at a time."""
    by_file: dict[Path, list[str]] = {}
    for name, file in weight_files(path).items():
        by_file.setdefault(file, []).append(name)
    for file in sorted(by_file):
        with safe_open(str(file), framework="pt") as f:
            for name in sorted(by_file[file]):
                yield name, f.get_tensor(name)


def save_checkpoint(path: str | Path, tensors: dict[str, torch.Tensor], config: dict,
                    max_shard_bytes: int | None = None) -> None:
    """Write `config.json` and the tensors (sharded above `max_shard_bytes`).

    Files are written under temporary names and renamed into place, so a failed
    write leaves no half-written checkpoint behind.
    """
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    shards = _plan_shards(tensors, max_shard_bytes)
    written: list[tuple[Path, Path]] = []
    if len(shards) == 1:
        written.append(_write_tmp(root / SINGLE_FILE, shards[0], tensors))
    else:
        weight_map = {}
        for i, names in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            written.append(_write_tmp(root / fname, names, tensors))
            weight_map.update({n: fname for n in names})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        written.append(_write_text_tmp(root / INDEX_FILE, json.dumps(index, indent=2)))
    written.append(_write_text_tmp(root / "config.json", json.dumps(config, indent=2)))
    for tmp, final in written:
        os.replace(tmp, final)


def _plan_shards(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> list[list[str]]:
    if max_bytes is None:
        return [sorted(tensors)]
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_tmp(final: Path, names: list[str], tensors: dict[str, torch.Tensor]) -> tuple[Path, Path]:
    tmp = final.with_name(final.name + ".tmp")
    save_file({n: tensors[n] for n in names}, str(tmp), metadata={"format": "pt"})
    return tmp, final


def _write_text_tmp(final: Path, text: str) -> tuple[Path, Path]:
    tmp = final.with_name(final.name + ".tmp")
    tmp.write_text(text + "\n")
    return tmp, final


def fp8_block(raw: dict) -> tuple[int, int]:
    """The [rows, cols] block of a config.json's block-wise FP8 `quantization_config` (DeepSeek's
    128 x 128 when it names none).  Raises CheckpointError for another quantization method:
    only block-wise FP8 is dequantized at load."""
    q = raw.get("quantization_config") or {}
    method = q.get("quant_method")
    if method not in (None, "fp8"):
        raise CheckpointError(f"config.json quantization_config.quant_method={method!r} is not supported: "
                              f"the loader dequantizes block-wise fp8 only; use a bf16 (or fp8) checkpoint")
    block = q.get("weight_block_size") or DEFAULT_FP8_BLOCK
    if len(block) != 2 or min(block) < 1:
        raise CheckpointError(f"config.json quantization_config.weight_block_size={block}: expected [rows, cols]")
    return int(block[0]), int(block[1])


def dequantize_fp8(name: str, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """`weight` (float8, [..., N, K]) times its block scales `scale_inv` ([..., ceil(N/bn),
    ceil(K/bk)], or one per-tensor value), in fp32.  Raises CheckpointError naming `name` when
    the scale's shape does not fit the weight's."""
    out = weight.to(torch.float32)
    scale = scale_inv.to(torch.float32)
    if scale.numel() == 1:
        return out.mul_(scale.reshape(()))
    bn, bk = block
    if weight.dim() < 2:
        raise CheckpointError(f"float8 tensor {name} of shape {list(weight.shape)} has block scales "
                              f"{list(scale.shape)}: block-wise scales need a [..., rows, cols] weight")
    rows, cols = weight.shape[-2:]
    want = (*weight.shape[:-2], -(-rows // bn), -(-cols // bk))
    if tuple(scale.shape) != want:
        raise CheckpointError(f"{name}{SCALE_SUFFIX} has shape {list(scale.shape)}; the {list(weight.shape)} "
                              f"weight in {bn}x{bk} blocks needs {list(want)}")
    full = scale.repeat_interleave(bn, dim=-2)[..., :rows, :].repeat_interleave(bk, dim=-1)[..., :cols]
    return out.mul_(full)


def dequantized(tensors: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int]
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors` with every float8 weight replaced by its fp32 dequantization (its
    `<name>_scale_inv` consumed), in any order the two arrive.  Other tensors pass unchanged.
    Raises CheckpointError, after the last tensor, naming a float8 weight without its scale or a
    scale without a float8 weight."""
    weights: dict[str, torch.Tensor] = {}     # float8 weights waiting for their scale
    scales: dict[str, torch.Tensor] = {}      # scales waiting for their weight
    for name, tensor in tensors:
        if name.endswith(SCALE_SUFFIX):
            base = name[:-len(SCALE_SUFFIX)]
            if base in weights:
                yield base, dequantize_fp8(base, weights.pop(base), tensor, block)
            else:
                scales[base] = tensor
        elif tensor.dtype in FP8_DTYPES:
            if name in scales:
                yield name, dequantize_fp8(name, tensor, scales.pop(name), block)
            else:
                weights[name] = tensor
        else:
            yield name, tensor
    if weights:
        name = sorted(weights)[0]
        more = f" (and {len(weights) - 1} more)" if len(weights) > 1 else ""
        raise CheckpointError(f"float8 tensor {name} has no {name}{SCALE_SUFFIX}{more}: "
                              f"cannot dequantize it")
    if scales:
        name = sorted(scales)[0]
        more = f" (and {len(scales) - 1} more)" if len(scales) > 1 else ""
        raise CheckpointError(f"scale {name}{SCALE_SUFFIX} has no float8 weight {name}{more}")
