"""What the gateway reads and holds for one client: the body limit counted as bytes arrive
(chunked or not, before the API key is looked at), the header limit, the cheap byte-length
bound on prompts, tokenising off the event loop, the admission slot released when generation
ends (not when the client reads), and a response the client does not read closed and counted."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gateway.server
from engine.config import SHIPPED_MODEL
from engine.tokenizer import Tokenizer
from gateway.prompts import PromptEncoder, byte_bound
from tests.gateway_helpers import API_KEY, get, post, start_gateway, wait_ready
from tests.workers import config, start_decode, start_prefill, wait_idle

LIMIT = 4 << 20                        # GatewayConfig.max_body_bytes, the default


@pytest.fixture(scope="module")
def workers():
    # room for the 4 long choices of STREAM within one tenant's KV budget (half the capacity)
    decode, prefill = start_decode(config(kv_cache_tokens=32768)), start_prefill(config())
    try:
        yield decode, prefill
    finally:
        wait_idle(decode, prefill)
        decode.stop()
        prefill.stop()


@pytest.fixture
def gateway_of(workers):
    """Starts gateways in front of the module's workers (with GatewayConfig overrides); each
    one's app is wrapped to count the request body bytes uvicorn hands it (`.received`)."""
    started = []

    def start(**kw):
        real = gateway.server.create_app
        counting: list[CountingApp] = []

        def wrapped(cfg, discover=None):
            counting.append(CountingApp(real(cfg, discover)))
            return counting[0]

        gateway.server.create_app = wrapped
        try:
            gw = start_gateway([workers[0].address], [workers[1].address], **kw)
        finally:
            gateway.server.create_app = real
        started.append(gw)
        wait_ready(gw.url)
        return gw, counting[0]

    yield start
    for gw in started:
        gw.stop()
    wait_idle(*workers)


class CountingApp:
    """An ASGI app around the gateway's that counts the body bytes it is handed."""

    def __init__(self, app):
        self.app, self.state, self.received = app, app.state, 0

    async def __call__(self, scope, receive, send):
        async def counted():
            message = await receive()
            if message["type"] == "http.request":
                self.received += len(message.get("body", b""))
            return message
        await self.app(scope, counted, send)


def raw_request(url: str, head: str, body_chunks, rcvbuf: int | None = None) -> tuple[int, bytes]:
    """Send `head` and then each chunk of the body (chunked encoding) from a thread, while this
    thread reads the answer; returns (status, what was read until the server closed)."""
    host, port = url.split("//")[1].split(":")
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    sock.settimeout(60)

    def write():
        try:
            sock.sendall(head.encode())
            for chunk in body_chunks:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass                                   # the server closed the connection: expected

    writer = threading.Thread(target=write)
    writer.start()
    got = b""
    try:
        while data := sock.recv(65536):
            got += data
    except OSError:
        pass
    writer.join(60)
    sock.close()
    return int(got.split()[1]) if got else 0, got


def chunked_head(path: str, key: str | None) -> str:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
            f"Transfer-Encoding: chunked\r\n\r\n")


def test_a_64_mib_chunked_body_without_a_key_is_refused_by_byte_count(gateway_of):
    gw, app = gateway_of()
    piece = b"[" + b"1," * (32 << 10)                     # 64 KiB pieces of a JSON list, never closed
    status, got = raw_request(gw.url, chunked_head("/v1/completions", None), (piece for _ in range(1024)))
    assert status == 413, got[:300]
    body = json.loads(got.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "body_too_large" and str(LIMIT) in body["error"]["message"]
    # the limit, then at most one more limit's worth read and dropped: far from the 64 MiB sent
    assert app.received <= 2 * LIMIT + (1 << 20), app.received


def test_a_chunked_body_just_over_the_limit_is_413_naming_it(gateway_of):
    gw, app = gateway_of()
    status, got = raw_request(gw.url, chunked_head("/v1/completions", API_KEY),
                              [b" " * (1 << 20)] * 4 + [b" "])
    assert status == 413 and f"limit of {LIMIT} bytes".encode() in got, got[-300:]


def test_a_body_under_the_limit_is_read_whole(gateway_of):
    gw, _ = gateway_of()
    body = json.dumps({"model": "tiny-moe", "prompt": "x = ", "max_tokens": 2}).encode()
    status, got = raw_request(gw.url, chunked_head("/v1/completions", API_KEY), [body[:5], body[5:]])
    assert status == 200, got[-300:]


def test_headers_past_the_limit_are_refused(gateway_of):
    """Headers that keep coming past max_header_bytes get 431 (the limit holds on the whole
    head however it arrives: gateway/framing.py) and the connection closed."""
    gw, _ = gateway_of(max_header_bytes=4096)
    host, port = gw.url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        try:
            for i in range(64):                             # 64 KiB of headers, never finished
                sock.sendall(b"X-Big-%d: %s\r\n" % (i, b"a" * 1000))
                time.sleep(0.01)                            # separate reads on the server's side
        except OSError:
            pass                                            # refused and closed already
        got = read_all(sock)
    assert got.startswith(b"HTTP/1.1 431") and b"header_too_large" in got, got[:300]
    assert get(gw.url, "/health")[0] == 200                 # and the gateway serves on


def test_an_obviously_oversized_prompt_is_refused_from_its_bytes_before_tokenising(gateway_of):
    gw, _ = gateway_of()
    encoder = gw.app.state.gateway.encoder
    calls = []
    inner = encoder.encode
    encoder.encode = lambda text: calls.append(len(text)) or inner(text)
    context = gw.app.state.gateway.context_len()
    for body in ({"model": "tiny-moe", "prompt": "word " * (context * 20)},
                 {"model": "tiny-moe", "messages": [{"role": "user", "content": "é" * (context * 40)}]}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        status, got = post(gw.url, path, body)
        assert status == 400 and got["error"]["code"] == "context_length", got
        assert "bytes" in got["error"]["message"] and f"{context} tokens" in got["error"]["message"]
    assert calls == []                                      # never tokenised
    status, got = post(gw.url, "/v1/completions", {"model": "tiny-moe", "prompt": list(range(context + 1))})
    assert status == 400 and got["error"]["code"] == "context_length", got


def test_tokenising_runs_off_the_event_loop(gateway_of):
    """While one request's prompt is being tokenised, the gateway answers others."""
    gw, _ = gateway_of()
    encoder = gw.app.state.gateway.encoder
    inner, entered, release = encoder.encode_plain, threading.Event(), threading.Event()   # a prompt string is text

    def slow(text):
        entered.set()
        assert release.wait(60)
        return inner(text)

    encoder.encode_plain = slow
    result = []
    slow_request = threading.Thread(target=lambda: result.append(post(gw.url, "/v1/completions", {
        "model": "tiny-moe", "prompt": "x = ", "max_tokens": 2})))
    slow_request.start()
    try:
        assert entered.wait(30)
        assert get(gw.url, "/v1/models")[0] == 200           # answered while the tokeniser is busy
    finally:
        release.set()
        slow_request.join(60)
    assert result and result[0][0] == 200, result


def test_the_encoder_matches_the_tokenizer():
    tok = Tokenizer(SHIPPED_MODEL)
    enc = PromptEncoder(tok)
    for text in ("", "def f(x):\n        return x", "héllo wörld ✓ 𝐀", "<|im_start|>user\nhi<|im_end|>"):
        assert enc.encode(text) == tok.encode(text)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=400) | st.text(alphabet=" \n\t", max_size=400))
def test_the_byte_bound_never_refuses_a_prompt_that_fits(text):
    """A text of B bytes gives at least B / bytes_per_token tokens, so `check` only refuses
    texts longer than the context."""
    enc = _shipped_encoder()
    assert enc.bytes_per_token is not None
    size = len(text.encode("utf-8", "surrogatepass"))
    assert len(enc.encode(text)) * enc.bytes_per_token >= size
    assert len(enc.encode_plain(text)) * enc.bytes_per_token >= size        # a prompt string's text encoding


_ENCODER: list[PromptEncoder] = []


def _shipped_encoder() -> PromptEncoder:
    if not _ENCODER:
        _ENCODER.append(PromptEncoder(Tokenizer(SHIPPED_MODEL)))
    return _ENCODER[0]


@pytest.mark.parametrize("spec, bound", [
    ({"model": {"type": "BPE"}, "pre_tokenizer": {"type": "ByteLevel"}, "normalizer": None}, 10),
    ({"model": {"type": "BPE"}, "normalizer": {"type": "NFC"},
      "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Split", "behavior": "Isolated"},
                                                              {"type": "ByteLevel"}]}}, 40),
    ({"model": {"type": "BPE"}, "pre_tokenizer": {"type": "Whitespace"}}, None),         # drops spaces
    ({"model": {"type": "BPE", "unk_token": "<unk>"}, "pre_tokenizer": {"type": "ByteLevel"}}, None),
    ({"model": {"type": "WordPiece"}, "pre_tokenizer": {"type": "ByteLevel"}}, None),
    ({"model": {"type": "BPE"}, "pre_tokenizer": {"type": "ByteLevel"},
      "normalizer": {"type": "Replace", "pattern": {"String": "  "}, "content": ""}}, None),
])
def test_the_byte_bound_holds_only_where_it_is_sound(spec, bound):
    assert byte_bound(spec, 10) == bound


# ---- slow readers ---------------------------------------------------------------------------
# about 7 MB of events: more than loopback's socket buffers (up to 4 MB) and uvicorn's hold
STREAM = {"model": "tiny-moe", "messages": [{"role": "user", "content": "go"}], "max_tokens": 1500, "n": 4,
          "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 20}


def silent_stream(url: str, body: dict) -> socket.socket:
    """A streaming request from a client that reads nothing (a tiny receive buffer, so the
    server's sends back up at once)."""
    host, port = url.split("//")[1].split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def read_all(sock: socket.socket) -> bytes:
    sock.settimeout(60)
    got = b""
    try:
        while data := sock.recv(1 << 20):
            got += data
    except OSError:
        pass
    sock.close()
    return got


def until(check, timeout_s: float = 60.0, every_s: float = 0.1):
    end = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < end, "gave up waiting"
        time.sleep(every_s)
    return value


def completed(url: str) -> float:
    """tandem_requests_total{status="ok"}: a stream counts once its last event was sent."""
    line = next((x for x in get(url, "/metrics")[1].splitlines()
                 if x.startswith('tandem_requests_total{status="ok"}')), " 0")
    return float(line.split()[-1])


def test_a_client_that_stops_reading_gives_its_slot_back_when_generation_ends(gateway_of, workers):
    """One slot in all: while the silent client's stream is still unsent, another request gets
    the slot once the first one's generation has ended (before: 429 until the client read)."""
    gw, _ = gateway_of(max_running=1, tenant_max_concurrency=1, stream_idle_timeout_s=600)
    decode = workers[0]
    finished = decode.counts()["finished"]
    sock = silent_stream(gw.url, STREAM)
    until(lambda: decode.counts()["finished"] >= finished + STREAM["n"], 300)   # the workers are done with it
    status, got = until(lambda: (r := post(gw.url, "/v1/completions", {
        "model": "tiny-moe", "prompt": "x = ", "max_tokens": 2}))[0] != 429 and r)
    assert status == 200, got
    assert completed(gw.url) == 1                           # that one; the silent stream is not all sent
    rest = read_all(sock)                                   # now it is read, whole
    assert b"data: [DONE]" in rest, rest[-300:]
    until(lambda: completed(gw.url) == 2)


def test_a_stream_not_read_for_the_idle_timeout_is_reset_and_counted(gateway_of, workers):
    gw, _ = gateway_of(stream_idle_timeout_s=1.0)
    sock = silent_stream(gw.url, STREAM)
    until(lambda: "tandem_responses_stalled_total 1.0" in get(gw.url, "/metrics")[1])
    rest = read_all(sock)
    # reset: what the gateway still held queued (64 KiB and more: uvicorn paused writing at
    # 64 KiB) was dropped; a plain close would have waited for this client to read it all
    assert b"data: [DONE]" not in rest and len(rest) < 64 << 10, len(rest)
    wait_idle(*workers, timeout_s=30)                       # generation cancelled or ended: pages free
    until(lambda: gw.app.state.gateway.queue.total == 0)
