"""The Triton fused-MoE kernel against the torch reference `fused_moe_ref`.

Without a GPU the numeric cases run in one child Python under the Triton interpreter
(this file run as a script; see tests/kernel_harness.py for why), with CUDA in-process.
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
# (name, T, k, S, H, I, dtype, routing, hard). routing: "sparse" = random slots in -1..S-1;
# "low" = only slots 0..S/2-1 (the rest unused) and some -1; "shared" = rank 0 of every
# token on one slot (T > BLOCK_M: its group spans several blocks), the rest random;
# "none" = every pair -1. hard: x and out are strided views and slot_ids is int32.
# Names ending in "_oss" run gpt-oss's variant: per-slot biases b13/b2 and the clamped SwiGLU
# (limit 1.5, so both clamps bite on these inputs).
CASES = [
    ("t1_k2_unused_slots", 1, 2, 4, 32, 16, "float32", "sparse", False),
    ("t5_k2_low_slots", 5, 2, 8, 64, 32, "float32", "low", False),
    ("t17_k4_shared_slot", 17, 4, 8, 32, 48, "float32", "shared", False),
    ("t9_k4_s16_strided", 9, 4, 16, 64, 64, "float32", "sparse", True),
    ("t3_odd_h24_i20", 3, 2, 4, 24, 20, "float32", "sparse", False),
    ("t4_all_skipped", 4, 2, 4, 32, 16, "float32", "none", False),
    ("t9_k4_bf16", 9, 4, 8, 64, 32, "bfloat16", "shared", False),
    ("t5_k2_fp16", 5, 2, 4, 32, 32, "float16", "low", True),
    ("t1_k2_unused_slots_oss", 1, 2, 4, 32, 16, "float32", "sparse", False),
    ("t17_k4_shared_slot_oss", 17, 4, 8, 32, 48, "float32", "shared", False),
    ("t3_odd_h24_i20_oss", 3, 2, 4, 24, 20, "float32", "sparse", True),
    ("t9_k4_bf16_oss", 9, 4, 8, 64, 32, "bfloat16", "shared", False),
    ("t5_k2_fp16_oss", 5, 2, 4, 32, 32, "float16", "low", True),
]
TOL = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 3e-3}


def _make_case(t: int, k: int, s: int, h: int, i: int, routing: str, seed: int):
    """fp32 inputs on the CPU: x [T, H], w13 [S, 2I, H], w2 [S, H, I], slot_ids [T, k]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(s, 2 * i, h, generator=g) * h ** -0.5
    w2 = torch.randn(s, h, i, generator=g) * i ** -0.5
    slot_ids = torch.randint(-1, s, (t, k), generator=g)
    if routing == "sparse":
        slot_ids.view(-1)[0] = s - 1                  # at least one used pair
        slot_ids.view(-1)[-1] = -1                    # at least one skipped pair
    elif routing == "low":
        slot_ids = torch.randint(-1, s // 2, (t, k), generator=g)
        slot_ids[0, 0], slot_ids[-1, -1] = 0, -1
    elif routing == "shared":
        slot_ids[:, 0] = s // 2 + 1
        slot_ids[-1, -1] = -1
    else:
        slot_ids.fill_(-1)
    return x, w13, w2, slot_ids


def run_cases(device: str) -> dict[str, str | None]:
    """Per case: None when the kernel matches the reference, else the mismatch message."""
    from engine.kernels.fused_moe import ClampedSwiGLU, fused_moe_ref
    from engine.kernels.triton.fused_moe import fused_moe
    results: dict[str, str | None] = {}
    for seed, (name, t, k, s, h, i, dt, routing, hard) in enumerate(CASES):
        dtype = getattr(torch, dt)
        x, w13, w2, slot_ids = (v.to(device) for v in _make_case(t, k, s, h, i, routing, seed))
        x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
        extra: dict = {}
        if name.endswith("_oss"):
            g = torch.Generator().manual_seed(100 + seed)
            extra = dict(b13=torch.randn(s, 2 * i, generator=g).to(device, dtype),
                         b2=torch.randn(s, h, generator=g).to(device, dtype), act=ClampedSwiGLU(1.702, 1.5))
        want = fused_moe_ref(x, w13, w2, slot_ids, torch.full((t * k, h), SENTINEL, dtype=dtype,
                                                              device=device), **extra)
        try:
            if hard:  # row strides of 2H / 3H instead of H
                x = torch.cat([x, torch.full_like(x, float("nan"))], dim=1)[:, :h]
                buf = torch.full((t * k, 3 * h), SENTINEL, dtype=dtype, device=device)
                out, slot_ids = buf[:, h:2 * h], slot_ids.to(torch.int32)
            else:
                buf = out = torch.full((t * k, h), SENTINEL, dtype=dtype, device=device)
            got = fused_moe(x, w13, w2, slot_ids, out, **extra)
            assert got is out
            skipped = slot_ids.reshape(-1) < 0
            assert bool((buf[skipped] == SENTINEL).all()), "rows of skipped pairs were written"
            if hard:
                assert bool((buf[:, :h] == SENTINEL).all() and (buf[:, 2 * h:] == SENTINEL).all())
            torch.testing.assert_close(got.float(), want.float(), atol=TOL[dt], rtol=TOL[dt])
            if routing == "shared":
                # Bit-exact whichever slot holds an expert and whichever other pairs run.
                perm = torch.randperm(s, generator=torch.Generator().manual_seed(seed))
                inv = torch.argsort(perm).to(device)  # expert at slot j moves to slot inv[j]
                moved = torch.where(slot_ids >= 0, inv[slot_ids.clamp(min=0)], -1)
                w13p, w2p = torch.empty_like(w13), torch.empty_like(w2)
                w13p[inv], w2p[inv] = w13, w2
                moved_extra = dict(extra)
                for key in ("b13", "b2") if extra else ():
                    moved_extra[key] = torch.empty_like(extra[key])
                    moved_extra[key][inv] = extra[key]
                got2 = fused_moe(x, w13p, w2p, moved, torch.full_like(out, SENTINEL), **moved_extra)
                assert torch.equal(got2, got), "result depends on the slot holding the expert"
                alone = torch.where(slot_ids == s // 2 + 1, slot_ids, -1)
                got3 = fused_moe(x, w13, w2, alone, torch.full_like(out, SENTINEL), **extra)
                keep = alone.reshape(-1) >= 0
                assert torch.equal(got3[keep], got[keep]), "result depends on other slots' pairs"
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


def test_align_block_size() -> None:
    from engine.kernels.triton.fused_moe import align_block_size
    slot_ids = torch.tensor([[2, 0], [-1, 2], [2, 2], [0, -1]])     # pairs 0..7, S = 4
    sorted_ids, block_slot = align_block_size(slot_ids, 4, 4)
    pad = 8
    # slot 0: pairs 1, 6; slot 2: pairs 0, 3, 4, 5; slots 1 and 3 unused.
    assert sorted_ids.tolist() == [1, 6, pad, pad, 0, 3, 4, 5] + [pad] * 16
    assert block_slot.tolist() == [0, 2, -1, -1, -1, -1]
    sorted_ids, block_slot = align_block_size(torch.full((3, 2), -1), 4, 4)
    assert (sorted_ids == 6).all() and (block_slot == -1).all()


def _inputs(**over):
    args = dict(x=torch.randn(3, 32), w13=torch.randn(4, 32, 32), w2=torch.randn(4, 32, 16),
                slot_ids=torch.zeros(3, 2, dtype=torch.int64), out=torch.zeros(6, 32))
    args.update(over)
    return args


@pytest.mark.parametrize("over, match", [
    (dict(x=torch.randn(3, 32, 1)), "expected x"),
    (dict(slot_ids=torch.zeros(6, dtype=torch.int64)), "expected x"),
    (dict(w13=torch.randn(4, 31, 32)), "w13 shape"),
    (dict(w13=torch.randn(4, 32, 16)), "w13 shape"),
    (dict(w2=torch.randn(4, 32, 8)), "w2 shape"),
    (dict(w2=torch.randn(3, 32, 16)), "w2 shape"),
    (dict(slot_ids=torch.zeros(2, 2, dtype=torch.int64)), "slot_ids"),
    (dict(out=torch.zeros(3, 32)), "out"),
    (dict(out=torch.zeros(6, 32, dtype=torch.float16)), "dtype"),
    (dict(x=torch.randn(3, 32, dtype=torch.float64), w13=torch.randn(4, 32, 32, dtype=torch.float64),
          w2=torch.randn(4, 32, 16, dtype=torch.float64), out=torch.zeros(6, 32, dtype=torch.float64)),
     "dtype"),
    (dict(slot_ids=torch.zeros(3, 2)), "integer"),
    (dict(slot_ids=torch.tensor([[0, 4], [1, 2], [3, -1]])), r"-1\.\.3"),
    (dict(slot_ids=torch.tensor([[0, -2], [1, 2], [3, -1]])), r"-1\.\.3"),
    (dict(b13=torch.zeros(4, 32)), "both expert biases"),
    (dict(b13=torch.zeros(4, 16), b2=torch.zeros(4, 32)), "b13"),
    (dict(b13=torch.zeros(4, 32), b2=torch.zeros(4, 16)), "b2"),
    (dict(b13=torch.zeros(4, 32, dtype=torch.float16), b2=torch.zeros(4, 32)), "dtype"),
])
def test_launcher_rejects_bad_inputs(over: dict, match: str) -> None:
    from engine.kernels.triton.fused_moe import fused_moe
    with pytest.raises(ValueError, match=match):
        fused_moe(**_inputs(**over))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_launcher_rejects_mixed_devices() -> None:
    from engine.kernels.triton.fused_moe import fused_moe
    with pytest.raises(ValueError, match="one device"):
        fused_moe(**_inputs(slot_ids=torch.zeros(3, 2, dtype=torch.int64, device="cuda")))
