"""A gateway with real workers on loopback, and plain HTTP (stdlib) to talk to it."""

from __future__ import annotations

import contextlib
import http.client
import json
import time
from urllib.parse import urlparse

from gateway.config import GatewayConfig
from gateway.server import GatewayServer
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
