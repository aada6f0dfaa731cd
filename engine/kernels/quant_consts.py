"""The Triton quantized-weight kernels' format constants, without importing Triton: each
published layout as the constexprs `weight_tile` reads (engine/kernels/triton/weight_tiles.py),
for the launchers and for the custom op's integer arguments (engine/quant/dense.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.quant.formats import LinearFormat

CODES = {"gptq": 1, "awq": 2, "ct-int": 3, "fp8-block": 4, "ct-fp8": 5, "mxfp4": 6}   # 0: a plain weight
CONST_NAMES = ("FMT", "BITS", "GROUP", "ZERO_ADD", "DESC_ACT", "SYM", "BLOCK_R", "BLOCK_C")


def format_consts(fmt: LinearFormat, in_: int) -> dict[str, int]:
    """The kernel's constexprs (CONST_NAMES, in order) for a linear of `in_` input columns in `fmt`."""
    return dict(FMT=CODES[fmt.name], BITS=fmt.bits, GROUP=in_ if fmt.group_size == -1 else fmt.group_size,
                ZERO_ADD=int(fmt.name == "gptq" and fmt.checkpoint_format == "gptq"),
                DESC_ACT=int(fmt.desc_act), SYM=int(fmt.sym), BLOCK_R=fmt.block[0], BLOCK_C=fmt.block[1])
