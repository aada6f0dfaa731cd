"""The content-addressed prefix cache: page keys, salts, the cache's event log and the index
the `PagePool` keeps of its published pages.  Torch-free: the gateway computes the same keys
to score workers by the prefix they hold.

A full page of tokens is named by a hash chain over the pages before it:

    key_0 = H(ROOT  || salt || tokens[0:S])        H = blake2b, 16-byte digest
    key_i = H(key_{i-1} || salt || tokens[i*S:(i+1)*S])      tokens as little-endian uint32

so a key stands for the whole prefix up to the end of its page, and two requests share a page
only when every token before it and the salt agree.  The salt is derived from the tenant with
the cluster secret (`cache_salt`): one tenant's keys never name another tenant's pages.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import threading
from collections import OrderedDict, deque
from typing import Any, Sequence

__all__ = ["KEY_BYTES", "ROOT", "CacheEventLog", "CacheIndex", "cache_salt", "max_cached_pages", "page_keys"]

KEY_BYTES = 16
ROOT = bytes(KEY_BYTES)
_SALT_LABEL = b"tandem-prefix-cache\0"


def cache_salt(secret: bytes, tenant: str, salt: str = "") -> bytes:
    """The 16-byte salt of a tenant's cache entries (plus the request's optional `cache_salt`,
    which splits a tenant's cache further): HMAC-SHA256 keyed with the cluster secret."""
    msg = _SALT_LABEL + tenant.encode() + b"\0" + salt.encode()
    return hmac.new(secret, msg, hashlib.sha256).digest()[:KEY_BYTES]


def page_keys(salt: bytes, token_ids: Sequence[int], page_size: int, parent: bytes = ROOT) -> list[bytes]:
    """One 16-byte key per FULL page of `token_ids` (a partial last page has none), chained from
    `parent`.  Raises ValueError for a page size < 1 or a token id outside uint32."""
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be >= 1")
    keys: list[bytes] = []
    pack = struct.Struct(f"<{page_size}I").pack
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        try:
            data = pack(*token_ids[start:start + page_size])
        except struct.error:
            raise ValueError(f"token ids of page {start // page_size} are not uint32") from None
        parent = hashlib.blake2b(parent + salt + data, digest_size=KEY_BYTES).digest()
        keys.append(parent)
    return keys


def max_cached_pages(prompt_len: int, page_size: int) -> int:
    """How many leading pages of a prompt a cache hit may cover: never its last token (whose
    logits must be computed), so at least one page is always computed and transferred."""
    return max(0, (prompt_len - 1) // page_size)


class CacheEventLog:
    """A bounded, thread-safe log of a pool's cache changes (pages stored and evicted, by key)
    that subscribers read in batches.  `epoch` (random per log: per process) tells a subscriber
    that the worker restarted.  The pool appends; RPC threads read with `since`/`wait`."""

    def __init__(self, page_size: int, capacity: int = 8192, epoch: str | None = None):
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1")
        self.page_size = page_size
        self.epoch = epoch or secrets.token_hex(8)
        self._events: deque[tuple[bool, bytes]] = deque(maxlen=capacity)   # (stored?, key)
        self._next = 0                            # seq of the next event appended
        self._live: dict[bytes, None] = {}        # keys cached now, in the order stored
        self._cond = threading.Condition()
        self._closed = False

    @property
    def seq(self) -> int:
        """The seq the next event will get (a subscriber that has read everything holds it)."""
        with self._cond:
            return self._next

    def stored(self, key: bytes) -> None:
        self._append(True, key)

    def evicted(self, key: bytes) -> None:
        self._append(False, key)

    def _append(self, stored: bool, key: bytes) -> None:
        with self._cond:
            if stored:
                self._live[key] = None
            else:
                self._live.pop(key, None)
            self._events.append((stored, key))
            self._next += 1
            self._cond.notify_all()

    def since(self, cursor: int | None, max_events: int = 1024) -> tuple[dict[str, Any], int]:
        """The changes from seq `cursor` on (at most `max_events`), and the cursor to pass next.

        The batch is the msgpack map of proto/worker.proto's CacheEventBatch: {"epoch", "seq"
        (the next cursor), "page_size", "reset", "stored", "evicted"}; a key is in at most one
        of the lists (its state at the end of the batch).  When `cursor` is None or no longer in
        the log (the subscriber fell behind, or it is from another epoch), the batch is a reset:
        `stored` holds every key cached now.  Changes nothing."""
        with self._cond:
            first = self._next - len(self._events)
            if cursor is None or not first <= cursor <= self._next:
                return self._batch(True, list(self._live), [], self._next), self._next
            end = min(self._next, cursor + max(1, max_events))
            state: dict[bytes, bool] = {}
            for i in range(cursor - first, end - first):
                stored, key = self._events[i]
                state.pop(key, None)
                state[key] = stored
            stored_keys = [k for k, s in state.items() if s]
            evicted_keys = [k for k, s in state.items() if not s]
            return self._batch(False, stored_keys, evicted_keys, end), end

    def _batch(self, reset: bool, stored: list[bytes], evicted: list[bytes], seq: int) -> dict[str, Any]:
        return {"epoch": self.epoch, "seq": seq, "page_size": self.page_size, "reset": reset,
                "stored": stored, "evicted": evicted}

    def wait(self, cursor: int | None, timeout_s: float) -> bool:
        """Block up to `timeout_s` until `since(cursor)` has something new (or the log closed).
        Returns whether it has."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._closed or cursor is None or cursor != self._next, timeout=max(0.0, timeout_s))

    def close(self) -> None:
        """Wake every waiter (the worker is stopping); `closed` tells streams to end."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed


PROTECTED_SHARE = 0.75   # of the pool: evictable pages that were hit, kept before any never hit


class CacheIndex:
    """The pool's published pages: key -> page, per page its key, salt and reference count, and
    the evictable pages (cached, referenced by no request) in eviction order.

    Eviction is a segmented LRU: a page some request found in the cache (a hit) is *protected*,
    one only its publisher held is *probationary*; the least recently used probationary page
    goes first, a protected one only when no probationary page is left.  So the unique tails of
    finished requests (their questions and answers) go before a shared prefix that is reused,
    however recently they were released; with plain LRU a cycle over slightly more prefixes than
    fit evicts each one just before it is needed.  At most PROTECTED_SHARE of the pool stays
    protected: past that the least recently used protected page is demoted to the newest
    probationary one, so a prefix that stopped being used cannot hold the pool forever.

    Only `PagePool` calls the mutating methods; every store and eviction is appended to `events`."""

    def __init__(self, num_pages: int, events: CacheEventLog):
        self.events = events
        self._page_of: dict[bytes, int] = {}
        self._key: list[bytes | None] = [None] * num_pages
        self._salt: list[bytes | None] = [None] * num_pages
        self._refs = [0] * num_pages
        self._hit = [False] * num_pages                          # found by a request since published
        self._probation: OrderedDict[int, None] = OrderedDict()  # evictable, never hit; oldest first
        self._protected: OrderedDict[int, None] = OrderedDict()  # evictable, hit; oldest first
        self._protected_cap = max(1, int(num_pages * PROTECTED_SHARE))
        self.evictions = 0

    # ---- queries ---------------------------------------------------------------------
    def __contains__(self, page: int) -> bool:
        return self._key[page] is not None

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    @property
    def num_evictable(self) -> int:
        return len(self._probation) + len(self._protected)

    def evictable(self) -> list[int]:
        """The evictable pages in eviction order: probationary oldest first, then protected."""
        return list(self._probation) + list(self._protected)

    def was_hit(self, page: int) -> bool:
        return self._hit[page]

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def salt(self, page: int) -> bytes | None:
        return self._salt[page]

    def key(self, page: int) -> bytes | None:
        return self._key[page]

    def lookup(self, key: bytes, salt: bytes) -> int | None:
        """The cached page under `key` with `salt`, or None."""
        page = self._page_of.get(key)
        return page if page is not None and self._salt[page] == salt else None

    def match(self, keys: Sequence[bytes], salt: bytes) -> list[int]:
        """The pages of the longest prefix of `keys` that is cached with `salt`."""
        pages: list[int] = []
        for key in keys:
            page = self.lookup(key, salt)
            if page is None:
                break
            pages.append(page)
        return pages

    def has_key(self, key: bytes) -> bool:
        return key in self._page_of

    # ---- changes (the pool's) ----------------------------------------------------------
    def ref(self, page: int) -> None:
        """A request found `page` in the cache: one reference more, and the page is protected."""
        assert page in self, f"page {page} is not cached"
        if self._refs[page] == 0:
            (self._protected if self._hit[page] else self._probation).pop(page)
        self._refs[page] += 1
        self._hit[page] = True

    def unref(self, page: int) -> None:
        """One reference fewer; at zero the page becomes the most recently used evictable one of
        its segment."""
        assert self._refs[page] > 0, f"cached page {page} released more often than referenced"
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._release(page)

    def _release(self, page: int) -> None:
        if not self._hit[page]:
            self._probation[page] = None
            return
        self._protected[page] = None
        while len(self._protected) > self._protected_cap:
            oldest, _ = self._protected.popitem(last=False)
            self._hit[oldest] = False                  # demoted: it must be hit again to return
            self._probation[oldest] = None

    def insert(self, page: int, key: bytes, salt: bytes, refs: int) -> None:
        """Publish `page` under `key` (not cached yet), held by `refs` requests."""
        assert page not in self and key not in self._page_of, f"page {page} or its key is already cached"
        self._page_of[key] = page
        self._key[page], self._salt[page], self._refs[page] = key, salt, refs
        self._hit[page] = False
        if refs == 0:
            self._probation[page] = None
        self.events.stored(key)

    def evict(self) -> int:
        """Drop the next evictable page (the oldest probationary one, else the oldest protected)
        from the cache; returns it (the caller reuses it).  Raises KeyError when none is evictable."""
        segment = self._probation if self._probation else self._protected
        page, _ = segment.popitem(last=False)
        key = self._key[page]
        assert key is not None and self._refs[page] == 0
        del self._page_of[key]
        self._key[page] = self._salt[page] = None
        self._hit[page] = False
        self.evictions += 1
        self.events.evicted(key)
        return page

    def check(self, holders: dict[int, int]) -> None:
        """`holders`: cached page -> number of page tables holding it.  Raises AssertionError
        naming the first inconsistency of refcounts, the LRU or the key map."""
        for key, page in self._page_of.items():
            assert self._key[page] == key, f"key map names page {page}, whose key differs"
        cached = {p for p, k in enumerate(self._key) if k is not None}
        assert len(cached) == len(self._page_of), "a cached page is missing from the key map"
        for p in cached:
            assert self._refs[p] == holders.get(p, 0), \
                f"cached page {p} has refcount {self._refs[p]} but {holders.get(p, 0)} tables hold it"
            assert self._salt[p] is not None, f"cached page {p} has no salt"
        extra = set(holders) - cached
        assert not extra, f"pages {sorted(extra)} are held as cached but are not in the cache"
        evictable = {p for p in cached if self._refs[p] == 0}
        listed = self.evictable()
        assert len(listed) == len(set(listed)) and set(listed) == evictable, \
            f"evictable pages {sorted(listed)} != cached pages with refcount 0 {sorted(evictable)}"
        assert all(self._hit[p] for p in self._protected) and not any(self._hit[p] for p in self._probation), \
            "a page is in the wrong eviction segment"
        assert len(self._protected) <= self._protected_cap, "more protected pages than the cap"
        assert all(r == 0 for p, r in enumerate(self._refs) if p not in cached), "a non-cached page has references"
