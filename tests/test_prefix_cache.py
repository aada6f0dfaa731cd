"""The prefix cache: keys and salts, the event log, and the single-process engine with the cache
on giving the outputs it gives with the cache off (greedy tokens, logprobs within 1e-5, seeded
sampling), reusing cached prompt and output pages, never writing a cached page, and leaking
nothing under eviction pressure."""

import hashlib
import struct
import threading

import msgpack
import pytest

from engine import LLM, SamplingParams
from engine.kv_pool import CACHED
from engine.prefix_cache import ROOT, CacheEventLog, cache_salt, max_cached_pages, page_keys

SALT = cache_salt(b"secret", "tenant-a")


# ---- keys and salts ------------------------------------------------------------------------
def test_page_keys_are_the_documented_hash_chain():
    tokens = [7, 2**32 - 1, 0, 5, 9, 8, 1, 3, 4]
    keys = page_keys(SALT, tokens, 4)
    assert len(keys) == 2                                   # the partial third page has no key
    k0 = hashlib.blake2b(ROOT + SALT + struct.pack("<4I", 7, 2**32 - 1, 0, 5), digest_size=16).digest()
    k1 = hashlib.blake2b(k0 + SALT + struct.pack("<4I", 9, 8, 1, 3), digest_size=16).digest()
    assert keys == [k0, k1]
    assert page_keys(SALT, tokens[4:], 4, parent=k0) == [k1]


def test_changing_an_early_token_changes_every_later_key():
    tokens = list(range(100, 132))
    keys = page_keys(SALT, tokens, 4)
    changed = page_keys(SALT, tokens[:5] + [1] + tokens[6:], 4)
    assert changed[0] == keys[0]
    assert all(a != b for a, b in zip(changed[1:], keys[1:]))


def test_salts_separate_tenants_and_cache_salts():
    prompt = list(range(64))
    salts = [cache_salt(b"secret", "tenant-a"), cache_salt(b"secret", "tenant-b"),
             cache_salt(b"secret", "tenant-a", "conv-1"), cache_salt(b"other", "tenant-a"),
             cache_salt(b"secret", "tenant-", "aconv-1")]
    assert all(len(s) == 16 for s in salts) and len(set(salts)) == len(salts)
    assert cache_salt(b"secret", "tenant-a") == SALT
    chains = [set(page_keys(s, prompt, 16)) for s in salts]
    assert all(not (a & b) for i, a in enumerate(chains) for b in chains[i + 1:])


def test_bad_inputs_and_the_cap_on_cached_pages():
    with pytest.raises(ValueError, match="not uint32"):
        page_keys(SALT, [1, -1], 2)
    with pytest.raises(ValueError, match="page_size=0"):
        page_keys(SALT, [1], 0)
    assert [max_cached_pages(n, 16) for n in (0, 1, 16, 17, 32, 33, 48)] == [0, 0, 0, 1, 1, 2, 2]


# ---- the event log -----------------------------------------------------------------------------
def test_event_batches_reset_increment_and_compact():
    log = CacheEventLog(page_size=16, capacity=4)
    log.stored(b"a")
    log.stored(b"b")
    first, cursor = log.since(None)
    assert first == {"epoch": log.epoch, "seq": 2, "page_size": 16, "reset": True,
                     "stored": [b"a", b"b"], "evicted": []}
    log.evicted(b"a")
    log.stored(b"c")
    log.evicted(b"c")                                       # stored and gone within one batch
    batch, cursor = log.since(cursor, max_events=2)
    assert (batch["reset"], batch["stored"], batch["evicted"], cursor) == (False, [b"c"], [b"a"], 4)
    batch, cursor = log.since(cursor)
    assert (batch["stored"], batch["evicted"], cursor) == ([], [b"c"], 5)
    assert msgpack.unpackb(msgpack.packb(batch)) == batch
    for key in (b"d", b"e", b"f", b"g"):
        log.stored(key)
    behind, _ = log.since(cursor - 1)                       # fell out of the log: a snapshot
    assert behind["reset"] and behind["stored"] == [b"b", b"d", b"e", b"f", b"g"]
    assert log.since(cursor + 99)[0]["reset"]               # a cursor of another epoch
    assert CacheEventLog(16).epoch != log.epoch


def test_wait_wakes_on_an_event_and_on_close():
    log = CacheEventLog(page_size=16)
    cursor = log.seq
    assert not log.wait(cursor, 0.01)
    writer = threading.Thread(target=log.stored, args=(b"k",))
    writer.start()
    assert log.wait(cursor, 30.0)
    writer.join()
    assert log.since(cursor)[0]["stored"] == [b"k"]
    closer = threading.Thread(target=log.close)
    closer.start()
    assert log.wait(log.seq, 30.0) and log.closed
    closer.join()


# ---- the engine ----------------------------------------------------------------------------------
PREFIX = list(range(300, 348))                              # 48 tokens: three full pages
TAILS = [[], list(range(500, 516)), list(range(600, 605)), list(range(700, 723))]
PROMPTS = [PREFIX + t for t in TAILS]                       # 48, 64 (page multiples), 53, 71 tokens


def pair(**kw) -> tuple[LLM, LLM]:
    return LLM(kv_audit=True, **kw), LLM(enable_prefix_cache=False, **kw)


def assert_same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b):
        for p, q in zip(x.logprobs or [], y.logprobs or []):
            assert p.keys() == q.keys() and all(abs(p[t] - q[t]) < 1e-5 for t in p)


def assert_idle(llm: LLM):
    pool = llm.pool
    pool.check_integrity(contents=True)
    assert pool.num_free == pool.num_pages and pool.num_evictable == pool.num_cached   # no private page left


def test_greedy_with_the_cache_equals_without_and_hits_the_second_round():
    on, off = pair(kv_cache_tokens=1024, max_prefill_tokens=32)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    want = off.generate(PROMPTS, params)                    # no cache: every round gives this
    for _ in range(2):
        got = on.generate(PROMPTS, params)
        assert_same(got, want)
    assert [o.num_cached_tokens for o in got] == [32, 48, 48, 64]
    assert [o.num_cached_tokens for o in want] == [0, 0, 0, 0] and off.pool.num_cached == 0
    assert_idle(on)


def test_seeded_sampling_is_unchanged():
    on, off = pair(kv_cache_tokens=1024)
    params = [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 2)]
    want = off.generate(PROMPTS[2:], params)
    for _ in range(2):
        assert_same(on.generate(PROMPTS[2:], params), want)
    assert on.scheduler.cache_hit_tokens == 48 + 64
    assert_idle(on)


def test_the_next_turn_reuses_prompt_and_output_pages():
    on, off = pair(kv_cache_tokens=1024)
    first = on.generate(PREFIX[:44], SamplingParams(max_tokens=22, temperature=0, ignore_eos=True))[0]
    turn = PREFIX[:44] + first.token_ids + list(range(900, 906))             # 72 tokens
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
    got, want = on.generate(turn, params), off.generate(turn, params)
    assert_same(got, want)
    assert got[0].num_cached_tokens == 64                   # 44 prompt + 20 output tokens
    assert_idle(on)


def test_cache_salts_do_not_share_pages():
    on, off = pair(kv_cache_tokens=1024)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    want = off.generate(PROMPTS[:2], params)
    on.generate(PROMPTS[:2], params, cache_salt="a")
    other = on.generate(PROMPTS[:2], params, cache_salt="b")
    again = on.generate(PROMPTS[:2], params, cache_salt="a")
    assert [o.num_cached_tokens for o in other] == [0, 0] and [o.num_cached_tokens for o in again] == [32, 48]
    assert_same(other, want)
    assert_same(again, want)
    assert_idle(on)


def test_eviction_under_pressure_stays_exact_and_leaks_nothing():
    on, off = pair(kv_cache_tokens=16 * 16, max_num_seqs=3)                 # 16 pages
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
    prompts = [[1000 + 64 * i + j for j in range(48)] + [7, 8, 9] for i in range(6)]
    want = off.generate(prompts, params)
    for _ in range(2):
        for i in range(0, 6, 3):                            # three at a time: 12 of 16 pages held
            assert_same(on.generate(prompts[i:i + 3], params), want[i:i + 3])
    assert on.pool.evictions > 0
    assert_idle(on)


def test_a_cached_page_is_never_written():
    llm = LLM(kv_cache_tokens=1024, kv_audit=True)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate(PROMPTS[1], params)
    req = llm.add_request(PROMPTS[1], params)
    llm.step()                                              # admitted with 3 cached pages
    page = llm.pool.page_table(req.request_id)[0]
    assert req.num_cached_tokens == 48 and llm.pool.owner(page) == CACHED
    with pytest.raises(AssertionError, match="read-only"):
        llm.pool.mark_written(req.request_id, [page])
    while llm.scheduler.has_work():
        llm.step()
    assert_idle(llm)


def test_handoff_reservations_and_aborts():
    llm = LLM(kv_cache_tokens=1024, max_prefill_tokens=16)
    core, params = llm.core, SamplingParams(max_tokens=4, temperature=0)
    hand = core.make_request(PROMPTS[1], params, handoff=True, salt=SALT)
    core.add(hand)
    while core.scheduler.has_work():
        batch = core.schedule()
        assert batch is not None
        core.update(batch, core.run(batch))
    assert llm.pool.num_cached == 4 and llm.pool.has(hand.request_id)      # published, pages kept
    core.release(hand)                                      # detached: pages kept until now
    decode = core.make_request(PROMPTS[1], params, salt=SALT)
    assert core.allocate_for(decode, 64 + 4) == 48 == decode.num_cached_tokens
    core.release(decode)                                    # reserved outside the scheduler
    stranger = core.make_request(PROMPTS[1], params, salt=cache_salt(b"secret", "tenant-b"))
    assert core.allocate_for(stranger, 68) == 0
    core.release(stranger)
    fresh = [core.make_request(list(range(2000, 2048)), params) for _ in range(2)]
    for req in fresh:                                       # one page computed of each, none published
        core.add(req)
    batch = core.schedule()
    assert batch is not None and batch.requests == fresh[:1]
    core.update(batch, core.run(batch))
    core.abort_all()                                        # a failed step publishes nothing
    assert llm.pool.num_cached == 4
    core.add(fresh[1])
    batch = core.schedule()
    assert batch is not None
    core.update(batch, core.run(batch))
    core.release(fresh[1])                                  # a release publishes what was computed
    assert llm.pool.num_cached == 5
    assert_idle(llm)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_contents_audit_reads_pages_of_every_dtype(dtype):
    """check_integrity(contents=True) re-hashes cached pages of any pool dtype (bf16 has no numpy
    type) and notices a cached page whose bytes changed."""
    import torch

    from engine.kv_pool import PagePool
    pool = PagePool(4, 4, 2, 1, 8, getattr(torch, dtype), audit=True)
    salt = cache_salt(b"", "t")
    keys = page_keys(salt, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    pool.allocate_prefixed("a", 2, keys, salt)
    pool.kv[:, :, pool.page_table("a")] = 1.5
    pool.mark_tokens_written("a", 0, 8)
    assert pool.publish("a", keys, salt) == 2
    pool.free("a")
    pool.check_integrity(contents=True)
    pool.kv[0, 0, pool.cache.evictable()[0], 0, 0, 0] = 2.5     # a write behind the pool's back
    with pytest.raises(AssertionError):
        pool.check_integrity(contents=True)
