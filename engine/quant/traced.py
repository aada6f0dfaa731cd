"""A quantized weight's dequantization inside a compiled graph.

Inductor's CPU code (torch 2.13) computes a per-element group index `c // G` along the
innermost, vectorized dimension wrongly when G is no multiple of its vector width: a block-FP8
weight in 48x40 blocks, dequantized inside the compiled decode step, came out as garbage (NaN
logits, token 0) while eager was exact, and which sizes break depends on the CPU's vector width.
So a layout whose groups split the input dimension at other than multiples of VECTOR_SAFE columns
dequantizes inside a graph through the opaque op `tandem::dequantize`, which runs the eager
codec; every other layout is traced and fused as it is (the published sizes: groups of 32, 64 or
128 and 128x128 blocks).  The choice is a function of the format and the shape alone, the same in
every process.
"""

from __future__ import annotations

import torch

from engine.quant.linear import KNOWN, LinearFormat

VECTOR_SAFE = 32        # columns: two AVX-512 vectors of fp32, one of bf16

def splits_vectors(fmt: LinearFormat, in_: int) -> bool:
    """Whether `fmt`'s groups (or blocks) split an input of `in_` columns inside a vector."""
    if fmt.name in ("gptq", "awq", "ct-int"):
        size = in_ if fmt.group_size == -1 else fmt.group_size
    elif fmt.name == "fp8-block":
        size = fmt.block[1]
    else:                   # ct-fp8: one scale per row or tensor; mxfp4: 32 values a scale
        return False
    return size < in_ and size % VECTOR_SAFE != 0


def dequantize(fmt: LinearFormat, parts: dict[str, torch.Tensor], out: int, in_: int) -> torch.Tensor:
    """`fmt.dequantize(parts, out, in_)`, through the opaque op when a compiled graph is being
    traced and the layout `splits_vectors`."""
    if not (torch.compiler.is_compiling() and splits_vectors(fmt, in_)):
        return fmt.dequantize(parts, out, in_)
    result: torch.Tensor = _dequantize_op([parts[s] for s in fmt.parts()], fmt.key, out, in_)
    return result


# registered at import: creating an op while dynamo traces is not traceable
@torch.library.custom_op("tandem::dequantize", mutates_args=())
def _dequantize_op(parts: list[torch.Tensor], fmt: str, out: int, in_: int) -> torch.Tensor:
    f = KNOWN[fmt]
    return f.dequantize(dict(zip(f.parts(), parts)), out, in_).contiguous()


@_dequantize_op.register_fake
def _(parts: list[torch.Tensor], fmt: str, out: int, in_: int) -> torch.Tensor:
    return parts[0].new_empty((*parts[0].shape[:-2], out, in_), dtype=torch.float32)
