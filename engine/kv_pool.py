"""The paged KV cache: `PagePool` owns every page and is the only code that changes
the free list, page owners, generations or the prefix cache's reference counts.  Everyone
else reads page tables.

Storage of all layers, every KV component together:

    kv: [num_layers, components, num_pages + 1, page_size, kv_heads, head_dim]

(the last page is the scratch page: no request ever owns it; padding rows write there.)

`components` is 2 for attention that caches K and V (kv[l, 0] = K, kv[l, 1] = V) and 1 for
multi-head latent attention (one row per token: the compressed latent and the decoupled RoPE
key, kv_heads = 1).  (components, kv_heads, head_dim) is the model's `kv_geometry`.

A page is in one of three states:

    free ──allocate──▶ private ──publish──▶ cached ──evict (refcount 0, segmented LRU)──▶ private
      ▲                  │ owned by one       read-only, keyed (engine/prefix_cache.py),
      └─────free─────────┘ request, writable  shared by every request whose prefix matches

Per page the pool keeps: the owner (a request id, `CACHED`, or None when free), a generation
bumped whenever the page becomes private (a stale writer is detected after eviction and
reuse), and whether it has been written for its current owner.  Invariant:
free + private + cached == capacity; at idle no private page remains.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import torch

from engine.prefix_cache import CacheEventLog, CacheIndex

CACHED = "<cached>"          # owner(page) of a published (cached) page


class PoolExhausted(RuntimeError):
    """Not enough free pages; nothing was allocated."""


@dataclass(frozen=True)
class PageRef:
    """A page as a writer saw it: a write is valid only while the generation matches."""
    page: int
    generation: int


class PagePool:
    def __init__(self, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu",
                 enable_prefix_cache: bool = True, audit: bool = False, kv_components: int = 2) -> None:
        """`enable_prefix_cache`: publish and reuse full pages (EngineConfig's field of that name);
        `audit`: hash each page when it is published so `check_integrity(contents=True)` can prove
        no cached page was written; `kv_components`: 2 (K and V) or 1 (an MLA latent row)."""
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages}: the KV pool needs at least one page")
        if kv_components not in (1, 2):
            raise ValueError(f"kv_components={kv_components}: a KV page holds K and V (2) or one "
                             f"latent row (1)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_cache = enable_prefix_cache
        self.audit = audit
        # one page more than the pool manages: the scratch page, never allocated, transferred or
        # cached, where the padding rows of a compiled decode step write and read (engine/compiled)
        self.kv = torch.zeros(num_layers, kv_components, num_pages + 1, page_size, num_kv_heads, head_dim,
                              dtype=dtype, device=device)
        self.scratch_page = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._owner: list[str | None] = [None] * num_pages
        self._generation: list[int] = [0] * num_pages
        self._written: list[bool] = [False] * num_pages
        self._tables: dict[str, list[int]] = {}
        self._salts: dict[str, bytes] = {}            # request -> the salt of its cached pages
        self._digests: dict[int, bytes] = {}          # audit: cached page -> hash at publish
        self.events = CacheEventLog(page_size)
        self.cache = CacheIndex(num_pages, self.events)

    # ---- queries -------------------------------------------------------------
    @property
    def geometry(self) -> tuple[int, int, int]:
        """(components, kv_heads, head_dim) of every page row."""
        _, c, _, _, h, d = self.kv.shape
        return c, h, d

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free(self) -> int:
        """Pages an allocation can get: free ones plus evictable cached ones."""
        return len(self._free) + self.cache.num_evictable

    @property
    def num_used(self) -> int:
        """Pages held by requests (private, or cached and referenced)."""
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        return self.cache.num_cached

    @property
    def num_evictable(self) -> int:
        return self.cache.num_evictable

    @property
    def evictions(self) -> int:
        return self.cache.evictions

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def page_table(self, request_id: str) -> list[int]:
        """The request's pages in position order (a copy)."""
        return list(self._tables[request_id])

    def owner(self, page: int) -> str | None:
        return self._owner[page]

    def generation(self, page: int) -> int:
        return self._generation[page]

    def is_written(self, page: int) -> bool:
        return self._written[page]

    def refs(self, request_id: str) -> list[PageRef]:
        return [PageRef(p, self._generation[p]) for p in self._tables[request_id]]

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def cached_pages(self, request_id: str) -> int:
        """How many leading pages of the request's table are cached (shared, read-only)."""
        n = 0
        for p in self._tables.get(request_id, []):
            if self._owner[p] != CACHED:
                break
            n += 1
        return n

    def match(self, keys: Sequence[bytes], salt: bytes) -> int:
        """How many leading `keys` are cached with `salt` now (0 with the cache off).  Changes nothing."""
        return len(self.cache.match(keys, salt)) if self.enable_prefix_cache else 0

    # ---- ownership changes -----------------------------------------------------
    def allocate(self, request_id: str, num_pages: int) -> list[int]:
        """Give `num_pages` more private pages to `request_id` (appended to its page table),
        from the free list first, then by evicting least recently used cached pages.

        Returns the new page ids.  Raises PoolExhausted, changing nothing, when fewer
        pages are free or evictable.
        """
        if num_pages < 0:
            raise ValueError(f"num_pages={num_pages} must be >= 0")
        if num_pages > self.num_free:
            raise PoolExhausted(f"request {request_id} needs {num_pages} KV pages, "
                                f"{self.num_free} of {self.num_pages} are free")
        pages = [self._take() for _ in range(num_pages)]
        for p in pages:
            self._owner[p] = request_id
            self._generation[p] += 1
            self._written[p] = False
        self._tables.setdefault(request_id, []).extend(pages)
        return pages

    def _take(self) -> int:
        if self._free:
            p = self._free.popleft()
            assert self._owner[p] is None, f"page {p} on the free list is owned by {self._owner[p]}"
            return p
        p = self.cache.evict()
        self._digests.pop(p, None)
        self._owner[p] = None
        return p

    def allocate_prefixed(self, request_id: str, total_pages: int, keys: Sequence[bytes], salt: bytes) -> int:
        """Give a request with no pages yet `total_pages` pages: the longest prefix of `keys`
        cached with `salt` (shared: referenced, off the LRU), then private pages.  Callers cap
        `keys` at `max_cached_pages`.  Returns the number of leading cached pages (0 with the
        cache off).  Raises PoolExhausted (or ValueError for a request that holds pages),
        changing nothing."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id} already holds KV pages")
        if total_pages < 0:
            raise ValueError(f"total_pages={total_pages} must be >= 0")
        hits = self.cache.match(keys[:total_pages], salt) if self.enable_prefix_cache else []
        evictable_hits = sum(self.cache.refcount(p) == 0 for p in hits)
        private = total_pages - len(hits)
        if private > self.num_free - evictable_hits:
            raise PoolExhausted(f"request {request_id} needs {private} KV pages besides {len(hits)} "
                                f"cached, {self.num_free - evictable_hits} of {self.num_pages} are free")
        for p in hits:
            self.cache.ref(p)
        self._tables[request_id] = list(hits)
        self._salts[request_id] = salt
        self.allocate(request_id, private)
        return len(hits)

    def publish(self, request_id: str, keys: Sequence[bytes], salt: bytes) -> int:
        """Publish the request's leading written pages: logical page i < len(keys) becomes
        cached under keys[i] (still referenced by the request) unless that key is already
        cached (the page stays private).  Stops at the first unwritten page.  Returns how many
        pages were published.  Raises ValueError when `salt` differs from the request's."""
        if not self.enable_prefix_cache or request_id not in self._tables:
            return 0
        if self._salts.setdefault(request_id, salt) != salt:
            raise ValueError(f"request {request_id} publishes with a salt other than its own")
        published = 0
        for p, key in zip(self._tables[request_id], keys):
            if self._owner[p] == CACHED:
                continue
            assert self._owner[p] == request_id, f"page {p} is not owned by {request_id}"
            if not self._written[p]:
                break
            if self.cache.has_key(key):
                continue
            self._owner[p] = CACHED
            self.cache.insert(p, key, salt, refs=1)
            if self.audit:
                self._digests[p] = self.page_digest(p)
            published += 1
        return published

    def mark_tokens_written(self, request_id: str, start: int, count: int) -> None:
        """Record that positions [start, start + count) of `request_id` were written."""
        if count > 0:
            first, last = start // self.page_size, (start + count - 1) // self.page_size
            self.mark_written(request_id, self._tables[request_id][first:last + 1])

    def mark_written(self, request_id: str, pages: list[int]) -> None:
        """Record that `pages` now hold data written for `request_id`.  AssertionError for a
        cached page (read-only) or a page of another owner."""
        for p in pages:
            assert self._owner[p] != CACHED, f"page {p} is cached (read-only): {request_id} cannot write it"
            assert self._owner[p] == request_id, f"page {p} is not owned by {request_id}"
            self._written[p] = True

    def free(self, request_id: str) -> int:
        """Release every page of `request_id`: private pages to the free list, cached ones one
        reference fewer (unreferenced: evictable, the request's later pages first).  Returns how many."""
        pages = self._tables.pop(request_id, [])
        self._salts.pop(request_id, None)
        for p in reversed(pages):
            if self._owner[p] == CACHED:
                self.cache.unref(p)
        for p in pages:
            if self._owner[p] != CACHED:
                assert self._owner[p] == request_id, f"page {p} freed by {request_id}, owned by {self._owner[p]}"
                self._owner[p] = None
                self._written[p] = False
                self._free.append(p)
        return len(pages)

    # ---- invariants ------------------------------------------------------------
    def page_digest(self, page: int) -> bytes:
        """blake2b (16 bytes) of the page's bytes in every layer and component (any dtype, bf16 too)."""
        raw = self.kv[:, :, page].contiguous().view(torch.uint8).cpu()
        return hashlib.blake2b(raw.numpy().tobytes(), digest_size=16).digest()

    def check_integrity(self, contents: bool = False) -> None:
        """free + private + cached == capacity; no private page held twice or by a table other
        than its owner's; refcounts == tables holding each cached page; evictable == cached with
        refcount 0; every cached page in a table has that request's salt.  `contents` (with
        `audit`): every cached page still hashes as at publish.  AssertionError names the first
        violation."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        private: dict[int, str] = {}
        holders: dict[int, int] = {}
        for rid, pages in self._tables.items():
            for p in pages:
                assert p not in free, f"page {p} of {rid} is also on the free list"
                if self._owner[p] == CACHED:
                    holders[p] = holders.get(p, 0) + 1
                    assert self.cache.salt(p) == self._salts.get(rid), \
                        f"cached page {p} in {rid}'s table has another salt"
                    continue
                assert p not in private, f"page {p} is in the tables of {private[p]} and {rid}"
                assert self._owner[p] == rid, f"page {p} in {rid}'s table is owned by {self._owner[p]}"
                private[p] = rid
        self.cache.check(holders)
        cached = [p for p in range(self.num_pages) if p in self.cache]
        for p in cached:
            assert p not in free, f"cached page {p} is on the free list"
            assert self._owner[p] == CACHED and self._written[p], f"cached page {p} is not a written CACHED page"
        assert len(free) + len(private) + len(cached) == self.num_pages, \
            f"free {len(free)} + used {len(private)} + cached {len(cached)} != capacity {self.num_pages}"
        for p in free:
            assert self._owner[p] is None, f"free page {p} still has owner {self._owner[p]}"
        if contents and self.audit:
            for p in cached:
                assert self.page_digest(p) == self._digests[p], f"cached page {p} was written after it was published"
