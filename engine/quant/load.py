"""Reading a quantized checkpoint's linears as they stream in.

A quantized linear is stored as several tensors named `{base}{part}` (engine/quant/formats.py
`LinearFormat.parts`: `.qweight`, `.scales`, ... or `_blocks`, `_scales`).  `grouped` collects
each linear's parts and yields it once complete, as `QuantParts`, with every other tensor
passed through unchanged.  A `.weight` tensor belongs to a linear only in the float formats and
only when it is stored as float8 (an fp8 checkpoint keeps its norms, router and LM head in
bf16 under the same suffix).

The loader then keeps a routed expert's parts as published (experts page their quantized
bytes) and dequantizes every other quantized linear to the serving dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from engine.checkpoint import FP8_DTYPES, CheckpointError
from engine.quant.dense import QuantLinear
from engine.quant.formats import LinearFormat

WEIGHT = ".weight"


@dataclass
class QuantParts:
    """One quantized linear of the checkpoint: its parts by suffix (a routed expert's, or
    gpt-oss's experts stacked with a leading [E]), for a dense weight [..., out, in_] (the
    loader sets out and in_ once it has checked the parts against the architecture)."""
    fmt: LinearFormat
    base: str
    parts: dict[str, torch.Tensor]
    out: int = 0
    in_: int = 0

    def tensors(self) -> list[torch.Tensor]:
        """The parts in the format's order (the order an expert's fingerprint covers them)."""
        return [self.parts[s] for s in self.fmt.parts()]

    def dense_name(self, expected: Iterable[str]) -> str:
        """The name of the dense weight this linear stands for among `expected` names
        (`{base}.weight`, or `{base}` where the dense tensor has no suffix: gpt-oss's experts).
        Raises CheckpointError when neither is part of the architecture."""
        names = set(expected)
        for name in (self.base + WEIGHT, self.base):
            if name in names:
                return name
        part = next(iter(self.parts))
        raise CheckpointError(f"unexpected quantized tensor {self.base}{part}: no {self.base}{WEIGHT} in this "
                              "architecture")

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())


class LoadedTensors(dict[str, torch.Tensor]):
    """What the loader hands a family's `assemble`: the model's tensors by name; in `quantized`
    the routed experts' linears it keeps quantized, by the dense weight's name; in `dense` the
    other quantized linears it keeps as published (`keep_dense_quantized`), which a family takes
    with engine.quant.dense.take_linear.  A family that pops one of those as a plain tensor gets
    its dequantization in `dtype` (what the loader makes of every quantized dense linear
    otherwise), so only the linears a family computes through `linear` stay quantized."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.quantized: dict[str, QuantParts] = {}
        self.dense: dict[str, QuantLinear] = {}
        self.dtype = dtype

    def pop(self, name: str, *default: Any) -> Any:
        if name in self.dense:
            return self.dense.pop(name).dense(self.dtype)
        return super().pop(name, *default)

    def __contains__(self, name: object) -> bool:
        return super().__contains__(name) or name in self.dense


def _part_of(fmt: LinearFormat, name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
    """(base, suffix) when `name` is a part of a quantized linear in `fmt`, else None."""
    for suffix in sorted(fmt.parts(), key=len, reverse=True):
        if name.endswith(suffix):
            if suffix == WEIGHT and tensor.dtype not in FP8_DTYPES:
                return None     # a plain weight of a layer the checkpoint keeps unquantized
            return name[:-len(suffix)], suffix
    return None


def items(names: Iterable[str], fmt: LinearFormat) -> int:
    """How many items `grouped` yields for these tensor names (for a progress bar): one per
    quantized linear, found by its marker part, and one per other tensor."""
    extra = [s for s in fmt.parts() if s != fmt.marker]
    return sum(1 for n in names if not n.endswith(tuple(extra)))


def grouped(tensors: Iterable[tuple[str, torch.Tensor]], fmt: LinearFormat
            ) -> Iterator[tuple[str, torch.Tensor | QuantParts]]:
    """`tensors` with each quantized linear's parts gathered into one `QuantParts` (yielded
    under its base name once all its parts arrived), other tensors unchanged.  Raises
    CheckpointError, after the last tensor, naming a linear whose parts are incomplete."""
    want = set(fmt.parts())
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        hit = _part_of(fmt, name, tensor)
        if hit is None:
            yield name, tensor
            continue
        base, suffix = hit
        parts = waiting.setdefault(base, {})
        parts[suffix] = tensor
        if set(parts) == want:
            yield base, QuantParts(fmt, base, waiting.pop(base))
    if waiting:
        base = sorted(waiting)[0]
        have, more = sorted(waiting[base]), len(waiting) - 1
        missing = sorted(want - set(have))
        raise CheckpointError(f"quantized linear {base} ({fmt.describe()}) has {[base + s for s in have]} but no "
                              f"{[base + s for s in missing]}" + (f" (and {more} more incomplete)" if more else ""))


def dims(dense_shape: tuple[int, ...], transposed: bool) -> tuple[tuple[int, ...], int, int]:
    """(leading dims, out, in) of a dense weight's shape: [..., out, in], or [..., in, out] when
    the family stores it `transposed` (gpt-oss's bf16 experts)."""
    *lead, a, b = dense_shape
    return tuple(lead), (b if transposed else a), (a if transposed else b)
