"""Reading and writing checkpoints in the HF on-disk layout (safetensors).

A checkpoint directory holds `config.json` and either one `model.safetensors` or
several shards named by `model.safetensors.index.json` (`{"weight_map": {name: file}}`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


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
