"""The Triton page-in kernel (engine/kernels/triton/expert_copy.py) against a plain copy: rows
of every word width, a miss count below, at and of zero entries, rows longer than one block.

Without a GPU the cases run in one child Python under the Triton interpreter (this file run as
a script; see tests/kernel_harness.py), with CUDA in-process (the store then in pinned host
memory, read by the device through its mapping, as the engine pages experts in)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # the child: set before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

# (name, experts, slots, row shapes and dtypes of each tensor, count)
CASES = [
    ("f32_two_of_three", 6, 3, [((4, 5), "float32"), ((3,), "float32")], 2),
    ("bf16_all", 5, 4, [((2, 7), "bfloat16"), ((9,), "bfloat16")], 4),
    ("int16_odd_and_uint8", 4, 2, [((3,), "int16"), ((5,), "uint8")], 1),
    ("none", 4, 2, [((6,), "float32")], 0),
    ("longer_than_a_block", 3, 2, [((3, 700), "float32")], 2),   # 2,100 words: three blocks
]


def run_cases(device: str) -> dict[str, str | None]:
    """Per case: None when the kernel copied exactly the first `count` entries, else why not."""
    from engine.kernels.triton.expert_copy import page_in_mapped
    results: dict[str, str | None] = {}
    for seed, (name, e, k, shapes, count) in enumerate(CASES):
        g = torch.Generator().manual_seed(seed)
        store = [(torch.randn(e, *shape, generator=g) * 100).to(getattr(torch, dt)) for shape, dt in shapes]
        if device == "cuda":
            store = [t.pin_memory() for t in store]
        slots = [torch.zeros(k, *t.shape[1:], dtype=t.dtype, device=device) for t in store]
        dst = torch.randperm(k, generator=g)
        src = torch.randperm(e, generator=g)[:k]
        want = [s.cpu().clone() for s in slots]
        for w, h in zip(want, store):
            w[dst[:count]] = h[src[:count]].cpu()
        try:
            page_in_mapped(slots, store, dst.to(device), src.to(device), torch.tensor([count], device=device))
            for i, (s, w) in enumerate(zip(slots, want)):
                assert torch.equal(s.cpu(), w), f"tensor {i} differs"
            results[name] = None
        except Exception as ex:  # reported per case by the parent
            results[name] = f"{type(ex).__name__}: {ex}"
    return results


if __name__ == "__main__":
    print(json.dumps(run_cases("cpu")))
    sys.exit(0)

import pytest  # noqa: E402

from tests.kernel_harness import kernel_case_tests  # noqa: E402

case_results, test_kernel_matches_reference = kernel_case_tests(__file__, run_cases, [c[0] for c in CASES])
test_kernel_matches_reference = pytest.mark.cuda(test_kernel_matches_reference)   # bench.gpu_check's cuda_tests
