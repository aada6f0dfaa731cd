"""The Triton linear over quantized weights (engine/kernels/triton/quant_linear.py, through its
custom op and engine.quant.dense.kernel_linear) against F.linear over the codec's dequantization.

Both sides dequantize every element to the same value, so in fp32 they differ only by the
matmul's summation order (1e-5); a row's result does not depend on the other rows of the call
(bit for bit); a joined linear (q, k, v of one input, one of them plain) equals its parts side by
side.  Odd sizes leave partial FP8 blocks, a partial compressed-tensors word and edge tiles.

Without a GPU the cases run in one child Python under the Triton interpreter (this file run as a
script; see tests/kernel_harness.py), with CUDA in-process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # the child: set before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

# (name, format settings, M, out, in, dtype)
CASES = [
    ("gptq4_g16_asym_desc_act", dict(name="gptq", bits=4, group_size=16, sym=False, desc_act=True),
     5, 48, 64, "float32"),
    ("gptq8_channel_v2", dict(name="gptq", bits=8, group_size=-1, checkpoint_format="gptq_v2"),
     3, 40, 32, "float32"),
    ("awq4_g16", dict(name="awq", group_size=16), 17, 72, 48, "float32"),
    ("ct_int4_g16_asym", dict(name="ct-int", bits=4, group_size=16, sym=False), 5, 36, 64, "float32"),
    ("ct_int4_channel_in20", dict(name="ct-int", bits=4, group_size=-1), 5, 24, 20, "float32"),
    ("fp8_block_48x40", dict(name="fp8-block", block=(48, 40)), 9, 100, 72, "float32"),
    ("ct_fp8_channel", dict(name="ct-fp8", strategy="channel"), 5, 30, 44, "float32"),
    ("ct_fp8_tensor", dict(name="ct-fp8", strategy="tensor", scale_dtype=torch.float32), 5, 30, 44, "float32"),
    ("mxfp4", dict(name="mxfp4"), 7, 40, 64, "float32"),
    ("gptq4_g32_bf16", dict(name="gptq", bits=4, group_size=32), 9, 64, 64, "bfloat16"),
]
TOL = {"float32": 1e-5, "bfloat16": 3e-2}


def _case(settings: dict, m: int, out: int, in_: int, seed: int, device: str):
    from engine.quant import format_named
    from engine.quant.dense import QuantLinear
    fmt = format_named(**settings)
    gen = torch.Generator().manual_seed(seed)
    parts = fmt.quantize(torch.randn(out, in_, generator=gen) * in_ ** -0.5)
    w = QuantLinear(fmt, {n: t.to(device) for n, t in parts.items()}, out, in_)
    return w, torch.randn(m, in_, generator=gen).to(device)


def run_cases(device: str) -> dict[str, str | None]:
    """Per case: None when the kernel matches the reference, else the mismatch message."""
    import torch.nn.functional as F

    import engine.kernels.triton.quant_linear  # noqa: F401  (registers tandem::quant_linear)
    from engine.quant.dense import join_rows, kernel_linear
    results: dict[str, str | None] = {}
    for seed, (name, settings, m, out, in_, dt) in enumerate(CASES):
        try:
            dtype = getattr(torch, dt)
            w, x = _case(settings, m, out, in_, seed, device)
            x = x.to(dtype)
            want = F.linear(x, w.dense(dtype))
            got = kernel_linear(x, w)
            torch.testing.assert_close(got.float(), want.float(), atol=TOL[dt], rtol=TOL[dt])
            assert torch.equal(kernel_linear(x[1:2], w), got[1:2]), "a row's result depends on the other rows"
            # q, k, v: two quantized and one plain linear of the same input, with a bias
            w2, _ = _case(settings, m, out, in_, 100 + seed, device)
            plain = torch.randn(8, in_, generator=torch.Generator().manual_seed(seed)).to(device, dtype)
            bias = torch.randn(2 * out + 8, generator=torch.Generator().manual_seed(seed)).to(device, dtype)
            joined = join_rows([w, w2, plain])
            side = torch.cat([got, kernel_linear(x, w2), F.linear(x, plain)], dim=-1) + bias
            assert torch.equal(kernel_linear(x, joined, bias), side), "a joined linear differs from its parts"
            results[name] = None
        except Exception as e:  # reported per case by the parent
            results[name] = f"{type(e).__name__}: {e}"
    return results


if __name__ == "__main__":
    print(json.dumps(run_cases("cpu")))
    sys.exit(0)

import pytest  # noqa: E402  (the child above never needs pytest)

triton = pytest.importorskip("triton")

from tests.kernel_harness import kernel_case_tests  # noqa: E402

case_results, test_kernel_matches_reference = kernel_case_tests(__file__, run_cases, [c[0] for c in CASES])


def test_join_rows_of_plain_weights_is_their_concatenation() -> None:
    from engine.quant.dense import join_rows
    a, b = torch.randn(3, 8), torch.randn(5, 8)
    assert torch.equal(join_rows([a, b]), torch.cat([a, b]))       # type: ignore[arg-type]
    with pytest.raises(ValueError, match="share their input size"):
        join_rows([a, torch.randn(2, 4)])
