"""The gateway's side of the prefix cache: `cache_salt` (checked, passed on), the cached tokens
in `usage`, the view of each worker's cache built from its CacheEvents stream, and routing
that weighs the cached prefix against load.  Fake workers (tests/gateway_helpers.py) play the
workers' side from a script."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import grpc
import msgpack
import pytest

from engine.prefix_cache import cache_salt, page_keys
from gateway import cache_view
from gateway.cache_view import BadBatch, CacheBatch, CacheView, PrefixKeys, capacity_pages, decode_batch, follow
from gateway.routing import Worker, WorkerPool, choose
from proto import worker_pb2 as wpb
from tests.gateway_helpers import FakeWorker, get, post, start_gateway, wait_ready
from tests.workers import SECRET
from worker.types import Role

IDS = list(range(1, 41))              # 40 tokens: 2 full pages of 16 may be cached (never the last token)
K = [bytes([i]) * 16 for i in range(8)]


def text(ids=IDS, **kw):
    return {"model": "tiny-moe", "prompt": ids, "max_tokens": 2, **kw}


@pytest.fixture()
def fakes() -> Iterator[tuple[FakeWorker, FakeWorker, FakeWorker]]:
    """Two fake decode workers (a, b) and a fake prefill worker."""
    prefill = FakeWorker("prefill")
    a, b = FakeWorker(), FakeWorker()
    a.peer = b.peer = prefill
    yield a, b, prefill
    for w in (a, b, prefill):
        w.stop()


def gateway(decode, prefill, **kw):
    gw = start_gateway([w.address for w in decode], [prefill.address], **kw)
    wait_ready(gw.url)
    return gw


def wait_for(cond, what: str, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def view_pages(url: str) -> dict[str, int | None]:
    status, body = get(url, "/v1/server_info")
    assert status == 200
    return {w["address"]: (w["prefix_cache"] or {}).get("routing_view_pages") for w in json.loads(body)["workers"]}


# ---- cache_salt and usage ------------------------------------------------------------------------
def test_a_cache_salt_over_the_limit_is_refused_naming_it_and_nothing_is_forwarded(fakes):
    a, _, prefill = fakes
    gw = gateway([a], prefill)
    try:
        for path, body in (("/v1/completions", text(cache_salt="s" * 257)),
                           ("/v1/chat/completions", {"model": "tiny-moe", "cache_salt": "s" * 300,
                                                     "messages": [{"role": "user", "content": "hi"}]})):
            status, err = post(gw.url, path, body)
            assert status == 400 and err["error"]["param"] == "cache_salt"
            assert "at most 256" in err["error"]["message"]
        assert a.generated == [] and prefill.prefilled == []
        status, _ = post(gw.url, "/v1/completions", text(cache_salt="s" * 256))
        assert status == 200
        assert a.generated[-1].cache_salt == "s" * 256 and prefill.prefilled[-1].cache_salt == "s" * 256
    finally:
        gw.stop()


def test_usage_reports_the_cached_prompt_tokens_per_tenant_and_salt(fakes):
    a, _, prefill = fakes
    gw = gateway([a], prefill)
    try:
        status, first = post(gw.url, "/v1/completions", text())
        assert status == 200 and first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert prefill.prefilled[-1].decode_cached_tokens == 0
        status, again = post(gw.url, "/v1/completions", text())
        assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}       # 2 pages of 16
        assert prefill.prefilled[-1].decode_cached_tokens == 32        # the reservation's boundary, passed on
        _, other_tenant = post(gw.url, "/v1/completions", text(), key="sk-other")
        _, other_salt = post(gw.url, "/v1/completions", text(cache_salt="mine"))
        assert other_tenant["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert other_salt["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        status, events = post(gw.url, "/v1/completions", text(stream=True, stream_options={"include_usage": True}))
        assert status == 200 and events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 32} and usage["prompt_tokens"] == 40
    finally:
        gw.stop()


# ---- the view of a worker's cache ------------------------------------------------------------------
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


# ---- routing -------------------------------------------------------------------------------------
def worker(address: str, load: int, cached: list[bytes] = (), role: Role = Role.DECODE) -> Worker:
    w = Worker(address, role)
    w.health = wpb.HealthReply(ready=True, kv_capacity_tokens=1 << 20, kv_page_size=16, prefix_cache=True)
    w.stats = wpb.StatsReply(running=load if role != Role.PREFILL else 0, kv_tokens_free=1 << 20,
                             waiting_tokens=load if role == Role.PREFILL else 0)
    w.cache = CacheView(1000)
    w.cache.apply(batch(reset=True, stored=cached))
    return w


def test_the_worker_holding_the_prefix_wins_within_the_load_slack():
    keys = PrefixKeys(SECRET, "acme", "", IDS)
    hot = keys.get(16)
    a, b, c = worker("a", 2), worker("b", 4, hot), worker("c", 3, hot[:1])
    assert choose([a, b, c], keys, 2) is b                 # 4 <= 2 + 1 + 2: the whole prefix
    b.stats.running = 6                                     # past the slack: the next longest within it
    assert choose([a, b, c], keys, 2) is c
    c.stats.running = 7
    assert choose([a, b, c], keys, 2) is a                  # none within: the least loaded
    assert choose([a, b, c], None, 2) is a                  # no keys: load alone
    cold = PrefixKeys(SECRET, "acme", "", [7] * 40)
    b.stats.running = 2
    assert choose([b, a], cold, 2) is b                     # a tie on both: the first known
    assert choose([], keys, 2) is None


def test_routing_by_load_ignores_the_cache_and_prefill_is_weighed_in_tokens():
    keys = PrefixKeys(SECRET, "acme", "", IDS)
    pool = WorkerPool((), (), (), SECRET)
    pool.workers = [worker("a", 1), worker("b", 2, keys.get(16)), worker("p", 100, role=Role.PREFILL),
                    worker("q", 160, keys.get(16), Role.PREFILL)]
    pool.workers[0].role = pool.workers[1].role = Role.COLOCATED
    assert pool.pick_decode(100, set(), keys).address == "b"
    assert pool.pick_prefill(set(), keys, 40).address == "q"   # 160 <= 100 + 50 + 40
    assert pool.pick_prefill(set(), keys, 0).address == "p"    # 160 > 100 + 50
    pool.routing = "load"
    assert pool.pick_decode(100, set(), keys).address == "a"
    assert pool.pick_prefill(set(), keys, 40).address == "p"


def test_the_gateway_sends_a_repeated_prompt_to_the_decode_worker_that_cached_it(fakes):
    a, b, prefill = fakes
    a.stats.running = 1                        # the first request goes to b, the least loaded
    gw = gateway([a, b], prefill)
    try:
        wait_for(lambda: view_pages(gw.url)[b.address] is not None, "b's subscription")
        assert post(gw.url, "/v1/completions", text())[0] == 200
        assert [len(a.generated), len(b.generated)] == [0, 1]
        wait_for(lambda: view_pages(gw.url)[b.address] == 2, "b's cache events")
        b.stats.running = 2                    # b is now busier than a, but within the slack
        b.stats.kv_tokens_used = 7             # a marker: the gateway has read these stats
        wait_for(lambda: f'tandem_worker_kv_used_tokens{{role="decode",worker="{b.address}"}} 7.0'
                 in get(gw.url, "/metrics")[1], "b's stats")
        _, body = post(gw.url, "/v1/completions", text())
        assert [len(a.generated), len(b.generated)] == [0, 2]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    finally:
        gw.stop()
    gw = gateway([a, b], prefill, routing="load")          # the same, routed by load alone
    try:
        _, body = post(gw.url, "/v1/completions", text())
        assert [len(a.generated), len(b.generated)] == [1, 2]
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert all(n is None for n in view_pages(gw.url).values())     # nothing followed
    finally:
        gw.stop()


def test_metrics_and_server_info_show_each_workers_cache(fakes):
    a, _, prefill = fakes
    a.stats.cache_query_tokens, a.stats.cache_hit_tokens, a.stats.kv_pages_cached = 400, 100, 9
    a.stats.cache_evictions, a.stats.transfer_bytes_accepted = 3, 12345
    prefill.cache_events = False                           # an older worker: UNIMPLEMENTED
    gw = gateway([a], prefill)
    try:
        lab = f'{{role="decode",worker="{a.address}"}}'
        want = [f"tandem_worker_cache_query_tokens{lab} 400.0", f"tandem_worker_cache_hit_tokens{lab} 100.0",
                f"tandem_worker_kv_pages_cached{lab} 9.0", f"tandem_worker_cache_evictions{lab} 3.0",
                f"tandem_worker_transfer_bytes_accepted{lab} 12345.0"]
        wait_for(lambda: all(line in get(gw.url, "/metrics")[1] for line in want), "the cache gauges")
        info = {w["address"]: w["prefix_cache"] for w in json.loads(get(gw.url, "/v1/server_info")[1])["workers"]}
        assert info[a.address]["cached_pages"] == 9 and info[a.address]["hit_rate"] == 0.25
        assert info[a.address]["evictions"] == 3 and info[a.address]["enabled"] is True
        pool = gw.app.state.gateway.pool
        p = next(w for w in pool.workers if w.address == prefill.address)
        wait_for(lambda: not p.cache_events, "the prefill worker's UNIMPLEMENTED")
        assert p.cache is None or len(p.cache) == 0
    finally:
        gw.stop()
