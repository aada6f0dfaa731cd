"""A gateway with real workers on loopback, and plain HTTP (stdlib) to talk to it; fake
workers (`FakeWorker`) that speak the workers' protocol from a script."""

from __future__ import annotations

import contextlib
import http.client
import json
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import grpc
import msgpack

from engine.prefix_cache import cache_salt, max_cached_pages, page_keys
from gateway.config import GatewayConfig
from gateway.server import GatewayServer
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc
from tests.workers import SECRET

API_KEY = "sk-tandem-test"


def start_gateway(decode=(), prefill=(), colocated=(), **kw) -> GatewayServer:
    kw.setdefault("api_keys", {API_KEY: "acme", "sk-other": "globex"})
    kw.setdefault("cluster_secret", SECRET)
    server = GatewayServer(GatewayConfig(decode_workers=tuple(decode), prefill_workers=tuple(prefill),
                                         colocated_workers=tuple(colocated), port=0, refresh_s=0.2, **kw)).start()
    return server


def connection(url: str, timeout_s: float = 60) -> http.client.HTTPConnection:
    u = urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)


def post(url: str, path: str, body, key: str | None = API_KEY, raw: bytes | None = None,
         timeout_s: float = 60) -> tuple[int, dict | list]:
    """POST JSON; returns (status, parsed body, or the list of SSE events for a stream)."""
    conn = connection(url, timeout_s)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn.request("POST", path, body=raw if raw is not None else json.dumps(body), headers=headers)
    resp = conn.getresponse()
    data = resp.read().decode()
    conn.close()
    if resp.getheader("content-type", "").startswith("text/event-stream"):
        return resp.status, [e[len("data: "):] for e in data.split("\n\n") if e.startswith("data: ")]
    try:
        return resp.status, json.loads(data)
    except json.JSONDecodeError:
        return resp.status, {"raw": data}


def get(url: str, path: str, key: str | None = API_KEY) -> tuple[int, str]:
    conn = connection(url)
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key else {})
    resp = conn.getresponse()
    out = resp.status, resp.read().decode()
    conn.close()
    return out


def wait_ready(url: str, timeout_s: float = 30) -> None:
    end = time.monotonic() + timeout_s
    while get(url, "/health")[0] != 200:
        assert time.monotonic() < end, "the gateway never became ready"
        time.sleep(0.1)


@contextlib.contextmanager
def gateway_cluster(decode_config, prefill_config, **gateway):
    """A decode and a prefill worker and a ready gateway in front of them; at the end every
    pool must be intact and fully free (I6)."""
    from tests.workers import start_decode, start_prefill, wait_idle
    decode, prefill = start_decode(decode_config), start_prefill(prefill_config)
    gw = start_gateway([decode.address], [prefill.address], **gateway)
    try:
        wait_ready(gw.url)
        yield gw, decode, prefill
    finally:
        gw.stop()
        try:
            wait_idle(decode, prefill)
        finally:
            decode.stop()
            prefill.stop()


@contextlib.contextmanager
def colocated_gateway(worker_config, **gateway):
    """A colocated worker and a ready gateway in front of it; yields (gateway, worker); at the
    end its pool must be intact and fully free (I6)."""
    from deploy.colocated import start_colocated_worker
    from tests.workers import wait_idle
    worker = start_colocated_worker(worker_config)
    gw = start_gateway(colocated=[worker.address], **gateway)
    try:
        wait_ready(gw.url)
        yield gw, worker
    finally:
        gw.stop()
        try:
            wait_idle(worker)
        finally:
            worker.stop()


@contextlib.contextmanager
def fake_cluster(**gateway):
    """A ready gateway in front of a scripted decode worker and its prefill peer (FakeWorker);
    yields (gateway, decode)."""
    prefill, decode = FakeWorker("prefill"), FakeWorker()
    decode.peer = prefill
    gw = start_gateway([decode.address], [prefill.address], **gateway)
    try:
        wait_ready(gw.url)
        yield gw, decode
    finally:
        gw.stop()
        decode.stop()
        prefill.stop()


# ---- fake workers: the gateway's side of the protocol, scripted --------------------------------
class FakeCache:
    """A fake worker's prefix cache: page keys, published to every CacheEvents subscriber (the
    first batch of a stream a reset with all of them, as the real worker's log sends)."""

    def __init__(self, page_size: int = 16, epoch: str = "e1") -> None:
        self.page_size, self.epoch, self.seq = page_size, epoch, 0
        self.keys: dict[bytes, None] = {}
        self.subscribers: list[queue.Queue[bytes | None]] = []
        self.lock = threading.Lock()

    def batch(self, reset: bool = False, stored: list[bytes] = (), evicted: list[bytes] = ()) -> bytes:
        self.seq += 1
        return msgpack.packb({"epoch": self.epoch, "seq": self.seq, "page_size": self.page_size, "reset": reset,
                              "stored": list(stored), "evicted": list(evicted)})

    def store(self, keys: list[bytes]) -> None:
        with self.lock:
            new = [k for k in keys if k not in self.keys]
            self.keys.update(dict.fromkeys(new))
            raw = self.batch(stored=new)
            for q in self.subscribers:
                q.put(raw)

    def hit_tokens(self, keys: list[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.keys:
            n += 1
        return n * self.page_size

    def stream(self, context: grpc.ServicerContext) -> Iterator[wpb.CacheEventBatch]:
        q: queue.Queue[bytes | None] = queue.Queue()
        with self.lock:
            q.put(self.batch(reset=True, stored=list(self.keys)))
            self.subscribers.append(q)
        try:
            while context.is_active():
                with contextlib.suppress(queue.Empty):
                    raw = q.get(timeout=0.05)
                    if raw is None:
                        return            # the worker "broke" the stream
                    yield wpb.CacheEventBatch(events=raw)
        finally:
            with self.lock:
                self.subscribers.remove(q)


class FakeWorker(wpb_grpc.DecodeServiceServicer, wpb_grpc.PrefillServiceServicer):
    """A scripted decode (or prefill) worker on loopback: Health and Stats as set, Generate
    answers a reservation (cached_tokens from its FakeCache under the tenant's salt), waits for
    the prefill (of `peer`, when set), streams two tokens and a Finish, then caches the prompt's pages; Prefill
    records the request.  `cache_events=False`: CacheEvents answers UNIMPLEMENTED."""

    def __init__(self, role: str = "decode", enable_prefix_cache: bool = True, cache_events: bool = True) -> None:
        self.role, self.enable_prefix_cache, self.cache_events = role, enable_prefix_cache, cache_events
        self.cache = FakeCache()
        self.stats = wpb.StatsReply(role=role, kv_tokens_free=1 << 20, kv_tokens_capacity=1 << 20)
        self.generated: list[wpb.GenerateRequest] = []
        self.prefilled: list[wpb.PrefillRequest] = []
        self.peer: FakeWorker | None = None   # decode: the fake prefill worker whose Prefill it waits for
        self.server = grpc.server(ThreadPoolExecutor(16))
        (wpb_grpc.add_PrefillServiceServicer_to_server if role == "prefill"
         else wpb_grpc.add_DecodeServiceServicer_to_server)(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def keys(self, tenant: str, salt: str, ids: list[int]) -> list[bytes]:
        size = self.cache.page_size
        return page_keys(cache_salt(SECRET, tenant, salt), ids[:max_cached_pages(len(ids), size) * size], size)

    def Health(self, request, context):
        return wpb.HealthReply(ready=True, role=self.role, model="tiny-moe", max_model_len=2048,
                               kv_capacity_tokens=1 << 20, kv_page_size=self.cache.page_size,
                               prefix_cache=self.enable_prefix_cache)

    def Stats(self, request, context):
        return self.stats

    def CacheEvents(self, request, context):
        if not self.cache_events:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "no cache events")
        yield from self.cache.stream(context)

    def Generate(self, request, context):
        self.generated.append(request)
        ids = list(request.prompt_token_ids)
        keys = self.keys(request.tenant, request.cache_salt, ids)
        cached = self.cache.hit_tokens(keys) if self.enable_prefix_cache else 0
        yield wpb.GenerateResponse(reservation=wpb.Reservation(
            transfer_id=request.request_id.encode(), transfer_endpoint="grpc://fake", prompt_tokens=len(ids),
            cached_tokens=cached))
        end = time.monotonic() + 10
        while self.peer is not None and not any(p.transfer_id == request.request_id.encode()
                                                for p in self.peer.prefilled):
            assert time.monotonic() < end, "the gateway never sent the prefill"
            time.sleep(0.01)
        yield wpb.GenerateResponse(tokens=wpb.Tokens(token_ids=[65, 66], text="AB"))
        if self.enable_prefix_cache:
            self.cache.store(keys)
        yield wpb.GenerateResponse(finish=wpb.Finish(finish_reason="length", prompt_tokens=len(ids),
                                                     completion_tokens=2, cached_tokens=cached))

    def Prefill(self, request, context):
        self.prefilled.append(request)
        return wpb.PrefillReply(ok=True, first_token_id=65, frames=1)

    def stop(self) -> None:
        self.server.stop(grace=None)
