"""What each worker's prefix cache holds, as the gateway sees it: the page keys a worker's
`CacheEvents` stream reports stored and evicted (msgpack batches, format in
proto/worker.proto), folded into a bounded `CacheView`, and the keys of a request's prompt
(`PrefixKeys`) to look up in it.  gateway/routing.py weighs the views against load.

A view is an estimate, never a promise: the decode worker matches the prompt against its own
cache when it reserves, and the response's `cached_tokens` is what it found.  So the view may
lag (events in flight), lose keys (its bound, a broken stream) or hold a few the worker has
just evicted; a wrong guess costs a cache miss, never a wrong answer.

    view = CacheView(max_pages=capacity_pages(health))
    view.apply(decode_batch(msg.events))          # each batch of the stream, in order
    view.cached_pages(keys.get(view.page_size))   # leading pages of the prompt it holds
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import msgpack

from engine.prefix_cache import KEY_BYTES, cache_salt, max_cached_pages, page_keys
from proto import worker_pb2 as wpb

log = logging.getLogger("tandem.gateway")
VIEW_SLACK_PAGES = 64             # a view holds the worker's capacity in pages plus this much
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.1, 5.0   # resubscribing after a broken stream


class BadBatch(ValueError):
    """A CacheEvents batch that is not the documented msgpack map."""


@dataclass(frozen=True)
class CacheBatch:
    epoch: str                    # the worker process's: a new one means a restarted worker
    seq: int
    page_size: int
    reset: bool                   # `stored` replaces the view (a snapshot)
    stored: list[bytes]
    evicted: list[bytes]


def decode_batch(raw: bytes) -> CacheBatch:
    """One batch from its msgpack bytes; raises BadBatch naming what is wrong."""
    try:
        m = msgpack.unpackb(raw, raw=False)
    except Exception as e:  # msgpack raises several types (ExtraData, FormatError, ValueError, ...)
        raise BadBatch(f"not msgpack: {type(e).__name__}") from None
    if not isinstance(m, dict):
        raise BadBatch(f"expected a map, got {type(m).__name__}")
    epoch, seq, size, reset = m.get("epoch"), m.get("seq", 0), m.get("page_size"), m.get("reset", False)
    if not isinstance(epoch, str) or not isinstance(seq, int) or not isinstance(reset, bool):
        raise BadBatch("epoch (str), seq (int) and reset (bool) are required")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise BadBatch(f"page_size={size!r} must be a positive integer")
    lists = {name: m.get(name, []) for name in ("stored", "evicted")}
    for name, keys in lists.items():
        if not isinstance(keys, list) or not all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys):
            raise BadBatch(f"{name} must be a list of {KEY_BYTES}-byte keys")
    return CacheBatch(epoch, seq, size, reset, lists["stored"], lists["evicted"])


def capacity_pages(health: wpb.HealthReply) -> int:
    """The most keys a view of this worker holds: its KV pool in pages, plus VIEW_SLACK_PAGES
    (events of evictions and stores may cross)."""
    size = max(health.kv_page_size, 1)
    return health.kv_capacity_tokens // size + VIEW_SLACK_PAGES


class CacheView:
    """The page keys one worker's prefix cache holds, as its stream reported them: at most
    `max_pages` (past that the keys heard of longest ago are dropped first)."""

    def __init__(self, max_pages: int) -> None:
        if max_pages < 1:
            raise ValueError(f"max_pages={max_pages} must be >= 1")
        self.max_pages = max_pages
        self.epoch: str | None = None
        self.page_size = 0            # 0: nothing heard yet
        self.dropped = 0              # keys dropped for the bound
        self.batches = 0              # batches applied, in all
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def apply(self, batch: CacheBatch) -> None:
        """Fold one batch in.  A reset batch, a new epoch (the worker restarted) or a new page
        size replaces what the view held; then evicted keys leave and stored keys enter (a batch
        names a key in at most one list: its state at the batch's end)."""
        if batch.reset or batch.epoch != self.epoch or batch.page_size != self.page_size:
            self._keys.clear()
        self.epoch, self.page_size = batch.epoch, batch.page_size
        for key in batch.evicted:
            self._keys.pop(key, None)
        for key in batch.stored:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.max_pages:
            self._keys.popitem(last=False)
            self.dropped += 1
        self.batches += 1

    def clear(self) -> None:
        """Forget everything (the stream broke: what it said may no longer hold)."""
        self._keys.clear()
        self.epoch, self.page_size = None, 0

    def cached_pages(self, keys: Sequence[bytes]) -> int:
        """How many leading keys of `keys` the view holds (a chain: the first missing one ends it)."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            n += 1
        return n

    def cached_tokens(self, keys: PrefixKeys | None) -> int:
        """The prompt's leading tokens the worker is expected to hold (0 without keys or view)."""
        if keys is None or self.page_size == 0:
            return 0
        return self.cached_pages(keys.get(self.page_size)) * self.page_size


class PrefixKeys:
    """A prompt's page keys under its tenant's salt, per page size, each size computed once
    (engine/prefix_cache.py: the keys the workers' caches use, capped at max_cached_pages)."""

    def __init__(self, secret: bytes, tenant: str, salt: str, ids: Sequence[int]) -> None:
        self._salt = cache_salt(secret, tenant, salt)
        self._ids = ids
        self._by_size: dict[int, list[bytes]] = {}

    def get(self, page_size: int) -> list[bytes]:
        keys = self._by_size.get(page_size)
        if keys is None:
            ids = self._ids[:max_cached_pages(len(self._ids), page_size) * page_size]
            keys = self._by_size[page_size] = page_keys(self._salt, ids, page_size)
        return keys


Subscribe = Callable[[], Any]     # () -> a CacheEvents call (async iterable of CacheEventBatch, cancel())


async def follow(view: CacheView, subscribe: Subscribe, name: str) -> None:
    """Keeps `view` in step with a worker's CacheEvents stream until cancelled.  A stream that
    breaks (or ends, or sends a malformed batch) clears the view and is opened again after a
    backoff (BACKOFF_MIN_S doubling to BACKOFF_MAX_S; back to the minimum after a stream that
    delivered a batch).  Returns when the worker answers UNIMPLEMENTED (it has no cache to
    follow), the view cleared."""
    delay = BACKOFF_MIN_S
    while True:
        call, seen = subscribe(), view.batches
        try:
            async for msg in call:
                view.apply(decode_batch(msg.events))
            log.info("cache events of %s: the stream ended; resubscribing", name)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                view.clear()
                log.info("worker %s streams no cache events: prefix routing ignores its cache", name)
                return
            log.info("cache events of %s: %s; resubscribing", name, e.code().name)
        except BadBatch as e:
            log.warning("cache events of %s: a malformed batch (%s); resubscribing", name, e)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise             # the pool let the worker go, or closed
            # else grpc.aio raised it in a read: the channel was closed under the call
        finally:
            call.cancel()
        view.clear()
        delay = BACKOFF_MIN_S if view.batches > seen else delay
        await asyncio.sleep(delay)
        delay = min(delay * 2, BACKOFF_MAX_S)
