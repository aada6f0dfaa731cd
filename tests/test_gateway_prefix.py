"""The gateway's side of the prefix cache: `cache_salt` (checked, passed on), the cached tokens
in `usage`, routing that weighs each worker's cached prefix against its load, the cache in
/metrics and /v1/server_info, and `tandem serve --no-prefix-cache --routing`.  Fake workers
(tests/gateway_helpers.py) play the workers' side from a script; the view of a worker's cache
is tested in test_gateway_cache_view.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from gateway.cache_view import CacheBatch, CacheView, PrefixKeys
from gateway.config import GatewayConfig
from gateway.routing import Worker, WorkerPool, choose
from proto import worker_pb2 as wpb
from tests.gateway_helpers import FakeWorker, get, post, start_gateway, wait_ready
from tests.workers import SECRET
from worker.types import Role

IDS = list(range(1, 41))              # 40 tokens: 2 full pages of 16 may be cached (never the last token)


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
        assert prefill.prefilled[-1].cached_tokens == 0
        status, again = post(gw.url, "/v1/completions", text())
        assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}       # 2 pages of 16
        assert prefill.prefilled[-1].cached_tokens == 32        # the reservation's boundary, passed on
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


# ---- routing -------------------------------------------------------------------------------------
def worker(address: str, load: int, cached: list[bytes] = (), role: Role = Role.DECODE) -> Worker:
    w = Worker(address, role)
    w.health = wpb.HealthReply(ready=True, kv_capacity_tokens=1 << 20, kv_page_size=16, prefix_cache=True)
    w.stats = wpb.StatsReply(running=load if role != Role.PREFILL else 0, kv_tokens_free=1 << 20,
                             waiting_tokens=load if role == Role.PREFILL else 0)
    w.cache = CacheView(1000)
    w.cache.apply(CacheBatch("e1", 0, 16, True, list(cached), []))
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


def test_serve_flags_turn_the_cache_off_on_every_worker_and_choose_the_routing():
    from deploy.cli import build_parser, serve_settings
    args = build_parser().parse_args(["serve", "--no-prefix-cache", "--routing", "load"])
    s = serve_settings(args)
    assert s.engine.enable_prefix_cache is False and s.gateway.routing == "load"
    s = serve_settings(build_parser().parse_args(["serve"]))
    assert s.engine.enable_prefix_cache is True and s.gateway.routing == "prefix"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--routing", "random"])
    with pytest.raises(ValueError, match="routing"):
        GatewayConfig(decode_workers=("127.0.0.1:1",), prefill_workers=("127.0.0.1:2",), cluster_secret=SECRET,
                      routing="random")


def test_real_workers_report_cached_tokens_and_the_router_follows_their_cache():
    from tests.gateway_helpers import gateway_cluster
    from tests.workers import config
    prompt = {"model": "tiny-moe", "prompt": [5 + i % 300 for i in range(100)], "max_tokens": 3,
              "temperature": 0, "ignore_eos": True}
    with gateway_cluster(config(), config()) as (gw, decode, prefill):
        _, first = post(gw.url, "/v1/completions", prompt)
        _, again = post(gw.url, "/v1/completions", prompt)
        _, other = post(gw.url, "/v1/completions", prompt, key="sk-other")
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0 and cached % 16 == 0 and cached < 100              # whole pages, never the last token
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0   # another tenant's salt
        assert again["choices"][0]["text"] == first["choices"][0]["text"] == other["choices"][0]["text"]
        wait_for(lambda: (view_pages(gw.url)[decode.address] or 0) >= cached // 16, "the decode worker's events")
        pool = gw.app.state.gateway.pool
        keys = PrefixKeys(SECRET, "acme", "", prompt["prompt"])
        w = next(w for w in pool.workers if w.address == decode.address)
        assert w.cached_tokens(keys) == cached                  # the view agrees with the worker


def test_load_counts_this_gateways_requests_once():
    """A worker's load is this gateway's requests now plus what its last Stats counted beyond
    this gateway's own at that moment (other gateways'): never this gateway's twice."""
    w = Worker("d0", Role.DECODE)
    w.outstanding = 4
    w.mine_at_stats = (4, 0)
    w.stats = wpb.StatsReply(running=3, waiting=1)       # all four were this gateway's
    assert w.load == 4
    w.outstanding = 2                                    # two finished since the Stats
    assert w.load == 2
    w.stats = wpb.StatsReply(running=6, waiting=1)       # three more from another gateway
    assert w.load == 5
    p = Worker("p0", Role.PREFILL)
    p.queued_tokens, p.mine_at_stats = 100, (0, 300)
    p.stats = wpb.StatsReply(waiting_tokens=500)         # 200 tokens of other gateways
    assert p.load == 300
