"""Batch buckets of the compiled decode step without compiling anything: the default and chosen
sizes, parsing, the bucket a batch runs in, padding rows on the pool's scratch page (never handed
out), bucket settings refused before compiling, and buckets left out for their gathered expert
weights."""

from __future__ import annotations

import pytest
import torch

import engine.compiled.startup
from engine import LLM
from engine.compiled.buckets import bucket_for, decode_buckets, pad_rows, parse_buckets
from engine.compiled.step import MIN_PAGES
from engine.forward_batch import build_batch
from engine.kv_pool import PagePool, PoolExhausted

# ---- buckets (no compilation) --------------------------------------------------------------

def test_default_buckets_double_up_to_max_num_seqs() -> None:
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert decode_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert decode_buckets(3) == (1, 2, 3)
    assert decode_buckets(1) == (1,)


def test_wanted_buckets_are_sorted_deduplicated_and_bounded() -> None:
    assert decode_buckets(8, [4, 1, 4, 2]) == (1, 2, 4)
    assert decode_buckets(8, [8]) == (8,)
    for wanted in ([0], [9], [1, 9], [-2]):
        with pytest.raises(ValueError, match="from 1 to max_num_seqs=8"):
            decode_buckets(8, wanted)
    with pytest.raises(ValueError, match="at least one is needed"):
        decode_buckets(8, [])


@pytest.mark.parametrize("text, bad", [("1,,4", "''"), ("0", "'0'"), ("1,x", "'x'"), ("-2", "'-2'"),
                                       ("2.5", "'2.5'"), ("", "''")])
def test_parse_buckets_names_the_bad_entry(text: str, bad: str) -> None:
    with pytest.raises(ValueError, match=f"{bad} is not a positive batch size"):
        parse_buckets(text)


def test_parse_buckets() -> None:
    assert parse_buckets("1, 2 ,4,16") == [1, 2, 4, 16]
    assert parse_buckets("3") == [3]


def test_bucket_for_is_the_smallest_that_holds_the_batch() -> None:
    buckets = (1, 2, 4, 8)
    assert [bucket_for(n, buckets) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]
    assert bucket_for(3, (4,)) == 4 and bucket_for(5, (4,)) is None


def test_padding_rows_sit_on_the_scratch_page() -> None:
    tokens, starts, tables = [[11], [12], [13]], [5, 0, 20], [[3], [7], [1, 2]]
    t, s, tb = pad_rows(tokens, starts, tables, 4, scratch_page=9)
    assert (t, s, tb) == ([[11], [12], [13], [0]], [5, 0, 20, 0], [[3], [7], [1, 2], [9]])
    assert (tokens, starts, tables) == ([[11], [12], [13]], [5, 0, 20], [[3], [7], [1, 2]])  # not changed
    assert pad_rows(tokens, starts, tables, 3, 9) == (tokens, starts, tables)
    with pytest.raises(ValueError, match="3 rows does not fit the bucket of 2"):
        pad_rows(tokens, starts, tables, 2, 9)
    # as the compiled step builds it: padding rows write slot 0 of the scratch page, and every
    # short page table is padded with the scratch page
    fb = build_batch(t, s, tb, 16, "cpu", pad_page=9, min_pages=MIN_PAGES)
    assert fb.slot_mapping.tolist() == [3 * 16 + 5, 7 * 16, 2 * 16 + 4, 9 * 16]
    assert fb.page_table.tolist() == [[3, 9], [7, 9], [1, 2], [9, 9]]
    assert fb.seq_lens.tolist() == [6, 1, 21, 1] and fb.positions.tolist() == [5, 0, 20, 0]


def test_the_scratch_page_is_never_handed_out() -> None:
    pool = PagePool(6, 4, num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    assert pool.scratch_page == 6 and pool.kv.shape[2] == 7
    pages = pool.allocate("a", 4) + pool.allocate("b", 2)
    assert sorted(pages) == list(range(6))
    with pytest.raises(PoolExhausted):
        pool.allocate("c", 1)
    pool.free("a")
    assert pool.scratch_page not in pool.allocate("c", 4)
    pool.free("b")
    pool.free("c")
    pool.check_integrity()


# ---- bad settings --------------------------------------------------------------------------

@pytest.mark.parametrize("buckets, limit", [([0], 64), ([1, 65], 64), ([5], 4)])
def test_bad_buckets_are_refused_before_compiling(buckets: list[int], limit: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def no_compiling(*args: object, **kw: object) -> None:
        raise AssertionError("compiled before checking the buckets")
    monkeypatch.setattr(engine.compiled.startup, "CompiledDecode", no_compiling)
    with pytest.raises(ValueError, match=f"from 1 to max_num_seqs={limit}"):
        LLM(compile=True, compile_buckets=buckets, max_num_seqs=limit)


def test_buckets_whose_gathered_experts_pass_the_budget_are_left_out(shipped_llm: LLM,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    eager = shipped_llm  # eager: the suite runs with TANDEM_COMPILE=0
    # the shipped model: 64 rows x top-4 x 96 KiB of expert weights = 24 MiB per MoE layer
    assert engine.compiled.startup.gathered_bytes(eager.model, 64) == 64 * 4 * (128 * 128 + 128 * 64) * 4
    monkeypatch.setattr(engine.compiled.startup, "GATHER_BUDGET_BYTES", 8 << 20)
    defaults = decode_buckets(64)
    assert engine.compiled.startup.fitting_buckets(eager.model, defaults, explicit=False) == (1, 2, 4, 8, 16)
    with pytest.raises(ValueError, match="compile bucket 32 would copy 12 MiB .* up to 16, or --no-compile"):
        engine.compiled.startup.fitting_buckets(eager.model, defaults, explicit=True)
    monkeypatch.setattr(engine.compiled.startup, "GATHER_BUDGET_BYTES", 1 << 10)
    with pytest.raises(ValueError, match="compile bucket 1 would copy"):
        engine.compiled.startup.fitting_buckets(eager.model, defaults, explicit=False)
