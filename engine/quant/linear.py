"""`LinearFormat`: how one quantized linear (dense weight [out, in_]) is stored, checked and dequantized.

A format names its parts (suffixes appended to the linear's base name, one stored tensor each),
their shapes and dtypes for a given [out, in_] (with optional leading dims, e.g. gpt-oss's stacked
experts), and a codec that turns the parts into a float32 [..., out, in_] weight and back.  The
codecs live in `int_codecs` (GPTQ, AWQ, compressed-tensors pack-quantized) and `float_codecs`
(block FP8, compressed-tensors FP8, MXFP4); this module only validates and dispatches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.checkpoint import CheckpointError
from engine.quant import float_codecs, int_codecs

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)   # what compressed-tensors scales may be


class Codec(Protocol):
    """One published layout.  `fmt` carries its settings (bits, group size ...)."""
    marker: str

    def parts(self, fmt: LinearFormat) -> tuple[str, ...]: ...

    def problem(self, fmt: LinearFormat, out: int, in_: int) -> str | None:
        """Why an [out, in_] linear cannot be stored in this layout, or None."""

    def shapes(self, fmt: LinearFormat, out: int, in_: int) -> Shapes: ...

    def dequantize(self, fmt: LinearFormat, parts: dict[str, torch.Tensor], out: int, in_: int
                   ) -> torch.Tensor: ...

    def quantize(self, fmt: LinearFormat, weight: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def describe(self, fmt: LinearFormat) -> str: ...


CODECS: dict[str, Codec] = {
    "fp8-block": float_codecs.FP8_BLOCK, "ct-fp8": float_codecs.CT_FP8, "mxfp4": float_codecs.MXFP4,
    "gptq": int_codecs.GPTQ, "awq": int_codecs.AWQ, "ct-int": int_codecs.CT_INT,
}
BITS = {"fp8-block": (8,), "ct-fp8": (8,), "mxfp4": (4,), "gptq": (4, 8), "awq": (4,), "ct-int": (4, 8)}
GROUPED = ("gptq", "awq", "ct-int")          # the formats whose `group_size` means something
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")      # GPTQ v1 stores zero - 1, v2 the zero itself
CT_FP8_STRATEGIES = ("channel", "tensor")
KNOWN: dict[str, "LinearFormat"] = {}          # every format made in this process, by its key


@dataclass(frozen=True)
class LinearFormat:
    """How one quantized linear (dense weight [out, in_]) is stored and dequantized.

    Fields that a format does not use keep their defaults:
      bits               gptq 4|8, ct-int 4|8; fixed for the others (awq 4, fp8 8, mxfp4 4)
      group_size         gptq, awq, ct-int: input columns per scale; -1 = one group per row
                         (ct-int's "channel" strategy)
      sym                gptq, ct-int (asymmetric ct-int stores weight_zero_point); awq is always asym
      desc_act           gptq: groups follow an activation order, read through g_idx
      checkpoint_format  gptq: "gptq" (v1, zeros stored minus one) or "gptq_v2"
      block              fp8-block: [rows, cols] of one weight_scale_inv entry
      strategy           ct-fp8: "channel" ([out, 1] scale) or "tensor" ([1])
      scale_dtype        ct-int, ct-fp8: the dtype quantize writes scales in (config.json does not
                         record it; `check` accepts bf16, fp16 and fp32)
    """
    name: str
    bits: int = 0                    # 0: the format's only (or first) width
    group_size: int = 128
    sym: bool = True
    desc_act: bool = False
    checkpoint_format: str = "gptq"
    block: tuple[int, int] = (128, 128)
    strategy: str = "channel"
    scale_dtype: torch.dtype = field(default=torch.bfloat16)
    key: str = field(init=False, repr=False, compare=False, default="")   # the settings, as one string

    def __post_init__(self) -> None:
        if self.name not in CODECS:
            raise CheckpointError(f"quantized linear format {self.name!r} is not supported "
                                  f"(supported: {', '.join(CODECS)})")
        if self.bits == 0:
            object.__setattr__(self, "bits", BITS[self.name][0])
        if self.bits not in BITS[self.name]:
            raise CheckpointError(f"{self.name} bits={self.bits} is not supported (supported: {BITS[self.name]})")
        if self.name in GROUPED and not (self.group_size == -1 or self.group_size > 0):
            raise CheckpointError(f"{self.name} group_size={self.group_size}: expected -1 or a positive size")
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise CheckpointError(f"gptq checkpoint_format={self.checkpoint_format!r} is not supported "
                                  f"(supported: {', '.join(CHECKPOINT_FORMATS)})")
        if len(self.block) != 2 or min(self.block) < 1:
            raise CheckpointError(f"fp8-block block={self.block}: expected [rows, cols] of positive sizes")
        if self.strategy not in CT_FP8_STRATEGIES:
            raise CheckpointError(f"ct-fp8 strategy={self.strategy!r} is not supported "
                                  f"(supported: {', '.join(CT_FP8_STRATEGIES)})")
        if self.scale_dtype not in SCALE_DTYPES:
            raise CheckpointError(f"scale_dtype={self.scale_dtype} is not supported (supported: {SCALE_DTYPES})")
        object.__setattr__(self, "key", repr(self))
        KNOWN.setdefault(self.key, self)

    @property
    def codec(self) -> Codec:
        return CODECS[self.name]

    def parts(self) -> tuple[str, ...]:
        """Suffixes appended to the linear's base name, one per stored tensor, in a fixed order."""
        return self.codec.parts(self)

    @property
    def marker(self) -> str:
        """The part whose presence says a linear is stored in this format (never ".weight")."""
        return self.codec.marker

    def part_shapes(self, out: int, in_: int, lead: tuple[int, ...] = ()) -> Shapes:
        """Shape (with leading dims `lead`) and dtype of each part a checkpoint holds for an [out, in_]
        linear.  Raises CheckpointError when the layout cannot store that size."""
        self._check_size(out, in_, "")
        return {sfx: ((*lead, *shape), dtype) for sfx, (shape, dtype) in self.codec.shapes(self, out, in_).items()}

    def check(self, base: str, parts: dict[str, torch.Tensor], out: int, in_: int,
              lead: tuple[int, ...] = ()) -> None:
        """Raise CheckpointError naming the tensor (base + suffix), its shape/dtype and what was expected,
        for a missing, extra, misshapen or wrongly typed part, or a size the layout cannot store."""
        self._check_size(out, in_, f"{base}{self.marker}: ")
        want = self.part_shapes(out, in_, lead)
        extra = sorted(set(parts) - set(want))
        if extra:
            raise CheckpointError(f"{base}{extra[0]} is not part of a {self.describe()} linear "
                                  f"(its parts: {', '.join(want)})")
        for sfx, (shape, dtype) in want.items():
            if sfx not in parts:
                raise CheckpointError(f"{base}{sfx} is missing: a {self.describe()} linear [{out}, {in_}] "
                                      f"needs {list(shape)} {dtype}")
            got = parts[sfx]
            if tuple(got.shape) != shape or got.dtype not in self._accepted(sfx, dtype):
                raise CheckpointError(f"{base}{sfx} is {list(got.shape)} {got.dtype}; a {self.describe()} "
                                      f"linear [{out}, {in_}] needs {list(shape)} {dtype}")

    def dequantize(self, parts: dict[str, torch.Tensor], out: int, in_: int) -> torch.Tensor:
        """float32 [..., out, in_] from parts that all carry the same leading dims.  Pure tensor ops
        (no host syncs), elementwise-exact: one expert's result does not depend on its batch."""
        return self.codec.dequantize(self, parts, out, in_)

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """weight [..., out, in_] (float) -> the published parts, rounding to nearest."""
        self._check_size(weight.shape[-2], weight.shape[-1], "")
        return self.codec.quantize(self, weight.float())

    def nbytes(self, out: int, in_: int) -> int:
        """Bytes of one linear's parts."""
        return sum(_numel(shape) * dtype.itemsize for shape, dtype in self.part_shapes(out, in_).values())

    def describe(self) -> str:
        """e.g. "gptq int4 g128 asym desc_act", "fp8-block 128x128", "mxfp4"."""
        return self.codec.describe(self)

    def _check_size(self, out: int, in_: int, prefix: str) -> None:
        problem = self.codec.problem(self, out, in_)
        if problem is not None:
            raise CheckpointError(f"{prefix}a {self.describe()} linear cannot be [{out}, {in_}]: {problem}")

    def _accepted(self, sfx: str, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        if self.name.startswith("ct-") and sfx == ".weight_scale":
            return SCALE_DTYPES
        if sfx == ".weight_shape":
            return (torch.int64, torch.int32)
        return (dtype,)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def format_named(name: str, **fields: object) -> LinearFormat:
    """A LinearFormat by name, e.g. format_named("gptq", bits=4, group_size=128, sym=False, desc_act=True).
    Raises CheckpointError for an unknown name or setting."""
    known = set(LinearFormat.__dataclass_fields__) - {"name"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise CheckpointError(f"format_named({name!r}): unknown setting(s) {unknown} (known: {sorted(known)})")
    if "block" in fields:
        fields["block"] = tuple(fields["block"])  # type: ignore[arg-type]
    return LinearFormat(name, **fields)  # type: ignore[arg-type]
