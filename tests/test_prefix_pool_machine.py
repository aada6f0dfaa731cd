"""PagePool's prefix cache: exact page ids of hits, publishing and LRU eviction, read-only cached
pages, and a hypothesis state machine (admit with a prefix, write, publish, release, allocate
under pressure, reuse) checked against a reference model after every rule."""

from collections import OrderedDict

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv_pool import CACHED, PagePool, PoolExhausted
from engine.prefix_cache import PROTECTED_SHARE, cache_salt, max_cached_pages, page_keys

S = 2
SALTS = [cache_salt(b"k", "t1"), cache_salt(b"k", "t2")]
DOCS = [[1] * 12, [1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 2, 2], [2, 1] * 6]


def make_pool(pages: int = 8, **kw) -> PagePool:
    return PagePool(pages, page_size=S, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, **kw)


def prefill(pool: PagePool, rid: str, tokens: list[int], salt: bytes, total: int) -> int:
    """Admit with the cached prefix, write the rest of the prompt, publish its full pages."""
    keys = page_keys(salt, tokens, S)
    hits = pool.allocate_prefixed(rid, total, keys[:max_cached_pages(len(tokens), S)], salt)
    pool.mark_tokens_written(rid, hits * S, len(tokens) - hits * S)
    pool.publish(rid, keys, salt)
    return hits


def test_hits_share_leading_pages_and_are_read_only():
    pool = make_pool(audit=True)
    a = [1, 2, 3, 4, 5, 6, 7]
    assert prefill(pool, "a", a, SALTS[0], 4) == 0
    assert pool.page_table("a") == [0, 1, 2, 3] and pool.num_cached == 3
    assert [pool.owner(p) for p in range(4)] == [CACHED, CACHED, CACHED, "a"]
    assert prefill(pool, "b", a, SALTS[0], 5) == 3      # never the last token's page
    assert pool.page_table("b") == [0, 1, 2, 4, 5] and pool.cached_pages("b") == 3
    assert pool.cache.refcount(0) == 2 and pool.num_free == 2
    with pytest.raises(AssertionError, match="page 1 is cached"):
        pool.mark_written("b", [1])
    with pytest.raises(AssertionError, match="cached"):
        pool.mark_tokens_written("b", 0, 2)
    pool.check_integrity(contents=True)


def test_another_salt_never_hits():
    pool = make_pool()
    prefill(pool, "a", [1, 2, 3, 4, 5], SALTS[0], 3)
    assert prefill(pool, "b", [1, 2, 3, 4, 5], SALTS[1], 3) == 0
    assert pool.num_cached == 4                          # two keys per salt
    assert pool.match(page_keys(SALTS[1], [1, 2, 3, 4], S), SALTS[0]) == 0
    pool.check_integrity()


def test_release_makes_pages_evictable_later_pages_first():
    pool = make_pool(6)
    prefill(pool, "a", [1, 2, 3, 4, 5, 6, 7], SALTS[0], 4)    # pages 0-2 cached, 3 private
    pool.free("a")
    assert pool.num_free == 6 and pool.num_evictable == 3 and pool.num_used == 0
    assert pool.allocate("b", 3) == [4, 5, 3]                # the free list first
    gen = pool.generation(2)
    assert pool.allocate("b", 2) == [2, 1]                   # then the deepest cached page
    assert pool.evictions == 2 and pool.owner(2) == "b" and pool.generation(2) == gen + 1
    assert pool.match(page_keys(SALTS[0], [1, 2, 3, 4], S), SALTS[0]) == 1
    pool.check_integrity()


def test_a_reused_prefix_outlives_newer_unique_tails():
    """Segmented LRU: pages a request found in the cache are evicted only after every page no
    request reused, however recently those were released; plain LRU would take the prefix first
    (it is the oldest), which a cycle over a few more prefixes than fit turns into a miss every
    time."""
    pool = make_pool(12)
    prefix = [7, 7, 7, 7]                                      # two full pages, shared
    prefill(pool, "a", prefix + [1, 1, 1], SALTS[0], 4)       # publishes the prefix and a tail page
    assert prefill(pool, "b", prefix + [2, 2, 2], SALTS[0], 4) == 2   # a hit: the prefix is protected
    pool.free("a")
    pool.free("b")
    for i, rid in enumerate("cd"):                             # newer requests, unique tails only
        prefill(pool, rid, [9 + i] * 7, SALTS[0], 4)
        pool.free(rid)
    assert pool.num_evictable == 10 and pool.num_free == 12
    pool.allocate("x", 10)                                     # takes 2 free and evicts 8 pages
    assert pool.evictions == 8
    assert pool.match(page_keys(SALTS[0], prefix, S), SALTS[0]) == 2    # the oldest, yet kept
    pool.check_integrity()


def test_protected_pages_are_capped_and_demoted_oldest_first():
    pool = make_pool(7)                                        # at most int(7 * 0.75) = 5 protected
    for i, rid in enumerate("abc"):
        doc = [i + 1] * 4 + [0]
        prefill(pool, rid, doc, SALTS[0], 3)                   # 2 prefix pages + 1 private
        pool.free(rid)
        assert prefill(pool, rid + "2", doc, SALTS[0], 3) == 2  # a hit: protected once released
        pool.free(rid + "2")
    assert pool.evictions == 0 and pool.num_evictable == 6
    assert [pool.cache.was_hit(p) for p in pool.cache.evictable()] == [False] + [True] * 5
    first = page_keys(SALTS[0], [1] * 4, S)
    assert pool.cache.key(pool.cache.evictable()[0]) == first[1]   # demoted: the oldest protected
    pool.check_integrity()


def test_exhausted_prefixed_allocation_changes_nothing():
    pool = make_pool(4)
    prefill(pool, "a", [1, 2, 3, 4, 5], SALTS[0], 3)
    pool.free("a")                                           # 2 evictable + 2 free
    keys = page_keys(SALTS[0], [1, 2, 3, 4], S)
    with pytest.raises(PoolExhausted, match="needs 3 KV pages besides 2 cached, 2 of 4"):
        pool.allocate_prefixed("b", 5, keys, SALTS[0])
    assert not pool.has("b") and pool.num_evictable == 2 and pool.evictions == 0
    pool.allocate("c", 1)
    with pytest.raises(ValueError, match="already holds"):
        pool.allocate_prefixed("c", 1, keys, SALTS[0])
    pool.check_integrity()


def test_publish_keeps_a_duplicate_private_and_stops_at_an_unwritten_page():
    pool = make_pool()
    keys = page_keys(SALTS[0], [1, 2, 3, 4, 5, 6], S)
    pool.allocate("a", 3)
    pool.allocate("b", 3)
    pool.mark_written("a", pool.page_table("a"))
    pool.mark_written("b", pool.page_table("b")[:1])
    assert pool.publish("a", keys[:1], SALTS[0]) == 1
    assert pool.publish("b", keys, SALTS[0]) == 0            # key 0 held by a's page; page 1 unwritten
    assert pool.owner(3) == "b" and pool.publish("a", keys, SALTS[0]) == 2
    with pytest.raises(ValueError, match="salt"):
        pool.publish("a", keys, SALTS[1])
    assert pool.free("b") == 3 and pool.num_cached == 3
    pool.check_integrity()


def test_cache_off_allocates_private_pages_only():
    pool = make_pool(enable_prefix_cache=False)
    assert prefill(pool, "a", [1, 2, 3, 4, 5], SALTS[0], 3) == 0
    assert prefill(pool, "b", [1, 2, 3, 4, 5], SALTS[0], 3) == 0
    assert pool.num_cached == 0 and pool.page_table("b") == [3, 4, 5]


def test_check_integrity_catches_refcount_salt_and_content_violations():
    pool = make_pool(audit=True)
    prefill(pool, "a", [1, 2, 3, 4, 5], SALTS[0], 3)
    pool.kv[0, 0, 0, 0, 0, 0] += 1.0                          # a write behind the pool's back
    with pytest.raises(AssertionError, match="cached page 0 was written after it was published"):
        pool.check_integrity(contents=True)
    pool.kv[0, 0, 0, 0, 0, 0] -= 1.0
    pool._salts["a"] = SALTS[1]
    with pytest.raises(AssertionError, match="another salt"):
        pool.check_integrity()
    pool._salts["a"] = SALTS[0]
    pool._tables["a"].append(0)                               # held twice, counted once
    with pytest.raises(AssertionError, match="refcount 1 but 2 tables"):
        pool.check_integrity()


class PrefixPoolMachine(RuleBasedStateMachine):
    """The pool against a reference model of keys, refcounts, the segmented LRU (probationary
    pages, never hit, evicted before protected ones) and the free list."""

    def __init__(self):
        super().__init__()
        self.pool = make_pool(10, audit=True)
        self.salt_of: dict[bytes, bytes] = {}                 # cached key -> salt
        self.refs: dict[bytes, int] = {}
        self.probation: OrderedDict[bytes, None] = OrderedDict()
        self.protected: OrderedDict[bytes, None] = OrderedDict()
        self.hit: set[bytes] = set()                          # keys found by a request since published
        self.reqs: dict[str, dict] = {}                       # rid -> tokens, salt, pages (key | None)
        self.private = 0
        self.max_gen = [0] * 10
        self.cursor: int | None = None
        self.view: set[bytes] = set()

    @property
    def free_list(self) -> int:
        return 10 - self.private - len(self.salt_of)

    @property
    def num_evictable(self) -> int:
        return len(self.probation) + len(self.protected)

    def _expect_evictions(self, n: int) -> None:
        for _ in range(max(0, n - self.free_list)):
            key, _ = (self.probation if self.probation else self.protected).popitem(last=False)
            del self.salt_of[key], self.refs[key]
            self.hit.discard(key)

    def _released(self, key: bytes) -> None:
        if key not in self.hit:
            self.probation[key] = None
            return
        self.protected[key] = None
        while len(self.protected) > int(10 * PROTECTED_SHARE):
            old, _ = self.protected.popitem(last=False)
            self.hit.discard(old)
            self.probation[old] = None

    def _check_generations(self, rid: str, pages: list[int]) -> None:
        for p in pages:
            assert self.pool.generation(p) > self.max_gen[p]
            self.max_gen[p] = self.pool.generation(p)

    @rule(rid=st.sampled_from("abcd"), salt=st.sampled_from(SALTS), doc=st.sampled_from(DOCS),
          length=st.integers(1, 12), extra=st.integers(0, 2))
    def admit(self, rid, salt, doc, length, extra):
        if rid in self.reqs:
            return
        tokens = doc[:length]
        total = self.pool.pages_for(length) + extra
        keys = page_keys(salt, tokens, S)[:max_cached_pages(length, S)]
        hits = 0
        while hits < len(keys) and self.salt_of.get(keys[hits]) == salt:
            hits += 1
        evictable_hits = sum(self.refs[k] == 0 for k in keys[:hits])
        if total - hits > self.free_list + self.num_evictable - evictable_hits:
            with pytest.raises(PoolExhausted):
                self.pool.allocate_prefixed(rid, total, keys, salt)
            return
        assert self.pool.allocate_prefixed(rid, total, keys, salt) == hits
        for k in keys[:hits]:
            self.probation.pop(k, None)
            self.protected.pop(k, None)
            self.refs[k] += 1
            self.hit.add(k)
        self._expect_evictions(total - hits)
        self.private += total - hits
        self.reqs[rid] = {"tokens": doc[:total * S], "salt": salt, "pages": keys[:hits] + [None] * (total - hits),
                          "written": hits}
        self._check_generations(rid, self.pool.page_table(rid)[hits:])

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), n=st.integers(1, 3))
    def write(self, data, n):
        """Write the next `n` private pages (random contents), as a forward pass would."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs[rid]
        table = self.pool.page_table(rid)
        pages = table[r["written"]:r["written"] + n]
        for p in pages:
            self.pool.kv[:, :, p] = torch.randn_like(self.pool.kv[:, :, p])
        self.pool.mark_written(rid, pages)
        r["written"] += len(pages)

    @precondition(lambda self: any(r["pages"] and r["pages"][0] for r in self.reqs.values()))
    @rule(data=st.data())
    def write_cached(self, data):
        rid = data.draw(st.sampled_from(sorted(k for k, r in self.reqs.items() if r["pages"] and r["pages"][0])))
        with pytest.raises(AssertionError, match="read-only"):
            self.pool.mark_written(rid, self.pool.page_table(rid)[:1])

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def publish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs[rid]
        keys = page_keys(r["salt"], r["tokens"], S)
        published = 0
        for i, key in enumerate(keys[:len(r["pages"])]):
            if r["pages"][i] is not None:
                continue
            if i >= r["written"]:
                break
            if key in self.salt_of:
                continue
            r["pages"][i], self.salt_of[key], self.refs[key] = key, r["salt"], 1
            self.private -= 1
            published += 1
        assert self.pool.publish(rid, keys, r["salt"]) == published

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs.pop(rid)
        assert self.pool.free(rid) == len(r["pages"])
        for key in reversed(r["pages"]):
            if key is None:
                self.private -= 1
                continue
            self.refs[key] -= 1
            if self.refs[key] == 0:
                self._released(key)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), n=st.integers(1, 4))
    def grow(self, data, n):
        """More private pages for a running request: evicts when the free list is short."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        if n > self.free_list + self.num_evictable:
            with pytest.raises(PoolExhausted):
                self.pool.allocate(rid, n)
            return
        self._expect_evictions(n)
        self._check_generations(rid, self.pool.allocate(rid, n))
        self.private += n
        self.reqs[rid]["pages"] += [None] * n

    @invariant()
    def matches_the_model(self):
        pool = self.pool
        pool.check_integrity(contents=True)
        assert pool.num_cached == len(self.salt_of) and pool.num_evictable == self.num_evictable
        assert pool.num_free == self.free_list + self.num_evictable
        for key, salt in self.salt_of.items():
            page = pool.cache.lookup(key, salt)
            assert page is not None and pool.cache.refcount(page) == self.refs[key]
        assert [pool.cache.key(p) for p in pool.cache.evictable()] == list(self.probation) + list(self.protected)
        for rid, r in self.reqs.items():
            lead = next((i for i, k in enumerate(r["pages"]) if k is None), len(r["pages"]))
            assert pool.cached_pages(rid) == lead
        batch, self.cursor = pool.events.since(self.cursor)
        if batch["reset"]:
            self.view = set()
        self.view = (self.view - set(batch["evicted"])) | set(batch["stored"])
        assert self.view == set(self.salt_of)


TestPrefixPoolMachine = PrefixPoolMachine.TestCase
TestPrefixPoolMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
