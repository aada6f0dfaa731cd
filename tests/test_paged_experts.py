"""Paged experts: exact results for any K, LRU slot choice and eviction order, waves,
and the start-up independence check."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.experts import ExpertSlots, ExpertStore, PagedExperts, validate_num_resident
from engine.experts.check import ExpertCheckError, check_independence, fingerprint, verify_resident
from engine.experts.copy import DirectCopy
from engine.moe import ResidentExperts

NATURAL = [
    "def read_lines(path):\n    with open(path) as f:", "import os\nimport re\n", "class Buffer:\n",
    "<|im_start|>user\nRepeat after me: amber-77 owl<|im_end|>\n<|im_start|>assistant\n",
    "    return self._cache.get(key, default)", "# Convert a string to bytes", "for name in sorted(",
    "raise ValueError('invalid literal", "while queue:\n    item = queue.pop()", "x",
    "def __eq__(self, other):", "if not isinstance(value, int):", "data = json.loads(",
    "try:\n    import zlib\nexcept ImportError:", "parser.add_argument(", "lines = text.splitlines()",
    "assert len(result) ==",
]


@pytest.fixture(scope="module")
def resident_reference(shipped_llm):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    return params, {b: shipped_llm.generate(NATURAL[:b], params) for b in (1, 3, 8, 17)}


@pytest.mark.parametrize("k", [4, 8, 16, 32, 64])
def test_logprobs_bit_identical_to_all_resident_for_any_k(k, resident_reference):
    params, reference = resident_reference
    llm = LLM(paged_experts_num_resident=k)
    for batch, want in reference.items():
        got = llm.generate(NATURAL[:batch], params)
        for a, b in zip(got, want):
            assert a.token_ids == b.token_ids
            assert a.logprobs == b.logprobs  # exact float equality, every step, every entry
    stats = llm.expert_stats()
    assert sorted(stats) == list(range(6))
    if k < 64:
        assert all(s["misses"] > 0 for s in stats.values())
    assert all(s["waves"] >= s["steps"] for s in stats.values())
    llm.pool.check_integrity()


# ---- unit tests on a small layer: E = 8 experts, K = 3 slots ------------------------------

class SpyCopy(DirectCopy):
    def __init__(self):
        self.copied: list[int] = []  # expert ids paged in, in order (w13 copies only)

    def copy(self, pairs, after=None, prefetch=False):
        for _, src in pairs:
            if src.dim() == 2 and src.shape[0] == 8:   # a w13 row: [2I=8, H=4]
                self.copied.append(int(src[0, 0].item()))
        return super().copy(pairs, after, prefetch)


def small_layer(k=3, cache=True):
    e = 8
    w13 = torch.randn(e, 8, 4)
    w13[:, 0, 0] = torch.arange(e).float()  # tag: expert id in the first element
    w2 = torch.randn(e, 4, 4)
    store = ExpertStore(w13, w2, [fingerprint(w13[i], w2[i]) for i in range(e)])
    spy = SpyCopy()
    slots = ExpertSlots(store, k, "cpu", copier=spy)
    spy.copied.clear()
    return PagedExperts(slots, cache=cache), spy


def step(layer, experts):
    ids = torch.tensor(experts).view(-1, 1)
    x = torch.randn(ids.shape[0], 4)
    y = layer(x, ids)
    want = ResidentExperts(layer.slots.store.w13, layer.slots.store.w2)(x, ids)
    assert torch.equal(y, want)


def test_lru_slot_choice_and_eviction_order():
    layer, spy = small_layer()
    slots = layer.slots
    assert slots.expert_in == [0, 1, 2] and slots.policy.order() == [0, 1, 2]
    step(layer, [1, 5])            # 1 hits; 5 takes slot 0 (LRU, not needed by the step)
    assert slots.expert_in == [5, 1, 2] and spy.copied == [5]
    assert slots.policy.order() == [2, 1, 0]
    step(layer, [2, 6, 7])         # 2 hits; 6 -> slot 1, 7 -> slot 0 (LRU order 1, 0)
    assert slots.expert_in == [7, 6, 2] and spy.copied == [5, 6, 7]
    assert slots.slot_of[5] == -1 and slots.slot_of[1] == -1
    assert slots.slot_table.tolist() == slots.slot_of  # the device copy of the map agrees
    c = slots.counters
    assert (c.hits, c.misses, c.waves, c.steps) == (2, 3, 2, 2)


def test_needed_expert_is_never_evicted_in_its_own_step():
    layer, spy = small_layer()
    step(layer, [0, 1, 6])         # 0 and 1 are LRU-oldest but needed: only slot 2 may go
    assert layer.slots.expert_in == [0, 1, 6] and spy.copied == [6]


def test_waves_exactly_when_more_than_k_experts_and_no_double_paging():
    layer, spy = small_layer()
    step(layer, [3, 4, 5])         # exactly K: one wave
    assert layer.slots.counters.waves == 1
    spy.copied.clear()
    step(layer, [0, 1, 2, 3, 4, 5, 6])   # 7 experts, K = 3: waves [3,4,5], [0,1,2], [6]
    assert layer.slots.counters.waves == 1 + 3
    assert sorted(spy.copied) == [0, 1, 2, 6] and len(set(spy.copied)) == len(spy.copied)
    assert layer.slots.slot_table.tolist() == layer.slots.slot_of


def test_stream_all_copies_every_routed_expert_every_step():
    layer, spy = small_layer(cache=False)
    step(layer, [0, 1])
    step(layer, [0, 1])
    assert spy.copied == [0, 1, 0, 1] and layer.slots.counters.hits == 0


def test_independence_check_fails_on_a_corrupting_copy():
    layer, _ = small_layer()

    class Corrupt(DirectCopy):
        def copy(self, pairs, after=None, prefetch=False):
            done = super().copy(pairs, after, prefetch)
            for dst, src in pairs:
                if src.dim() == 2 and src.shape[0] == 8 and int(src[0, 0].item()) == 5:
                    dst.view(-1)[3] += 1.0
            return done
    layer.slots.copier = Corrupt()
    with pytest.raises(ExpertCheckError, match="layer 4: expert 5 paged into slot 2 does not match"):
        check_independence(layer.slots, layer=4)


def test_independence_check_catches_mixed_experts_and_corrupted_slots():
    layer, _ = small_layer()
    check_independence(layer.slots, layer=0)
    verify_resident(layer.slots, layer=0)
    layer.slots.w2[1].view(-1)[0] += 0.5    # a slot corrupted after start-up
    with pytest.raises(ExpertCheckError, match="slot 1 does not hold expert 1"):
        verify_resident(layer.slots, layer=0)
    layer, _ = small_layer()
    store = layer.slots.store
    store.w2[[2, 3]] = store.w2[[3, 2]].clone()   # a repack that swaps two experts
    with pytest.raises(ExpertCheckError, match="host store's expert 2 differs"):
        check_independence(layer.slots, layer=0)


@pytest.mark.parametrize("k, dtype, message", [
    (3, torch.float32, "paged_experts_num_resident=3 is below top_k=4"),
    (65, torch.float32, "paged_experts_num_resident=65 is above the 64 experts"),
    (16, torch.int8, "compute in fp32, bf16 or fp16"),
])
def test_refuses_unservable_settings(k, dtype, message):
    with pytest.raises(ValueError, match=message):
        validate_num_resident(k, 64, 4, dtype)


def test_llm_refuses_k_below_top_k():
    with pytest.raises(ValueError, match="below top_k=4"):
        LLM(paged_experts_num_resident=2)


def test_prefetch_changes_no_result_and_is_counted(resident_reference):
    params, reference = resident_reference
    llm = LLM(paged_experts_num_resident=16, paged_experts_prefetch=True)
    for batch in (1, 8):
        got = llm.generate(NATURAL[:batch], params)
        assert [(o.token_ids, o.logprobs) for o in got] == \
               [(o.token_ids, o.logprobs) for o in reference[batch]]
    stats = llm.expert_stats()
    assert stats[0]["prefetched"] == 0  # layer 0 has no layer before it to predict from
    later = [stats[i] for i in range(1, 6)]
    assert all(s["prefetched"] > 0 for s in later)
    assert all(0 <= s["prefetch_hits"] <= s["prefetched"] for s in later)


def test_emulated_link_moves_the_bytes_and_holds_the_link():
    from engine.experts.copy import EmulatedLink
    src, dst = torch.arange(100, dtype=torch.uint8), torch.zeros(100, dtype=torch.uint8)
    slow = EmulatedLink(bytes_per_s=1.0)   # 100 bytes: the link stays busy for 100 s
    slow.copy([(dst, src)])
    assert torch.equal(dst, src) and not slow.idle()
    fast = EmulatedLink(bytes_per_s=1e15)
    dst2 = torch.zeros(100, dtype=torch.uint8)
    fast.copy([(dst2, src)]).wait()
    assert torch.equal(dst2, src) and fast.idle()
    with pytest.raises(ValueError, match="link bandwidth must be > 0"):
        EmulatedLink(0)
