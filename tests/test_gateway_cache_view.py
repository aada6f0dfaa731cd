"""The gateway's view of a worker's prefix cache (gateway/cache_view.py): batches folded in
(stored, evicted, reset, a new epoch, the bound), malformed ones refused, the prompt's keys,
and the subscription: resubscribed after a break, stopped by UNIMPLEMENTED, cancelled with the
pool, never opened for a worker without a cache."""

from __future__ import annotations

import asyncio

import grpc
import msgpack
import pytest

from engine.prefix_cache import cache_salt, page_keys
from gateway import cache_view
from gateway.cache_view import BadBatch, CacheBatch, CacheView, PrefixKeys, capacity_pages, decode_batch, follow
from gateway.routing import WorkerPool
from proto import worker_pb2 as wpb
from tests.workers import SECRET

IDS = list(range(1, 41))              # 40 tokens: 2 full pages of 16 may be cached (never the last token)
K = [bytes([i]) * 16 for i in range(8)]

def batch(epoch="e1", reset=False, stored=(), evicted=(), page_size=16) -> CacheBatch:
    return CacheBatch(epoch, 0, page_size, reset, list(stored), list(evicted))


def test_the_view_follows_stored_evicted_reset_and_a_new_epoch():
    v = CacheView(max_pages=100)
    v.apply(batch(reset=True, stored=K[:3]))
    assert v.cached_pages(K[:4]) == 3 and v.page_size == 16
    v.apply(batch(stored=[K[3]], evicted=[K[1]]))
    assert v.cached_pages(K[:4]) == 1 and K[3] in v and len(v) == 3      # a chain ends at the first gap
    v.apply(batch(reset=True, stored=[K[5]]))
    assert len(v) == 1 and K[5] in v                                     # a reset replaces the view
    v.apply(batch(epoch="e2", stored=[K[6]]))
    assert len(v) == 1 and K[6] in v and v.epoch == "e2"                 # a restarted worker: start over
    v.apply(batch(epoch="e2", stored=[K[7]], page_size=32))
    assert len(v) == 1 and v.page_size == 32
    v.clear()
    assert len(v) == 0 and v.page_size == 0 and v.cached_tokens(PrefixKeys(SECRET, "t", "", IDS)) == 0


def test_the_view_is_bounded_dropping_the_keys_heard_of_longest_ago():
    v = CacheView(max_pages=3)
    v.apply(batch(reset=True, stored=K[:5]))
    assert len(v) == 3 and v.dropped == 2 and K[0] not in v and K[4] in v
    v.apply(batch(stored=K[5:8]))
    assert len(v) == 3 and [k in v for k in K[5:8]] == [True] * 3
    health = wpb.HealthReply(kv_capacity_tokens=1600, kv_page_size=16)
    assert capacity_pages(health) == 100 + cache_view.VIEW_SLACK_PAGES
    with pytest.raises(ValueError, match="max_pages"):
        CacheView(0)


def test_a_malformed_batch_is_refused_naming_what_is_wrong():
    good = {"epoch": "e", "seq": 1, "page_size": 16, "reset": False, "stored": [K[0]], "evicted": []}
    assert decode_batch(msgpack.packb(good)).stored == [K[0]]
    for bad, why in ((b"\xc1", "msgpack"), (msgpack.packb([1]), "map"), (msgpack.packb({**good, "epoch": 3}), "epoch"),
                     (msgpack.packb({**good, "page_size": 0}), "page_size"),
                     (msgpack.packb({**good, "stored": [b"short"]}), "16-byte")):
        with pytest.raises(BadBatch, match=why):
            decode_batch(bad)


def test_prefix_keys_match_the_workers_and_stop_before_the_last_token():
    keys = PrefixKeys(SECRET, "acme", "", IDS)
    assert keys.get(16) == page_keys(cache_salt(SECRET, "acme", ""), IDS[:32], 16)
    assert len(keys.get(16)) == 2 and len(keys.get(8)) == 4
    assert len(PrefixKeys(SECRET, "acme", "", IDS[:32]).get(16)) == 1        # 32 tokens: the 2nd page has the last
    assert keys.get(16) != PrefixKeys(SECRET, "globex", "", IDS).get(16)
    assert keys.get(16) != PrefixKeys(SECRET, "acme", "s", IDS).get(16)


class Stream:
    """A scripted CacheEvents call: yields its batches, then raises `end` (None: ends)."""

    def __init__(self, batches: list[bytes], end: BaseException | None) -> None:
        self.batches, self.end, self.cancelled = batches, end, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for raw in self.batches:
            yield wpb.CacheEventBatch(events=raw)
        if self.end is not None:
            raise self.end

    def cancel(self) -> None:
        self.cancelled = True


class Quiet(Stream):
    """A stream that never sends."""

    def __init__(self) -> None:
        super().__init__([], None)

    async def _gen(self):
        await asyncio.Event().wait()
        yield wpb.CacheEventBatch()


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata())


def raw(reset=False, stored=(), epoch="e1") -> bytes:
    return msgpack.packb({"epoch": epoch, "seq": 1, "page_size": 16, "reset": reset, "stored": list(stored),
                          "evicted": []})


def test_a_broken_stream_clears_the_view_and_resubscribes_until_unimplemented(monkeypatch):
    monkeypatch.setattr(cache_view, "BACKOFF_MIN_S", 0.0)
    view = CacheView(100)
    seen: list[int] = []
    calls = iter([Stream([raw(True, K[:2])], rpc_error(grpc.StatusCode.UNAVAILABLE)),
                  Stream([raw(True, K[:1]), b"not msgpack"], None),
                  Stream([], None),
                  Stream([raw(True, K[:3])], rpc_error(grpc.StatusCode.UNIMPLEMENTED))])
    opened: list[Stream] = []

    def subscribe() -> Stream:
        seen.append(len(view))            # what the view held when the next stream opened
        opened.append(next(calls))
        return opened[-1]

    asyncio.run(asyncio.wait_for(follow(view, subscribe, "w"), 10))
    assert seen == [0, 0, 0, 0] and len(view) == 0         # cleared after each break, and at the end
    assert all(s.cancelled for s in opened) and len(opened) == 4


def test_the_subscription_is_cancelled_with_the_pool():
    async def main() -> None:
        pool = WorkerPool(("127.0.0.1:1",), ("127.0.0.1:2",), (), SECRET)
        w = pool.workers[0]
        w.health = wpb.HealthReply(ready=True, kv_capacity_tokens=1024, kv_page_size=16, prefix_cache=True)

        class Stub:
            def CacheEvents(self, request):
                return Quiet()
        w.decode_stub = Stub()  # type: ignore[assignment]
        pool._follow(w)
        task = w.cache_task
        assert task is not None and w.cache is not None and w.cache.max_pages == 64 + cache_view.VIEW_SLACK_PAGES
        await asyncio.sleep(0.01)
        await pool.close()
        assert task.cancelled() and w.cache_task is None
        off = pool.workers[1]
        off.health = wpb.HealthReply(ready=True, kv_capacity_tokens=1024, kv_page_size=16, prefix_cache=False)
        pool._follow(off)
        assert off.cache_task is None                    # a worker without a prefix cache: not followed
    asyncio.run(main())
