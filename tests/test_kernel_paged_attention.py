"""The Triton decode paged-attention kernel against the torch reference.

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

# (name, B, Hq, Hkv, D, page_size, seq_lens, dtype, hard) where hard: the kernel gets
# out-of-range page ids after each request's last used page, a q with a padded head stride
# and K/V that are views into one fused [P, S, 2, Hkv, D] cache.
CASES = [
    ("g1_seq1", 1, 2, 2, 16, 4, [1], "float32", False),
    ("g2_page4", 3, 4, 2, 32, 4, [5, 1, 12], "float32", False),
    ("g4_page16_multiblock", 2, 8, 2, 16, 16, [37, 16], "float32", False),
    ("g4_mqa_d64", 2, 4, 1, 64, 16, [20, 3], "float32", True),
    ("g3_page1", 2, 6, 2, 16, 1, [7, 18], "float32", True),
    ("g16_page128_d128", 1, 16, 1, 128, 128, [150], "float32", True),
    ("g8_d256_page32", 2, 16, 2, 256, 32, [33, 70], "float32", False),
    ("g2_bf16", 2, 4, 2, 32, 16, [19, 40], "bfloat16", False),
    ("g2_fp16", 1, 4, 2, 32, 4, [9], "float16", False),
]
HUGE = {"float32": 1e30, "bfloat16": 1e30, "float16": 6e4}
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}


def _make_case(b: int, hq: int, hkv: int, d: int, s: int, seq_lens: list[int], dtype: torch.dtype,
               huge: float, device: str, seed: int):
    """Random inputs; unused cache space holds garbage the kernel must never let through.

    Positions past seq_len in a used page and pages listed after a request's last used page
    hold huge finite values (the reference reads them, multiplied by 0); pages no request lists
    hold NaN. Page ids are shuffled, so no request's pages are contiguous or in order.
    """
    g = torch.Generator().manual_seed(seed)
    needed = [(n + s - 1) // s for n in seq_lens]
    max_pages = max(needed) + 1                       # every row has >= 1 trailing entry
    num_pages = b * max_pages + 3                     # 3 pages nobody lists
    perm = torch.randperm(num_pages, generator=g)
    page_table = perm[: b * max_pages].view(b, max_pages).to(torch.int32)
    k = torch.full((num_pages, s, hkv, d), float("nan"))
    v = torch.full((num_pages, s, hkv, d), float("nan"))
    for i, n in enumerate(seq_lens):
        for j in range(max_pages):
            p = page_table[i, j]
            k[p], v[p] = huge, -huge
            lo = min(max(n - j * s, 0), s)            # positions of this page below seq_len
            k[p, :lo] = torch.randn(lo, hkv, d, generator=g)
            v[p, :lo] = torch.randn(lo, hkv, d, generator=g)
    q = torch.randn(b, hq, d, generator=g)
    kernel_table = page_table.clone()
    for i, n in enumerate(needed):
        kernel_table[i, n:] = 10**6 + num_pages       # out of range: must never be read
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), k.to(dtype=dtype, **to), v.to(dtype=dtype, **to),
            page_table.to(**to), kernel_table.to(**to), torch.tensor(seq_lens, dtype=torch.int32, **to))


def run_cases(device: str) -> dict[str, str | None]:
    """Per case: None when the kernel matches the reference, else the mismatch message."""
    from engine.kernels.paged_attention import paged_decode_attention_ref
    from engine.kernels.triton.paged_attention import paged_decode_attention
    results: dict[str, str | None] = {}
    for seed, (name, b, hq, hkv, d, s, seq_lens, dt, hard) in enumerate(CASES):
        dtype = getattr(torch, dt)
        q, k, v, pt, kpt, sl = _make_case(b, hq, hkv, d, s, seq_lens, dtype, HUGE[dt], device, seed)
        if hard:
            q = torch.cat([q, torch.full_like(q, float("nan"))], dim=-1)[..., :d]  # stride(1) = 2D
            kv = torch.stack([k, v], dim=2)                                       # [P, S, 2, Hkv, D]
            k, v = kv[:, :, 0], kv[:, :, 1]
        scale = d ** -0.5
        want = paged_decode_attention_ref(q, k, v, pt, sl, scale)
        try:
            got = paged_decode_attention(q, k, v, kpt if hard else pt, sl, scale)
            assert got.shape == want.shape and got.dtype == dtype, (got.shape, got.dtype)
            torch.testing.assert_close(got.float(), want.float(), atol=TOL[dt], rtol=TOL[dt])
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


def _inputs(**over):
    args = dict(q=torch.randn(2, 4, 16), k_cache=torch.randn(5, 4, 2, 16),
                v_cache=torch.randn(5, 4, 2, 16), page_table=torch.zeros(2, 3, dtype=torch.int32),
                seq_lens=torch.ones(2, dtype=torch.int32), scale=0.25)
    args.update(over)
    return args


@pytest.mark.parametrize("over, match", [
    (dict(q=torch.randn(2, 4, 32)), "head_dim mismatch"),
    (dict(q=torch.randn(2, 3, 16)), "not a multiple"),
    (dict(v_cache=torch.randn(5, 4, 1, 16)), "v_cache shape"),
    (dict(q=torch.randn(2, 4)), "expected q"),
    (dict(seq_lens=torch.ones(3, dtype=torch.int32)), "seq_lens"),
    (dict(page_table=torch.zeros(2, 3, dtype=torch.int64)), "int32"),
    (dict(q=torch.randn(2, 4, 16, dtype=torch.float16)), "dtype"),
    (dict(q=torch.randn(2, 4, 12), k_cache=torch.randn(5, 4, 2, 12), v_cache=torch.randn(5, 4, 2, 12)),
     "head_dim must be in"),
    (dict(k_cache=torch.randn(5, 4, 2, 32)[..., ::2]), "contiguous"),
])
def test_launcher_rejects_bad_inputs(over: dict, match: str) -> None:
    from engine.kernels.triton.paged_attention import paged_decode_attention
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(**_inputs(**over))
