"""The Triton fused-MoE kernel over quantized experts, read in their published parts and
dequantized in the kernel (engine/kernels/triton/weight_tiles.py), against the torch reference
`fused_moe_ref` over the same parts (which dequantizes them with the format's codec).

Both sides dequantize every element to the same fp32 value, so in fp32 they differ only by the
matmul's summation order (1e-5). Each case also checks that the result does not depend on the
slot holding an expert or on the other pairs of the call (bit for bit), and that the kernel
reads every part: changing any one stored part of one expert (a scale, a zero point, g_idx,
the packed words) changes that expert's output. Odd shapes leave partial FP8 blocks, a partial
last word of compressed-tensors' packing, and output tiles past the edge.

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

SENTINEL = 7.0
# (name, format settings, T, k, S, H, I, dtype, gpt-oss: interleaved gate_up, biases, clamped SwiGLU)
CASES = [
    ("gptq4_g16_asym_desc_act", dict(name="gptq", bits=4, group_size=16, sym=False, desc_act=True),
     9, 2, 4, 64, 32, "float32", False),
    ("gptq4_g32_sym_v1", dict(name="gptq", bits=4, group_size=32), 5, 2, 4, 64, 32, "float32", False),
    ("gptq8_channel_v2", dict(name="gptq", bits=8, group_size=-1, checkpoint_format="gptq_v2"),
     5, 2, 4, 64, 32, "float32", False),
    ("awq4_g16", dict(name="awq", group_size=16), 9, 2, 4, 64, 32, "float32", False),
    ("ct_int4_g16_asym", dict(name="ct-int", bits=4, group_size=16, sym=False), 9, 2, 4, 64, 32, "float32", False),
    ("ct_int4_channel_odd_i20", dict(name="ct-int", bits=4, group_size=-1), 5, 2, 4, 64, 20, "float32", False),
    ("ct_int8_channel_asym", dict(name="ct-int", bits=8, group_size=-1, sym=False), 5, 2, 4, 64, 32, "float32", False),
    ("fp8_block_48x40_odd", dict(name="fp8-block", block=(48, 40)), 9, 2, 4, 72, 44, "float32", False),
    ("fp8_block_128", dict(name="fp8-block"), 5, 2, 4, 64, 32, "float32", False),
    ("ct_fp8_channel", dict(name="ct-fp8", strategy="channel"), 5, 2, 4, 64, 20, "float32", False),
    ("ct_fp8_tensor", dict(name="ct-fp8", strategy="tensor", scale_dtype=torch.float32),
     5, 2, 4, 64, 32, "float32", False),
    ("mxfp4_joined", dict(name="mxfp4"), 9, 2, 4, 64, 32, "float32", False),
    ("mxfp4_gpt_oss", dict(name="mxfp4"), 9, 2, 4, 64, 32, "float32", True),
    ("gptq4_g16_bf16", dict(name="gptq", bits=4, group_size=16, sym=False), 9, 2, 4, 64, 32, "bfloat16", False),
    ("mxfp4_gpt_oss_bf16", dict(name="mxfp4"), 9, 2, 4, 64, 32, "bfloat16", True),
]
TOL = {"float32": 1e-5, "bfloat16": 3e-2}
# the loader's start-up check (engine.moe.select_moe_kernel) over experts of each format, its
# published defaults (group 128, 128x128 blocks) as a checkpoint's config.json would name them
STARTUP_CHECKS = [(f"startup_check_{n}", dict(name=n))
                  for n in ("gptq", "awq", "ct-int", "fp8-block", "ct-fp8", "mxfp4")]
STARTUP_CHECKS.append(("startup_check_gptq_desc_act", dict(name="gptq", desc_act=True, sym=False)))


def _weights(fmt, s: int, h: int, i: int, oss: bool, gen: torch.Generator):
    """w13 and w2 of S experts quantized in `fmt` (engine/quant's packer), as the loader stacks them."""
    from engine.quant.stack import JoinedRows, QuantStack
    gate_up = torch.randn(s, 2 * i, h, generator=gen) * h ** -0.5      # gpt-oss: gate = even rows
    down = torch.randn(s, h, i, generator=gen) * i ** -0.5
    w2 = QuantStack(fmt, fmt.quantize(down), h, i)
    if oss:
        return JoinedRows([QuantStack(fmt, fmt.quantize(gate_up), 2 * i, h)], interleaved=True), w2
    gate, up = (QuantStack(fmt, fmt.quantize(w), i, h) for w in gate_up.chunk(2, dim=1))
    return JoinedRows([gate, up]), w2


def _on(w, device: str, perm: torch.Tensor | None = None):
    """`w` (a QuantStack or JoinedRows) with every part moved to `device`, experts reordered by
    `perm` (slot j holds expert perm[j]) when given."""
    from engine.quant.stack import JoinedRows, QuantStack
    if isinstance(w, JoinedRows):
        return JoinedRows([_on(lin, device, perm) for lin in w.linears], w.interleaved)
    parts = {n: (t if perm is None else t[perm]).to(device) for n, t in w.parts.items()}
    return QuantStack(w.fmt, parts, w.out, w.in_)


def _changed(t: torch.Tensor, name: str, slot: int) -> torch.Tensor:
    """A copy of part `t` whose slot `slot` holds other values of the same dtype."""
    c = t.clone()
    if name == ".g_idx":
        c[slot] = c[slot].roll(1)
    elif c.dtype in (torch.int32, torch.uint8):
        c[slot] ^= 0x11111111 if c.dtype == torch.int32 else 0x11
    else:
        c[slot] = (c[slot].float() * 0.5).to(c.dtype)
    return c


def run_cases(device: str) -> dict[str, str | None]:
    """Per case: None when the kernel matches the reference, else the mismatch message."""
    from engine.kernels.fused_moe import ClampedSwiGLU, fused_moe_ref
    from engine.kernels.triton.fused_moe import fused_moe
    from engine.quant import format_named
    from engine.quant.stack import QuantStack
    results: dict[str, str | None] = {}
    for seed, (name, settings, t, k, s, h, i, dt, oss) in enumerate(CASES):
        try:
            dtype, gen = getattr(torch, dt), torch.Generator().manual_seed(seed)
            fmt = format_named(**settings)
            w13, w2 = _weights(fmt, s, h, i, oss, gen)
            x = torch.randn(t, h, generator=gen).to(device, dtype)
            busy = s // 2 + 1                                              # rank 0 of every token
            slot_ids = torch.randint(-1, s, (t, k), generator=gen)
            slot_ids[:, 0], slot_ids[-1, -1] = busy, -1
            slot_ids = slot_ids.to(device)
            extra: dict = {}
            if oss:
                extra = dict(b13=torch.randn(s, 2 * i, generator=gen).to(device, dtype),
                             b2=torch.randn(s, h, generator=gen).to(device, dtype), act=ClampedSwiGLU(1.702, 1.5))
            d13, d2 = _on(w13, device), _on(w2, device)

            def run(a13, a2, ids=slot_ids, **kw):
                return fused_moe(x, a13, a2, ids, torch.full((t * k, h), SENTINEL, dtype=dtype, device=device),
                                 **(kw or extra))

            want = fused_moe_ref(x, d13, d2, slot_ids, torch.full((t * k, h), SENTINEL, dtype=dtype,
                                                                  device=device), **extra)
            got = run(d13, d2)
            skipped = slot_ids.reshape(-1) < 0
            assert bool((got[skipped] == SENTINEL).all()), "rows of skipped pairs were written"
            torch.testing.assert_close(got.float(), want.float(), atol=TOL[dt], rtol=TOL[dt])
            # bit for bit whichever slot holds an expert, and whichever other pairs share the call
            perm = torch.randperm(s, generator=gen)                        # slot j holds expert perm[j]
            inv = torch.argsort(perm).to(device)                           # expert e sits in slot inv[e]
            moved = torch.where(slot_ids >= 0, inv[slot_ids.clamp(min=0)], -1)
            moved_extra = dict(extra)
            for key in ("b13", "b2") if extra else ():
                moved_extra[key] = extra[key][perm.to(device)]
            assert torch.equal(run(_on(w13, device, perm), _on(w2, device, perm), moved, **moved_extra), got), \
                "result depends on the slot holding the expert"
            alone = torch.where(slot_ids == busy, slot_ids, -1)
            keep = alone.reshape(-1) >= 0
            assert torch.equal(run(d13, d2, alone)[keep], got[keep]), "result depends on other slots' pairs"
            # every stored part of w2 is read: changing one expert's copy of it changes that expert's rows
            for part in w2.fmt.parts():
                if part == ".weight_shape" or (part == ".g_idx" and not fmt.desc_act):
                    continue                                               # metadata / unread by design
                parts = dict(d2.parts)
                parts[part] = _changed(parts[part], part, busy)
                other = run(d13, QuantStack(w2.fmt, parts, w2.out, w2.in_))
                assert not torch.equal(other[keep], got[keep]), f"the kernel ignores {part} of w2"
            results[name] = None
        except Exception as e:  # reported per case by the parent
            results[name] = f"{type(e).__name__}: {e}"
    from engine.moe import check_moe_kernel
    for name, settings in STARTUP_CHECKS:
        try:
            check_moe_kernel(device, clamped=True, expert_format=format_named(**settings))
            results[name] = None
        except Exception as e:
            results[name] = f"{type(e).__name__}: {e}"
    return results


if __name__ == "__main__":
    print(json.dumps(run_cases("cpu")))
    sys.exit(0)

import pytest  # noqa: E402  (the child above never needs pytest)

triton = pytest.importorskip("triton")

from tests.kernel_harness import kernel_case_tests  # noqa: E402

case_results, test_kernel_matches_reference = kernel_case_tests(__file__, run_cases,
                                                                [c[0] for c in CASES + STARTUP_CHECKS])


def test_mixed_plain_and_quantized_weights_are_refused() -> None:
    from engine.kernels.triton.fused_moe import fused_moe
    from engine.quant import format_named
    fmt = format_named("gptq", bits=4, group_size=16)
    w13, w2 = _weights(fmt, 2, 32, 16, False, torch.Generator().manual_seed(0))
    x, ids = torch.randn(3, 32), torch.zeros(3, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="both be plain or both quantized"):
        fused_moe(x, w13, torch.randn(2, 32, 16), ids, torch.empty(3, 32))
