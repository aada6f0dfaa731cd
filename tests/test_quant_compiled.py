"""Quantized expert weights inside a compiled step (torch.compile, inductor on the CPU: the
compiled decode step, which `tandem serve` runs by default) dequantize to the eager codec's
values bit for bit, at shapes whose last group or block is partial.

Inductor's CPU code (torch 2.13) vectorizes a per-element scale index c // block wrongly where the
block is no multiple of its vector width: with block-FP8 scales expanded that way, the compiled
decode step of a checkpoint in 48x40 blocks served garbage (NaN, token 0) while every eager test
passed.  Such layouts now dequantize through an opaque op inside a graph (engine/quant/traced.py);
the cases below take both paths (groups of 16 and 48x40 blocks the op, groups of 32, channels and
128x128 blocks the fused code)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kernels.fused_moe import gathered_all
from engine.quant import LinearFormat, format_named
from engine.quant.stack import JoinedRows, QuantStack
from engine.quant.traced import dequantize

# (format, H, I): I or H not a multiple of the group or block, so the last one is partial
CASES = [
    (format_named("fp8-block", block=(48, 40)), 64, 32),
    (format_named("fp8-block", block=(128, 128)), 64, 44),
    (format_named("gptq", bits=4, group_size=32), 72, 40),
    (format_named("gptq", bits=4, group_size=16, sym=False, desc_act=True), 72, 40),
    (format_named("gptq", bits=8, group_size=-1, checkpoint_format="gptq_v2"), 64, 40),
    (format_named("awq", group_size=16), 64, 32),
    (format_named("ct-int", bits=4, group_size=16, sym=False), 64, 48),
    (format_named("ct-int", bits=4, group_size=-1), 64, 20),
    (format_named("ct-fp8", strategy="channel"), 64, 20),
    (format_named("ct-fp8", strategy="tensor"), 64, 20),
    (format_named("mxfp4"), 64, 32),
]


@pytest.mark.parametrize("fmt,h,i", CASES, ids=[f"{f.describe()} H{h} I{i}" for f, h, i in CASES])
def test_compiled_dequantization_equals_the_eager_one(fmt: LinearFormat, h: int, i: int) -> None:
    gen = torch.Generator().manual_seed(h + i)
    e = 6
    gate, up = (QuantStack(fmt, fmt.quantize(torch.randn(e, i, h, generator=gen) * h ** -0.5), i, h) for _ in "gu")
    w2 = QuantStack(fmt, fmt.quantize(torch.randn(e, h, i, generator=gen) * i ** -0.5), h, i)
    w13 = JoinedRows([gate, up])
    x = torch.randn(3, h, generator=gen)
    ids = torch.tensor([[0, 5], [3, 3], [4, 1]])
    flat = ids.reshape(-1)
    for w in (gate, w2, w13):
        torch._dynamo.reset()
        want = w.at(flat)
        got = torch.compile(lambda idx, w=w: w.at(idx), fullgraph=True)(flat)
        assert torch.equal(got, want), f"{fmt.describe()}: compiled differs by {(got - want).abs().max()}"
    torch._dynamo.reset()
    want = gathered_all(x, w13, w2, ids)
    got = torch.compile(gathered_all, fullgraph=True)(x, w13, w2, ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt,h,i", CASES, ids=[f"{f.describe()} H{h} I{i}" for f, h, i in CASES])
def test_a_dense_linear_dequantizes_compiled_as_eager(fmt: LinearFormat, h: int, i: int) -> None:
    """One [out, in] linear, no expert dim (an attention projection kept quantized)."""
    for out, in_ in ((i, h), (h, i)):
        parts = fmt.quantize(torch.randn(out, in_, generator=torch.Generator().manual_seed(out)) * in_ ** -0.5)
        torch._dynamo.reset()
        want = fmt.dequantize(parts, out, in_)
        got = torch.compile(lambda p: dequantize(fmt, p, out, in_), fullgraph=True)(parts)
        assert torch.equal(got, want), f"{fmt.describe()} [{out}, {in_}]: compiled differs"


def test_an_fp8_checkpoint_decodes_compiled_as_it_does_eager(tmp_path: Path) -> None:
    from engine import LLM
    from engine.quant.pack import quantize_checkpoint
    from tests.checkpoints import write_random_checkpoint
    from tests.test_quant_experts import PARAMS, assert_same, prompts
    quantized = tmp_path / "q"
    quantize_checkpoint(write_random_checkpoint(tmp_path / "plain"), quantized, CASES[0][0], experts_only=False)
    eager = LLM(quantized).generate(prompts(), PARAMS)
    compiled = LLM(quantized, compile=True, compile_buckets=(1, 4)).generate(prompts(), PARAMS)
    assert_same(compiled, eager, "fp8-block 48x40 compiled against eager")


def test_which_layouts_dequantize_through_the_opaque_op() -> None:
    from engine.quant.traced import splits_vectors
    assert splits_vectors(format_named("fp8-block", block=(48, 40)), 64)
    assert splits_vectors(format_named("gptq", group_size=16), 64)
    assert not splits_vectors(format_named("gptq", group_size=128), 2048)
    assert not splits_vectors(format_named("gptq", group_size=128), 64)       # one group: nothing split
    assert not splits_vectors(format_named("ct-int", group_size=-1), 20)
    assert not splits_vectors(format_named("fp8-block"), 7168)
    assert not splits_vectors(format_named("mxfp4"), 2880)
