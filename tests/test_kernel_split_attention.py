"""Split-K in the Triton decode attention: split requests against the torch reference, and a
request's output bit for bit the same whatever else is in its batch.

The kernels run with a tiny split size (split_tokens=16) so that sequences of tens of tokens
split; serving uses the constants of engine.kernels.triton.split_combine.  Without a GPU the
numeric cases run in one child Python under the Triton interpreter (this file run as a script;
see tests/kernel_harness.py), with CUDA in-process.
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

from tests.test_attention_variants import _paged, _rows

# (name, Hq, Hkv, C, Dk, v_dim, page_size, seq_lens, window, sinks, dtype, max_splits)
CASES = [
    ("gqa", 4, 2, 2, 32, None, 4, [70, 5, 33], None, False, "float32", 8),
    ("cap_longer_chunks", 4, 2, 2, 16, None, 8, [150, 17], None, False, "float32", 4),
    ("page32_chunk_rounded", 4, 1, 2, 32, None, 32, [100], None, False, "float32", 8),
    ("page1", 6, 2, 2, 16, None, 1, [37, 2], None, False, "float32", 8),
    ("window_sinks", 8, 2, 2, 32, None, 8, [90, 20, 41], 40, True, "float32", 8),
    ("sinks_bf16", 4, 2, 2, 32, None, 4, [60, 9], None, True, "bfloat16", 8),
    ("latent_576_shape", 4, 1, 1, 48, 32, 4, [60, 3], None, False, "float32", 8),
    ("latent_group_split", 32, 1, 1, 288, 256, 16, [50], None, True, "float32", 4),
    ("latent_fp16", 4, 1, 1, 48, 32, 4, [45, 12], 30, False, "float16", 8),
]
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}
SPLIT_TOKENS = 16  # a tiny split size, so tens of tokens split


def _inputs(case: tuple, lens: list[int], device: str, seed: int):
    """(q, kv_layer, page_table, kernel_table, seq_lens, sinks) for `lens`.  A request's q and
    keys depend only on (seed, its length); its pages are shuffled differently for each `lens`.
    kernel_table: the page ids the kernel must never read (past a request's last page, wholly
    before its window) are out of range; the reference reads them all, masked."""
    _, hq, hkv, c, dk, _, s, _, window, has_sinks, dt, _ = case
    rows, qs = [], []
    for n in lens:
        g = torch.Generator().manual_seed(1000 * seed + n)
        rows.append(_rows(n, c, hkv, dk, g))
        qs.append(torch.randn(hq, dk, generator=g))
    kv, table = _paged(rows, s, seed + 7 * len(lens))
    kernel_table = table.clone()
    for r, n in enumerate(lens):
        kernel_table[r, :max(0, n - (window or n)) // s] = 10**6
        kernel_table[r, -(-n // s):] = 10**6
    g = torch.Generator().manual_seed(seed)
    sinks = torch.randn(hq, generator=g) * 2 if has_sinks else None
    dtype = getattr(torch, dt)
    return (torch.stack(qs).to(device, dtype), kv.to(device, dtype), table.to(device), kernel_table.to(device),
            torch.tensor(lens, dtype=torch.int32, device=device), None if sinks is None else sinks.to(device))


def _decode(case: tuple, lens: list[int], device: str, seed: int, max_splits: int | None = None):
    """(kernel output, reference output) for a batch of `lens`."""
    from engine.kernels.paged_attention import paged_decode_attention_ref, split_kv
    from engine.kernels.triton.paged_attention import paged_decode_attention
    name, _, _, _, _, v_dim, _, _, window, _, _, _ = case
    q, kv, table, kernel_table, seq_lens, sinks = _inputs(case, lens, device, seed)
    k_cache, v_cache = split_kv(kv, v_dim)
    got = paged_decode_attention(q, k_cache, v_cache, kernel_table, seq_lens, 0.2, window=window, sinks=sinks,
                                 split_tokens=SPLIT_TOKENS, max_splits=max_splits or case[-1])
    want = paged_decode_attention_ref(q, k_cache, v_cache, table, seq_lens, 0.2, window=window, sinks=sinks)
    return got, want


def _splits(case: tuple, n: int, max_splits: int | None = None) -> int:
    from engine.kernels.triton.paged_attention import key_block
    from engine.kernels.triton.split_combine import split_plan
    _, _, _, _, dk, _, s, _, window, _, _, cap = case
    return split_plan(min(n, window or n), key_block(dk, s), SPLIT_TOKENS, max_splits or cap)[1]


def check_case(case: tuple, device: str, seed: int) -> None:
    """The kernel matches the reference; its longest request does split (the case is not vacuous)."""
    name, lens, dt = case[0], case[7], case[10]
    assert _splits(case, max(lens)) > 1, f"{name}: no request splits"
    got, want = _decode(case, lens, device, seed)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dt], rtol=TOL[dt])


def check_batch_independence(case: tuple, device: str, seed: int) -> None:
    """Each of a long (split) and a short (one chunk) request gives the same bits alone, beside a
    longer partner, beside short partners, and in another row; a one-chunk request gives the bits
    of the kernel with splitting off (max_splits=1)."""
    long_n, short_n = case[7][0], 9
    assert _splits(case, long_n) > 1 and _splits(case, short_n) == 1
    for n in (long_n, short_n):
        alone = _decode(case, [n], device, seed)[0][0]
        for lens, row in (([n, 2 * long_n], 0), ([1, 3, n], 2)):
            assert torch.equal(_decode(case, lens, device, seed)[0][row], alone), (n, lens)
    one_pass = _decode(case, [short_n, long_n], device, seed, max_splits=1)[0]
    assert torch.equal(_decode(case, [short_n, long_n], device, seed)[0][0], one_pass[0])


INDEPENDENCE = ["gqa", "window_sinks", "latent_576_shape"]


def run_cases(device: str) -> dict[str, str | None]:
    """Per case: None when it passed, else the error."""
    results: dict[str, str | None] = {}
    checks = [(c[0], check_case, c) for c in CASES] + [
        (f"batch_independent_{c[0]}", check_batch_independence, c) for c in CASES if c[0] in INDEPENDENCE]
    for seed, (name, check, case) in enumerate(checks):
        try:
            check(case, device, seed)
            results[name] = None
        except Exception as e:  # reported per case by the parent
            results[name] = f"{type(e).__name__}: {e}"
    return results


if __name__ == "__main__":
    print(json.dumps(run_cases("cpu")))
    sys.exit(0)

import pytest  # noqa: E402  (the child above never needs pytest)

triton = pytest.importorskip("triton")

from engine.kernels.triton.split_combine import split_plan  # noqa: E402
from tests.kernel_harness import kernel_case_tests  # noqa: E402

case_results, test_split_kernel = kernel_case_tests(
    __file__, run_cases, [c[0] for c in CASES] + [f"batch_independent_{n}" for n in INDEPENDENCE])
test_split_kernel = pytest.mark.cuda(test_split_kernel)   # bench.gpu_check's cuda_tests: on the device


@pytest.mark.parametrize("block_n", [16, 32, 64])
@pytest.mark.parametrize("split_tokens, max_splits", [(16, 8), (1024, 16), (100, 4)])
def test_split_plan_covers_every_key_once(block_n: int, split_tokens: int, max_splits: int) -> None:
    """Chunks are whole key blocks, none is empty, together they cover the keys, at most max_splits."""
    for n in range(0, 40 * split_tokens, 7):
        chunk, splits = split_plan(n, block_n, split_tokens, max_splits)
        assert chunk % block_n == 0 and 1 <= splits <= max_splits, (n, chunk, splits)
        assert splits * chunk >= n and (n == 0 or (splits - 1) * chunk < n), (n, chunk, splits)
        assert n > split_tokens or splits == 1, (n, chunk, splits)


def test_split_plan_balances_chunks() -> None:
    assert split_plan(1025, 64) == (576, 2)         # two near-equal chunks, not 1,024 + 1
    assert split_plan(16384, 64) == (1024, 16)
    assert split_plan(131072, 32) == (8192, 16)     # capped: longer chunks
    assert split_plan(1024, 16) == (1024, 1) and split_plan(0, 16) == (16, 1)


def test_launcher_rejects_bad_split_constants() -> None:
    from engine.kernels.triton.paged_attention import paged_decode_attention
    args = (torch.randn(1, 2, 16), torch.randn(2, 4, 2, 16), torch.randn(2, 4, 2, 16),
            torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0.25)
    for kw in (dict(max_splits=3), dict(split_tokens=0), dict(max_splits=0)):
        with pytest.raises(ValueError, match="split"):
            paged_decode_attention(*args, **kw)
