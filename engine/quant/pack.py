"""Writing a quantized copy of a plain checkpoint, in a published layout (round to nearest).

`quantize_checkpoint` is what `tandem quantize`, the benchmarks and the tests use to make
checkpoints in every format the loader reads: the chosen linears are replaced by their
format's parts (`{base}.qweight`, `{base}.scales`, ...), config.json gains the format's
`quantization_config`, and every other file (tokenizer, generation config) is copied.  The
embeddings, the LM head, norms and routers stay as they are, as published checkpoints keep them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from engine.checkpoint import INDEX_FILE, iter_tensors, save_checkpoint
from engine.config import ModelConfig
from engine.models import spec_for
from engine.quant.formats import LinearFormat, quantization_config_for

KEEP_PLAIN = ("embed_tokens.", "lm_head.", ".mlp.gate.weight", ".mlp.router.", "norm.")


def quantizable(name: str, tensor: torch.Tensor, routed: bool, experts_only: bool, transposed: bool) -> bool:
    """Whether `name` is a linear weight a quantized checkpoint stores quantized: a 2-D `.weight`
    outside embeddings, LM head, norms and routers (only routed experts' with `experts_only`),
    or a family's stacked expert weight [E, in, out] (`transposed`: gpt-oss)."""
    if any(k in name for k in KEEP_PLAIN) or (experts_only and not routed):
        return False
    if name.endswith(".weight") and tensor.dim() == 2:
        return True
    return transposed and routed and tensor.dim() == 3 and not name.endswith("_bias")


def quantize_checkpoint(src: str | Path, dst: str | Path, fmt: LinearFormat, experts_only: bool = True) -> int:
    """Write `src`'s checkpoint to `dst` with its routed experts' linears (all quantizable
    linears unless `experts_only`) stored in `fmt`.  Returns how many linears were quantized.
    Raises CheckpointError (from the format) when a linear's shape does not fit the format."""
    src, dst = Path(src), Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    raw = json.loads((src / "config.json").read_text())
    spec = spec_for(ModelConfig.from_dict(raw).architecture)
    transposed = getattr(spec, "TRANSPOSED_EXPERTS", False)
    out: dict[str, torch.Tensor] = {}
    count = 0
    for name, tensor in iter_tensors(src):
        routed = spec.is_routed_expert(name)
        if not quantizable(name, tensor, routed, experts_only, transposed):
            out[name] = tensor
            continue
        dense = tensor.float().transpose(-1, -2) if tensor.dim() == 3 else tensor.float()   # [..., out, in]
        base = name.removesuffix(".weight")
        out.update({base + suffix: part for suffix, part in fmt.quantize(dense).items()})
        count += 1
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty: write the quantized copy to a new directory")
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))   # renamed into place when complete
    try:
        save_checkpoint(tmp, out, {**raw, "quantization_config": quantization_config_for(fmt)})
        for extra in src.iterdir():
            if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json", INDEX_FILE):
                shutil.copy2(extra, tmp / extra.name)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)       # mkdtemp's 0700 would hide the model from other users
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return count
