"""Fair share between tenants (issue 16, part 4): the admission queue's round robin over tenants,
the per-tenant KV budget and the cluster's KV room, the default chat max_tokens, the client's
address standing in for the tenant without API keys, and the per-tenant metrics.  The queue is
driven directly (asyncio, no server); one module-scoped cluster checks the HTTP side."""

from __future__ import annotations

import asyncio
import http.client
import json
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request

from gateway.admission import AdmissionQueue, Rejected
from gateway.completions import CompletionHandler
from gateway.config import GatewayConfig
from gateway.fairness import ADDRESS_LABELS, ClusterKv, share_key, tenant_label
from gateway.metrics import Metrics
from gateway.planner import DEFAULT_COMPLETION_TOKENS
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.routing import WorkerPool
from proto import worker_pb2 as wpb
from tests.gateway_helpers import gateway_cluster, get
from tests.workers import SECRET, config

SETTLE = 50                      # event loop turns that let every ready task run


class Fixed:
    """KV limits that do not follow any worker."""

    def __init__(self, cluster: int = 0, tenant: int = 0) -> None:
        self.cluster, self.tenant = cluster, tenant

    def cluster_tokens(self) -> int:
        return self.cluster

    def tenant_tokens(self) -> int:
        return self.tenant


class Clients:
    """Requests through a queue, each holding its slot until the test ends it; `order` is the
    order in which they were admitted."""

    def __init__(self, queue: AdmissionQueue) -> None:
        self.queue = queue
        self.order: list[str] = []
        self.release: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def send(self, name: str, tenant: str, kv_tokens: int = 0) -> None:
        self.release[name] = asyncio.Event()
        self.tasks[name] = asyncio.create_task(self._hold(name, tenant, kv_tokens))
        await settle()

    async def _hold(self, name: str, tenant: str, kv_tokens: int) -> None:
        async with (self.queue.admit(tenant, kv_tokens) if kv_tokens else self.queue.admit(tenant)):
            self.order.append(name)
            await self.release[name].wait()

    async def end(self, name: str) -> None:
        self.release[name].set()
        await settle()

    async def close(self) -> None:
        for event in self.release.values():
            event.set()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


async def settle() -> None:
    for _ in range(SETTLE):
        await asyncio.sleep(0)


def run(main: Any) -> Any:
    return asyncio.run(main())


# ---- the round robin ------------------------------------------------------------------------
def test_a_flooding_tenant_cannot_hold_the_queue():
    """A queues 10 requests, then B queues 3: with one slot, B's are admitted turn about with
    A's (FIFO admitted all of A's first)."""
    async def main() -> list[str]:
        clients = Clients(AdmissionQueue(max_queue=100, max_running=1, tenant_limit=100, timeout_s=600))
        for i in range(10):
            await clients.send(f"a{i}", "A")
        for i in range(3):
            await clients.send(f"b{i}", "B")
        for _ in range(13):                        # end whoever runs, 13 times
            await clients.end(clients.order[-1])
        await clients.close()
        return clients.order

    order = run(main)
    assert order == ["a0", "a1", "b0", "a2", "b1", "a3", "b2", "a4", "a5", "a6", "a7", "a8", "a9"]


def test_the_tenants_that_run_fewest_go_first():
    """A holds every slot when B and C arrive: the next two slots go to B and C, not to A."""
    async def main() -> list[str]:
        clients = Clients(AdmissionQueue(max_queue=100, max_running=3, tenant_limit=100, timeout_s=600))
        for i in range(6):
            await clients.send(f"a{i}", "A")
        await clients.send("b0", "B")
        await clients.send("c0", "C")
        for name in ("a0", "a1", "a2"):
            await clients.end(name)
        await clients.close()
        return clients.order

    assert run(main)[:6] == ["a0", "a1", "a2", "b0", "c0", "a3"]


def test_the_tenant_holding_more_of_the_kv_waits_for_the_others():
    """A and B run one request each when a slot frees: B's goes first, A holds more of the KV."""
    async def main() -> list[str]:
        clients = Clients(AdmissionQueue(100, 3, 100, 600, Fixed(cluster=10_000)))
        await clients.send("a0", "A", 6000)
        await clients.send("b0", "B", 1000)
        await clients.send("b1", "B", 1000)
        await clients.send("a1", "A", 100)         # no slot: A, then B wait
        await clients.send("b2", "B", 100)
        await clients.end("b0")
        await clients.close()
        return clients.order

    assert run(main)[:5] == ["a0", "b0", "b1", "b2", "a1"]


# ---- the KV budget and the cluster's room -----------------------------------------------------
def test_a_tenant_over_its_kv_budget_waits_and_the_others_proceed():
    async def main() -> None:
        queue = AdmissionQueue(100, 10, 100, 600, Fixed(cluster=10_000, tenant=1000))
        clients = Clients(queue)
        await clients.send("a0", "A", 600)
        await clients.send("a1", "A", 600)         # 1200 > 1000: waits
        await clients.send("b0", "B", 600)
        assert clients.order == ["a0", "b0"]
        assert (queue.tenants["A"].kv_reserved, len(queue.tenants["A"].queued)) == (600, 1)
        await clients.end("a0")
        assert clients.order == ["a0", "b0", "a1"]
        assert queue.tenants["A"].kv_reserved == 600 and queue.kv_reserved == 1200
        await clients.close()
        assert queue.tenants == {} and queue.kv_reserved == 0 and queue.total == 0

    run(main)


def test_a_request_alone_over_the_kv_budget_is_refused_naming_the_limit():
    async def main() -> Rejected:
        queue = AdmissionQueue(100, 10, 100, 600, Fixed(tenant=1000))
        with pytest.raises(Rejected) as refused:
            async with queue.admit("A", 1001):
                pass
        assert queue.tenants == {} and queue.total == 0
        async with queue.admit("A", 1000):         # exactly the budget: admitted
            pass
        return refused.value

    refused = run(main)
    assert (refused.status, refused.reason) == (400, "kv_budget")        # it can never fit: not retryable
    assert "1001 KV tokens" in refused.message and "budget of 1000 tokens" in refused.message
    assert "tenant_max_kv_tokens" in refused.message


def test_when_the_cluster_is_full_the_tenant_in_turn_is_not_passed():
    """B's large request waits for room; A's small one, queued after it, does not jump ahead."""
    async def main() -> list[str]:
        clients = Clients(AdmissionQueue(100, 10, 100, 600, Fixed(cluster=1000)))
        await clients.send("a0", "A", 600)
        await clients.send("b0", "B", 600)         # 1200 > 1000: waits
        await clients.send("a1", "A", 300)         # would fit, but it is B's turn
        assert clients.order == ["a0"]
        await clients.end("a0")
        await clients.close()
        return clients.order

    assert run(main) == ["a0", "b0", "a1"]


# ---- the limits that were there: still hold, and nothing is left behind ------------------------
def test_timeouts_cancellations_and_limits_leave_nothing_behind():
    async def main() -> None:
        queue = AdmissionQueue(max_queue=3, max_running=1, tenant_limit=2, timeout_s=0.01)
        clients = Clients(queue)
        await clients.send("a0", "A")
        with pytest.raises(Rejected) as timed_out:
            async with queue.admit("B"):
                pass
        assert (timed_out.value.status, timed_out.value.reason) == (503, "queue_timeout")
        queue.timeout_s = 600
        await clients.send("a1", "A")
        with pytest.raises(Rejected) as over:
            async with queue.admit("A"):
                pass
        assert over.value.reason == "tenant_limit"
        await clients.send("b0", "B")
        with pytest.raises(Rejected) as full:
            async with queue.admit("C"):
                pass
        assert full.value.reason == "queue_full"
        clients.tasks["b0"].cancel()               # its client went away while it waited
        await settle()
        assert "B" not in queue.tenants and queue.total == 2
        await clients.close()
        assert clients.order == ["a0", "a1"] and queue.tenants == {} and queue.total == 0

    run(main)


def test_the_cluster_limits_follow_the_workers_health():
    pool = WorkerPool(("127.0.0.1:1", "127.0.0.1:2"), ("127.0.0.1:3",), (), SECRET)
    for w in pool.workers:
        w.health = wpb.HealthReply(ready=True, max_model_len=2048, kv_capacity_tokens=16384)
    kv = ClusterKv(pool, gateway_config(api_keys={"k1": "acme", "k2": "globex"}), lambda: 2048)
    assert (kv.cluster_tokens(), kv.tenant_tokens()) == (32768, 16384)           # half the cluster
    assert ClusterKv(pool, gateway_config(), lambda: 2048).tenant_tokens() == 16384        # addresses: half
    alone = ClusterKv(pool, gateway_config(api_keys={"k1": "acme", "k2": "acme"}), lambda: 2048)
    assert alone.tenant_tokens() == 32768                      # one tenant: nobody to share with
    pool.workers[1].health = None
    pool.workers[0].health = wpb.HealthReply(ready=True, max_model_len=2048, kv_capacity_tokens=3000)
    assert (kv.cluster_tokens(), kv.tenant_tokens()) == (3000, 2048)   # never below one longest request
    assert ClusterKv(pool, gateway_config(tenant_max_kv_tokens=500), lambda: 2048).tenant_tokens() == 500


# ---- the default chat max_tokens ------------------------------------------------------------
def gateway_config(**kw: Any) -> GatewayConfig:
    return GatewayConfig(decode_workers=("127.0.0.1:1",), prefill_workers=("127.0.0.1:2",), cluster_secret=SECRET,
                         **kw)


def handler(**kw: Any) -> CompletionHandler:
    return CompletionHandler(SimpleNamespace(config=gateway_config(**kw)))  # type: ignore[arg-type]


CHAT = {"model": "tiny-moe", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_max_tokens_defaults_to_a_configured_value_clipped_to_the_context():
    chat = ChatCompletionRequest(**CHAT)
    assert handler()._max_tokens(chat, 10, 2048, 16384) == 1024                  # not 2048 - 10
    assert handler()._max_tokens(chat, 1500, 2048, 16384) == 548                 # the context left
    assert handler(default_max_tokens=64)._max_tokens(chat, 10, 2048, 16384) == 64
    assert handler()._max_tokens(ChatCompletionRequest(**CHAT, max_tokens=2000), 10, 2048, 16384) == 2000
    text = CompletionRequest(model="tiny-moe", prompt="hi")
    assert handler()._max_tokens(text, 10, 2048, 16384) == DEFAULT_COMPLETION_TOKENS
    with pytest.raises(ValueError, match="default_max_tokens"):
        handler(default_max_tokens=0)
    with pytest.raises(ValueError, match="tenant_max_kv_tokens"):
        handler(tenant_max_kv_tokens=0)


# ---- address as tenant ------------------------------------------------------------------------
def request_from(host: str | None) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/", "headers": [],
                    "client": (host, 5555) if host is not None else None})


def test_without_keys_the_client_address_stands_in_for_the_tenant():
    assert share_key(request_from("203.0.113.7"), "default", keyed=False) == "addr:203.0.113.7"
    assert share_key(request_from("203.0.113.8"), "default", keyed=False) == "addr:203.0.113.8"
    # one IPv6 host holds a /64: it counts once, whichever address it takes
    same = {share_key(request_from(h), "default", False) for h in ("2001:db8:1:2::1", "2001:db8:1:2:ffff::9")}
    assert same == {"addr:2001:db8:1:2::/64"}
    assert share_key(request_from("2001:db8:1:3::1"), "default", False) == "addr:2001:db8:1:3::/64"
    assert share_key(request_from("::ffff:198.51.100.4"), "default", False) == "addr:198.51.100.4"
    assert share_key(request_from(None), "default", False) == "default"
    assert share_key(request_from("203.0.113.7"), "acme", keyed=True) == "acme"


def test_tenant_labels_are_bounded():
    assert tenant_label("acme") == "acme"
    labels = {tenant_label(f"addr:10.0.{i // 256}.{i % 256}") for i in range(2000)}
    assert len(labels) == ADDRESS_LABELS and all(x.startswith("addr-") for x in labels)
    assert tenant_label("addr:10.0.0.1") == tenant_label("addr:10.0.0.1")


# ---- metrics ------------------------------------------------------------------------------------
def test_per_tenant_metrics():
    metrics = Metrics()
    queue = AdmissionQueue(100, 2, 100, 600, Fixed(tenant=1000), metrics.tenant_rejected)
    metrics.watch(queue)

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    async def main() -> None:
        clients = Clients(queue)
        await clients.send("a0", "acme", 400)
        await clients.send("a1", "acme", 500)
        await clients.send("a2", "acme", 300)      # no slot: queued
        await clients.send("x0", "addr:192.0.2.1", 100)
        with pytest.raises(Rejected):
            async with queue.admit("acme", 5000):
                pass
        addr = tenant_label("addr:192.0.2.1")
        assert (value("tandem_tenant_running", tenant="acme"), value("tandem_tenant_queued", tenant="acme")) == (2, 1)
        assert value("tandem_tenant_kv_reserved_tokens", tenant="acme") == 900
        assert value("tandem_tenant_queued", tenant=addr) == 1 and value("tandem_tenant_running", tenant=addr) == 0
        assert value("tandem_tenant_kv_budget_tokens") == 1000
        assert value("tandem_tenant_rejected_total", tenant="acme", reason="kv_budget") == 1
        await clients.close()
        assert value("tandem_tenant_running", tenant="acme") is None          # gone once idle
        assert b"tandem_tenant_rejected_total" in metrics.render()

    run(main)


# ---- over HTTP ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyless():
    """A cluster whose gateway has no API keys, a small tenant KV budget and default max_tokens."""
    with gateway_cluster(config(max_model_len=256), config(max_model_len=256), api_keys={},
                         tenant_max_kv_tokens=300, default_max_tokens=8) as c:
        yield c


def post_from(source: str, url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST without a key from the loopback address `source` (127.0.0.0/8 is all loopback)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60, source_address=(source, 0))
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_a_chat_request_without_max_tokens_gets_the_default(keyless):
    status, body = post_from("127.0.0.1", keyless[0].url, "/v1/chat/completions", {**CHAT, "ignore_eos": True})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 8


def test_the_budget_counts_against_the_client_address(keyless):
    gw = keyless[0]
    assert tenant_label("addr:127.0.0.2") != tenant_label("addr:127.0.0.1")
    status, body = post_from("127.0.0.2", gw.url, "/v1/completions",
                             {"model": "tiny-moe", "prompt": [7] * 100, "max_tokens": 60, "n": 2})
    assert status == 400 and body["error"]["code"] == "kv_budget", body
    assert "reserves 320 KV tokens" in body["error"]["message"] and "budget of 300 tokens" in body["error"]["message"]
    status, text = get(gw.url, "/metrics", key=None)
    assert status == 200
    rejected = [line for line in text.splitlines() if line.startswith("tandem_tenant_rejected_total{")]
    label = tenant_label("addr:127.0.0.2")
    assert rejected == [f'tandem_tenant_rejected_total{{reason="kv_budget",tenant="{label}"}} 1.0']
