"""The scheduler of a pool with requests of both kinds (hand-off prefills for another worker
and requests decoded here), exact page ids, no model."""

from __future__ import annotations

import torch

from engine.kv_pool import PagePool
from engine.params import SamplingParams
from engine.request import Request
from engine.scheduler import Scheduler

PAGE = 4


def pool(pages: int = 16) -> PagePool:
    return PagePool(pages, PAGE, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)


def req(rid: str, prompt: int, max_tokens: int = 4, handoff: bool = False) -> Request:
    return Request(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens, temperature=0),
                   torch.Generator().manual_seed(0), handoff=handoff)


def test_a_handoff_reserves_its_prompt_only_and_the_rest_prompt_plus_output():
    p = pool()
    s = Scheduler(p, max_num_seqs=4, max_prefill_tokens=64)
    s.add(req("h", prompt=6, max_tokens=8, handoff=True))     # 2 pages
    s.add(req("d", prompt=6, max_tokens=8))                   # 14 tokens: 4 pages
    batch = s.schedule()
    assert batch is not None and batch.is_prefill and [r.request_id for r in batch.requests] == ["h", "d"]
    assert p.page_table("h") == [0, 1] and p.page_table("d") == [2, 3, 4, 5]


def test_each_kind_has_its_own_max_num_seqs_places():
    """A worker full of decodes still admits prompts to prefill for others, and the reverse."""
    p = pool(32)
    s = Scheduler(p, max_num_seqs=1, max_prefill_tokens=64)
    decoding = req("d", prompt=4)
    s.add(decoding)
    s.schedule()                                  # prefills d, which then decodes
    decoding.num_computed = 4
    s.add(req("h", prompt=4, handoff=True))
    s.add(req("h2", prompt=4, handoff=True))
    batch = s.schedule()
    assert batch is not None and batch.is_prefill and [r.request_id for r in batch.requests] == ["h"]
    assert [r.request_id for r in s.running] == ["d", "h"] and [r.request_id for r in s.waiting] == ["h2"]


def test_interleave_follows_a_prefill_step_with_a_decode_step():
    for interleave, kinds in ((False, [True, True, True]), (True, [True, False, True])):
        p = pool(64)
        s = Scheduler(p, max_num_seqs=8, max_prefill_tokens=4, interleave=interleave)
        d = req("d", prompt=4)
        p.allocate("d", p.pages_for(d.max_total_tokens))
        s.add_prefilled(d)                        # decodes here, its KV imported
        s.add(req("h", prompt=12, handoff=True))  # three chunks of 4
        got = []
        for _ in range(3):
            batch = s.schedule()
            assert batch is not None
            got.append(batch.is_prefill)
            for r, n in zip(batch.requests, batch.num_new_tokens):
                r.num_computed += n
            if not batch.is_prefill:
                assert [r.request_id for r in batch.requests] == ["d"]   # never the half-prefilled h
        assert got == kinds, interleave


def test_a_request_that_ends_on_its_imported_first_token_leaves_from_ready():
    p = pool()
    s = Scheduler(p, max_num_seqs=4, max_prefill_tokens=64)
    r = req("one", prompt=4, max_tokens=1)
    p.allocate("one", p.pages_for(r.max_total_tokens))
    s.add_prefilled(r)
    s.finish(r, "length")
    assert not s.has_work() and p.num_free == p.num_pages and r.finish_reason == "length"
    p.check_integrity()
