"""Attention variants of the new model families (sliding window, sinks, MLA's latent layout)
against a plain dense attention written here, and the Triton decode kernel's variants
against the torch reference (under the Triton interpreter on a CPU, see tests/kernel_harness.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # the child: set before anything imports triton
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

# Triton cases: (name, B, Hq, Hkv, C, Dk, v_dim, page_size, seq_lens, window, sinks, dtype)
CASES = [
    ("window", 3, 4, 2, 2, 32, None, 4, [9, 1, 23], 5, False, "float32"),
    ("window_wider_than_seq", 2, 4, 2, 2, 16, None, 16, [7, 40], 64, False, "float32"),
    ("sinks", 2, 8, 2, 2, 32, None, 8, [1, 30], None, True, "float32"),
    ("window_sinks_bf16", 2, 4, 1, 2, 32, None, 4, [13, 6], 4, True, "bfloat16"),
    ("latent_576_shape", 2, 4, 1, 1, 48, 32, 4, [10, 3], None, False, "float32"),  # 32 + 16 tail
    ("latent_odd_tail", 1, 2, 1, 1, 40, 40, 16, [20], None, False, "float32"),     # 32 + 8, Dv = Dk
    ("latent_v_not_k1", 2, 4, 1, 1, 72, 48, 8, [17, 9], None, False, "float32"),
    ("latent_group_split", 1, 32, 1, 1, 288, 256, 16, [21], 8, True, "float32"),   # 2 head blocks
    ("latent_fp16", 2, 4, 1, 1, 48, 32, 4, [5, 12], None, True, "float16"),
]
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}


def _paged(seqs: list[torch.Tensor], page_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request rows [n, C, H, D] -> (kv_layer [C, P, S, H, D] with NaN in every unused
    slot, page_table [B, max_pages] int32 of shuffled pages; padding entries point at page 0)."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-len(x) // page_size) for x in seqs]
    perm = torch.randperm(sum(needed) + 2, generator=g)
    c, h, d = seqs[0].shape[1:]
    kv = torch.full((c, len(perm), page_size, h, d), float("nan"), dtype=seqs[0].dtype)
    table = torch.zeros(len(seqs), max(needed), dtype=torch.int32)
    used = 0
    for b, x in enumerate(seqs):
        for j in range(needed[b]):
            page = perm[used]
            used += 1
            table[b, j] = page
            rows = x[j * page_size:(j + 1) * page_size]  # [<= S, C, H, D]
            kv[:, page, :len(rows)] = rows.permute(1, 0, 2, 3)
    # Slots past seq_len read by the torch gather must not be NaN (0 * NaN): fill them.
    kv[:, table.long()] = torch.nan_to_num(kv[:, table.long()], nan=7.0)
    return kv, table


def _rows(n: int, c: int, h: int, d: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(n, c, h, d, generator=g)


def dense(q: torch.Tensor, rows: torch.Tensor, q_pos: list[int], scale: float, window: int | None,
          sinks: torch.Tensor | None, v_dim: int | None) -> torch.Tensor:
    """One request, written out: q [Q, Hq, Dk] at positions q_pos over rows [n, C, H, Dk]."""
    k = rows[:, 0].double()
    v = (rows[:, 1] if rows.shape[1] == 2 else rows[:, 0][..., :v_dim]).double()
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape[0], hq, v.shape[-1], dtype=torch.float64)
    for i, p in enumerate(q_pos):
        for hd in range(hq):
            kh = hd // (hq // hkv)
            scores = [float(q[i, hd].double() @ k[j, kh]) * scale for j in range(p + 1)
                      if window is None or j > p - window]
            first = 0 if window is None else max(0, p - window + 1)
            logits = torch.tensor(scores + ([float(sinks[hd])] if sinks is not None else []),
                                  dtype=torch.float64)
            probs = torch.softmax(logits, 0)[:len(scores)]
            out[i, hd] = probs @ v[first:p + 1, kh]
    return out


# ---- the Triton decode kernel's variants against the torch reference ---------------------------

def _triton_case(case: tuple, device: str, seed: int) -> None:
    from engine.attention import TorchAttention, TritonAttention
    from engine.kernels.paged_attention import paged_decode_attention_ref, split_kv
    name, b, hq, hkv, c, dk, v_dim, s, lens, window, has_sinks, dt = case
    dtype = getattr(torch, dt)
    g = torch.Generator().manual_seed(seed)
    kv, table = _paged([_rows(n, c, hkv, dk, g) for n in lens], s, seed)
    q = torch.randn(b, hq, dk, generator=g)
    sinks = torch.randn(hq, generator=g) * 2 if has_sinks else None
    # Pages the kernel must never read: past each request's last page and, with a window,
    # wholly before it.  The reference reads them all (masked), so it keeps the real ids.
    kernel_table = table.clone()
    for r, n in enumerate(lens):
        first = 0 if window is None else max(0, n - window)
        kernel_table[r, :first // s] = 10**6
        kernel_table[r, -(-n // s):] = 10**6
    to = dict(device=device)
    kv, q = kv.to(dtype=dtype, **to), q.to(dtype=dtype, **to)
    table, kernel_table = table.to(**to), kernel_table.to(**to)
    seq_lens = torch.tensor(lens, dtype=torch.int32, **to)
    sinks = None if sinks is None else sinks.to(**to)
    var = dict(window=window, sinks=sinks)
    k_cache, v_cache = split_kv(kv, v_dim)
    want = paged_decode_attention_ref(q, k_cache, v_cache, table, seq_lens, 0.2, **var)
    got = TritonAttention(s).decode(q, kv, (kernel_table, seq_lens), 0.2, v_dim=v_dim, **var)
    assert got.shape == want.shape == (b, hq, v_dim or dk) and got.dtype == dtype, (got.shape, got.dtype)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dt], rtol=TOL[dt])
    if dt == "float32":  # and the CPU backend's own path
        torch_attn = TorchAttention(s)
        plan = torch_attn.plan(_decode_batch(table, seq_lens, s))
        torch.testing.assert_close(got, torch_attn.decode(q, kv, plan, 0.2, v_dim=v_dim, **var),
                                   atol=1e-5, rtol=1e-5)


def _decode_batch(table: torch.Tensor, seq_lens: torch.Tensor, s: int):
    from engine.forward_batch import build_batch
    lens = seq_lens.tolist()
    return build_batch([[0]] * len(lens), [n - 1 for n in lens], table.tolist(), s, table.device)


def run_cases(device: str) -> dict[str, str | None]:
    """Per case: None when the kernel matches the reference, else the mismatch message."""
    from engine.attention import TritonAttention, _startup_check
    results: dict[str, str | None] = {}
    for seed, case in enumerate(CASES):
        try:
            _triton_case(case, device, seed)
            results[case[0]] = None
        except Exception as e:  # reported per case by the parent
            results[case[0]] = f"{type(e).__name__}: {e}"
    try:
        _startup_check(TritonAttention(16), torch.device(device))
        results["startup_check"] = None
    except Exception as e:
        results["startup_check"] = f"{type(e).__name__}: {e}"
    return results


if __name__ == "__main__":
    print(json.dumps(run_cases("cpu")))
    sys.exit(0)

import pytest  # noqa: E402  (the child never needs pytest)

from engine.attention import TorchAttention  # noqa: E402
from engine.forward_batch import build_batch  # noqa: E402
from tests.kernel_harness import kernel_case_tests  # noqa: E402

case_results, _kernel_test = kernel_case_tests(__file__, run_cases, [c[0] for c in CASES] + ["startup_check"])
test_triton_variants_match_reference = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed")(_kernel_test)



# ---- the torch path (the CPU backend) against `dense` ------------------------------------------

LAYOUTS = {"gqa": (2, 2, 16, None), "latent": (1, 1, 24, 16)}  # C, H, Dk, v_dim
VARIANTS = {"plain": (None, False), "window": (3, False), "sinks": (None, True), "both": (4, True)}


def _setup(layout: str, variant: str, lens: list[int], seed: int = 0):
    c, h, dk, v_dim = LAYOUTS[layout]
    window, has_sinks = VARIANTS[variant]
    g = torch.Generator().manual_seed(seed)
    seqs = [_rows(n, c, h, dk, g) for n in lens]
    sinks = torch.randn(4, generator=g) if has_sinks else None
    return seqs, dict(window=window, sinks=sinks, v_dim=v_dim)



@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("lens", [[6], [9, 1, 14]])
def test_prefill_and_decode_match_dense(layout: str, variant: str, lens: list[int]) -> None:
    seqs, var = _setup(layout, variant, lens)
    kv, table = _paged(seqs, 4, seed=1)
    attn, scale = TorchAttention(4), 0.3
    rows_of = [table[b, :-(-n // 4)].tolist() for b, n in enumerate(lens)]
    # prefill: each request adds its last min(n, 5) tokens on top of a cached prefix
    new = [min(n, 5) for n in lens]
    batch = build_batch([[0] * m for m in new], [n - m for n, m in zip(lens, new)], rows_of, 4, "cpu")
    q = torch.randn(sum(new), 4, seqs[0].shape[-1])
    got = attn.prefill(q, kv, batch, scale, **var)
    want, at = [], 0
    for x, n, m in zip(seqs, lens, new):
        want.append(dense(q[at:at + m], x, list(range(n - m, n)), scale, var["window"], var["sinks"], var["v_dim"]))
        at += m
    torch.testing.assert_close(got.double(), torch.cat(want), atol=1e-5, rtol=1e-5)
    # decode: one query per request at position n - 1; the same as prefill's last row
    batch = build_batch([[0]] * len(lens), [n - 1 for n in lens], rows_of, 4, "cpu")
    qd = q[[sum(new[:b + 1]) - 1 for b in range(len(lens))]]
    out = attn.decode(qd, kv, attn.plan(batch), scale, **var)
    torch.testing.assert_close(out, got[[sum(new[:b + 1]) - 1 for b in range(len(lens))]], atol=1e-6, rtol=1e-6)


def test_defaults_are_plain_sdpa_bit_for_bit() -> None:
    """No variant: decode of one request is one SDPA call over its keys cut to length."""
    seqs, _ = _setup("gqa", "plain", [11])
    kv, table = _paged(seqs, 4, seed=2)
    attn = TorchAttention(4)
    batch = build_batch([[0]], [10], [table[0].tolist()], 4, "cpu")
    q = torch.randn(1, 4, 16)
    got = attn.decode(q, kv, attn.plan(batch), 0.25)
    k = kv[0][table[0].long()].reshape(1, -1, 2, 16)[:, :11].transpose(1, 2)
    v = kv[1][table[0].long()].reshape(1, -1, 2, 16)[:, :11].transpose(1, 2)
    want = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, scale=0.25, enable_gqa=True)
    assert torch.equal(got, want[:, :, 0])


def test_plan_builds_each_window_mask_once() -> None:
    attn = TorchAttention(4)
    batch = build_batch([[0], [0]], [3, 9], [[0], [1, 2, 3]], 4, "cpu")
    plan = attn.plan(batch)
    first = plan.keys(2)[1]
    assert plan.keys(2)[1] is first and plan.keys(None)[1] is not first
    assert first is not None and first[:, 0, 0].tolist() == [
        [False, False, True, True] + [False] * 8, [False] * 8 + [True, True, False, False]]


@pytest.mark.parametrize("kw, match", [
    (dict(window=0), "window"),
    (dict(sinks=torch.zeros(3)), "sinks"),
    (dict(v_dim=8), "v_dim"),
])
def test_backend_refuses_bad_variants(kw: dict, match: str) -> None:
    attn = TorchAttention(4)
    batch = build_batch([[0]], [3], [[0]], 4, "cpu")
    with pytest.raises(ValueError, match=match):
        attn.decode(torch.randn(1, 4, 16), torch.randn(2, 2, 4, 2, 16), attn.plan(batch), 0.25, **kw)


def test_latent_needs_a_v_dim_that_fits() -> None:
    attn = TorchAttention(4)
    batch = build_batch([[0]], [3], [[0]], 4, "cpu")
    with pytest.raises(ValueError, match="C == 1"):
        attn.decode(torch.randn(1, 4, 16), torch.randn(1, 2, 4, 1, 16), attn.plan(batch), 0.25, v_dim=17)
