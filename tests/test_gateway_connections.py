"""The front door's connection layer (gateway/connections.py, gateway/framing.py), over raw
sockets: request smuggling refused with one 400 and the connection closed, the header limit
on the whole head however it arrives, header and body timeouts, the per-address cap, and a
gateway full of half-open connections still serving a client that sends a whole request.

The gateway here has no worker behind it (its one worker address answers nothing): every
request these tests make is one the gateway answers itself (/v1/models, a refusal)."""

from __future__ import annotations

import contextlib
import gc
import json
import socket
import ssl
import time
from collections.abc import Iterator

import h11
import pytest

from engine.options import build, default_of, given
from gateway.config import GatewayConfig
from gateway.connection_table import ConnectionLimits, ConnectionTable, client_key
from gateway.framing import StrictConnection, framing_problem
from gateway.server import FLAGS, parser
from kv_transfer.tls import ClusterCA
from tests.gateway_helpers import API_KEY, start_gateway
from tests.workers import SECRET

MODELS = f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n\r\n".encode()
CLOSING = MODELS.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")     # the server closes after it
NO_WORKER = ("127.0.0.1:1",)


@contextlib.contextmanager
def gateway(**kw) -> Iterator[tuple[str, int]]:
    gw = start_gateway(colocated=NO_WORKER, **kw)
    try:
        host, port = gw.url.split("//")[1].split(":")
        yield host, int(port)
    finally:
        gw.stop()


def connect(addr: tuple[str, int], source: str = "127.0.0.1") -> socket.socket:
    """A connection from `source` (any 127.x.y.z is this machine: a second client address)."""
    sock = socket.create_connection(addr, timeout=30, source_address=(source, 0))
    return sock


def read_to_end(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset ends it too)."""
    got = b""
    with contextlib.suppress(ConnectionResetError):
        while data := sock.recv(65536):
            got += data
    return got


def exchange(addr: tuple[str, int], data: bytes, source: str = "127.0.0.1") -> bytes:
    with connect(addr, source) as sock:
        sock.sendall(data)
        return read_to_end(sock)


def responses(got: bytes) -> list[tuple[int, dict]]:
    """The (status, JSON body) of each response in `got`, in order (Content-Length framed)."""
    out = []
    while got:
        head, _, rest = got.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next(int(v) for k, _, v in (line.partition(b": ") for line in lines[1:])
                      if k.lower() == b"content-length")
        out.append((int(lines[0].split()[1]), json.loads(rest[:length])))
        got = rest[length:]
    return out


def one_refusal(got: bytes, status: int, code: str) -> dict:
    """`got` is exactly one response, `status` with an OpenAI error body of `code`."""
    answers = responses(got)
    assert [s for s, _ in answers] == [status], got[:600]
    error = answers[0][1]["error"]
    assert error["code"] == code and set(error) == {"message", "type", "param", "code"}, error
    return error


# -- smuggling ---------------------------------------------------------------------------

def test_content_length_beside_chunked_gets_one_400_and_nothing_after_it_is_served():
    """The issue's repro: CL + TE chunked, then a second request in the same bytes.  Before, the
    gateway answered 422 and then served /v1/server_info to the trailing bytes."""
    body = b'{"model": "tiny-moe"}'
    smuggled = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: %d\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body) + 5, len(body), body)
                + b"GET /v1/server_info HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
                + b"\r\n\r\n")
    with gateway() as addr:
        error = one_refusal(exchange(addr, smuggled), 400, "ambiguous_framing")
        assert "Content-Length and Transfer-Encoding" in error["message"]
        assert responses(exchange(addr, CLOSING))[0][0] == 200            # and it serves on


AMBIGUOUS = {
    "te_capitalised": (b"Transfer-Encoding: Chunked\r\n", "Transfer-Encoding 'Chunked'"),
    "te_list": (b"Transfer-Encoding: gzip, chunked\r\n", "only `chunked`"),
    "te_twice": (b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n", "2 Transfer-Encoding headers"),
    "cl_twice_same": (b"Content-Length: 5\r\nContent-Length: 5\r\n", "2 Content-Length headers"),
    "cl_conflicting": (b"Content-Length: 5\r\nContent-Length: 6\r\n", "2 Content-Length headers"),
    "cl_list": (b"Content-Length: 5, 5\r\n", "not a number of bytes"),
    "cl_signed": (b"Content-Length: +5\r\n", "not a number of bytes"),
    "te_folded": (b"X-A: 1\r\nTransfer-Encoding:\r\n chunked\r\n", "obs-fold"),
}


@pytest.mark.parametrize("name", sorted(AMBIGUOUS))
def test_ambiguous_framing_is_one_400_naming_it_and_the_connection_closes(name):
    headers, words = AMBIGUOUS[name]
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n" + b"0\r\n\r\nhello"
               + MODELS)
    with gateway() as addr:
        error = one_refusal(exchange(addr, request), 400, "ambiguous_framing")
        assert words in error["message"], error


def test_bare_lf_and_chunked_http_1_0_are_refused():
    with gateway() as addr:
        error = one_refusal(exchange(addr, MODELS.replace(b"\r\n", b"\n") + MODELS), 400, "ambiguous_framing")
        assert "bare LF" in error["message"]
        old = b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + MODELS
        assert "HTTP/1.0" in one_refusal(exchange(addr, old), 400, "ambiguous_framing")["message"]


def read_responses(sock: socket.socket, n: int) -> list[tuple[int, dict]]:
    got = b""
    while True:
        with contextlib.suppress(ValueError, StopIteration):          # not whole yet
            if len(answers := responses(got)) == n:
                return answers
        data = sock.recv(65536)
        assert data, got
        got += data


def test_well_formed_pipelined_requests_are_all_answered_on_one_connection():
    with gateway() as addr, connect(addr) as sock:
        sock.sendall(MODELS * 3)
        assert [s for s, _ in read_responses(sock, 3)] == [200] * 3
        sock.sendall(MODELS)                                          # kept alive
        assert read_responses(sock, 1)[0][0] == 200


# -- the header limit --------------------------------------------------------------------

def big_head(size: int) -> bytes:
    pad = size - len(CLOSING) - len(b"X-Pad: \r\n")
    return CLOSING[:-2] + b"X-Pad: " + b"a" * pad + b"\r\n\r\n"


def test_a_head_over_the_limit_in_one_send_is_431_naming_it():
    """Before, a 64,000-byte header sent at once was accepted (h11 bounds only an unfinished
    event) though max_header_bytes is 16 KiB."""
    with gateway() as addr:
        error = one_refusal(exchange(addr, big_head(64_000)), 431, "header_too_large")
        assert "64000 bytes" in error["message"] and str(16 << 10) in error["message"]
        assert responses(exchange(addr, big_head(16 << 10)))[0][0] == 200      # at the limit: served


def test_a_head_over_the_limit_trickled_is_431():
    with gateway(max_header_bytes=4096) as addr, connect(addr) as sock:
        sock.sendall(MODELS[:-2])
        with contextlib.suppress(OSError):                          # refused and closed already
            for i in range(64):                                      # 64 KiB of headers, never finished
                sock.sendall(b"X-Big-%d: %s\r\n" % (i, b"a" * 1000))
                time.sleep(0.005)
        assert "4096 bytes" in one_refusal(read_to_end(sock), 431, "header_too_large")["message"]


# -- timeouts ----------------------------------------------------------------------------

def test_a_half_sent_head_is_answered_408_and_closed():
    with gateway(header_timeout_s=0.5) as addr, connect(addr) as sock:
        sock.sendall(MODELS[:20])
        error = one_refusal(read_to_end(sock), 408, "request_timeout")
        assert "0.5 s" in error["message"]


def test_a_trickled_head_is_not_kept_alive_by_its_bytes():
    """A byte every 50 ms keeps the connection busy, not alive: the head's deadline holds."""
    with gateway(header_timeout_s=0.5) as addr, connect(addr) as sock:
        with contextlib.suppress(OSError):
            for byte in MODELS[:-4]:                                  # ~5 s of bytes, never the end
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
        one_refusal(read_to_end(sock), 408, "request_timeout")


def test_a_connection_that_sends_nothing_is_closed():
    with gateway(header_timeout_s=0.5) as addr, connect(addr) as sock:
        assert read_to_end(sock) == b""


def test_a_stalled_body_is_408_and_a_slow_moving_one_is_read():
    post = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n")
    body = b'{"model": "no-such-model", "prompt": "x"}'
    with gateway(body_timeout_s=0.6) as addr:
        with connect(addr) as sock:
            sock.sendall(post % len(body) + body[:10])
            assert "0.6 s" in one_refusal(read_to_end(sock), 408, "request_timeout")["message"]
        with connect(addr) as sock:                                   # a piece every 0.2 s: moving
            sock.sendall(post % len(body))
            for i in range(0, len(body), 8):
                time.sleep(0.2)
                sock.sendall(body[i:i + 8])
            answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 404"), answer[:300]       # the app's answer: it read it all


# -- connection caps ---------------------------------------------------------------------

def test_one_address_past_its_cap_gets_429_and_another_address_is_served():
    with gateway(max_connections_per_client=3, header_timeout_s=2) as addr:
        held = [connect(addr, "127.0.0.2") for _ in range(3)]
        try:
            time.sleep(0.2)                                            # accepted by the server
            assert responses(exchange(addr, CLOSING, "127.0.0.1"))[0][0] == 200
            held.pop().close()
            time.sleep(0.2)
            assert responses(exchange(addr, CLOSING, "127.0.0.2"))[0][0] == 200   # the slot came back
            held.append(connect(addr, "127.0.0.2"))
            time.sleep(0.2)
            # held unread for 1-2 x header_timeout_s, then answered
            error = one_refusal(exchange(addr, MODELS, "127.0.0.2"), 429, "too_many_connections")
            assert "limit is 3" in error["message"]
        finally:
            for s in held:
                s.close()


def test_half_open_connections_give_their_slots_to_a_whole_request():
    """A table full of half-sent heads: a client sending a whole request takes the slot of the
    one idle longest (before: uvicorn answered it 503 for as long as they were held)."""
    with gateway(max_connections=4, header_timeout_s=30) as addr:
        held = [connect(addr, "127.0.0.2") for _ in range(4)]
        try:
            for s in held:
                s.sendall(MODELS[:10])
                time.sleep(0.05)
            for _ in range(3):
                assert responses(exchange(addr, CLOSING))[0][0] == 200
            assert read_to_end(held[0]) == b""                          # the longest idle went first
        finally:
            for s in held:
                s.close()


def test_a_gateway_whose_connections_all_have_requests_in_flight_answers_503_json():
    with gateway(max_connections=2, header_timeout_s=30, body_timeout_s=30) as addr:
        busy = [connect(addr, "127.0.0.2") for _ in range(2)]
        try:
            for s in busy:                                               # a body owed: a request in flight
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            time.sleep(0.3)
            got = exchange(addr, CLOSING)
            error = one_refusal(got, 503, "server_overloaded")
            assert "2 connections" in error["message"] and b"retry-after: 1" in got.lower()
        finally:
            for s in busy:
                s.close()


# -- the parts -----------------------------------------------------------------------------

class FakeSlot:
    def __init__(self) -> None:
        self.evicted = False

    def evict(self) -> None:
        self.evicted = True


def test_the_table_evicts_the_longest_idle_and_counts_per_client():
    table = ConnectionTable(ConnectionLimits(3, 2, 1024, 1.0, 1.0))
    a, b, c, d = FakeSlot(), FakeSlot(), FakeSlot(), FakeSlot()
    assert table.admit(a, "x") is None and table.admit(b, "x") is None
    assert table.admit(FakeSlot(), "x").status == 429
    assert table.admit(c, "y") is None
    table.mark(a, busy=True)
    table.mark(c, busy=True)
    assert table.admit(d, "z") is None and b.evicted and not a.evicted and len(table) == 3
    table.mark(d, busy=True)
    assert table.admit(FakeSlot(), "w").status == 503
    table.release(a)
    table.release(a)                                                     # twice: a no-op
    assert len(table) == 2 and table.admit(FakeSlot(), "x") is None


def test_connections_held_before_their_429_are_bounded():
    table = ConnectionTable(ConnectionLimits(3, 2, 1024, 1.0, 1.0), tarpit_max=2)
    a, b = FakeSlot(), FakeSlot()
    assert table.tarpit(a) and table.tarpit(b) and not table.tarpit(FakeSlot())
    table.untarpit(a)
    assert table.tarpit(FakeSlot())


def test_client_keys():
    assert client_key("10.1.2.3") == "10.1.2.3" and client_key("::ffff:10.1.2.3") == "10.1.2.3"
    assert client_key("2001:db8::1") == client_key("2001:db8::ffff") == "2001:db8::/64"
    assert client_key(None) == "local"


def test_framing_of_a_plain_head_is_fine():
    assert framing_problem(MODELS) is None
    assert framing_problem(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n") is None
    assert framing_problem(b"POST / HTTP/1.1\r\nContent-Length: 12\r\n\r\n") is None


def test_the_strict_connection_reads_h11s_own_buffer():
    """StrictConnection sees the raw head through h11's receive buffer: pinned here."""
    conn = StrictConnection(1024)
    conn.receive_data(b"GET / HT")
    assert conn.next_event() is h11.NEED_DATA and bytes(conn._receive_buffer._data) == b"GET / HT"
    conn.receive_data(b"TP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(conn.next_event(), h11.Request) and conn.pending == 0


def test_over_https_requests_are_served_and_refusals_are_answered(tmp_path):
    web = ClusterCA().issue("web", hosts=["127.0.0.1"]).write(tmp_path / "web")
    context = ssl.create_default_context(cafile=str(web / "ca.pem"))
    with gateway(ssl_certfile=str(web / "cert.pem"), ssl_keyfile=str(web / "key.pem"),
                 header_timeout_s=0.5) as addr:
        def tls() -> ssl.SSLSocket:
            return context.wrap_socket(connect(addr), server_hostname="127.0.0.1")

        with tls() as sock:
            sock.sendall(CLOSING)
            assert responses(read_to_end(sock))[0][0] == 200
        with tls() as sock:
            sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"0\r\n\r\n" + MODELS)
            one_refusal(read_to_end(sock), 400, "ambiguous_framing")
        with tls() as sock:
            sock.sendall(MODELS[:20])
            one_refusal(read_to_end(sock), 408, "request_timeout")


def test_the_limits_are_validated_and_have_flags_defaulted_from_the_config():
    for bad in ({"header_timeout_s": 0}, {"body_timeout_s": -1.0}, {"max_connections_per_client": 0}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}=.* must be"):
            GatewayConfig(colocated_workers=NO_WORKER, cluster_secret=SECRET, **bad)
    ap = parser()
    args = ap.parse_args(["--header-timeout", "2.5", "--max-connections-per-client", "7"])
    config = build(GatewayConfig, colocated_workers=NO_WORKER, cluster_secret=SECRET, **given(args, FLAGS))
    assert (config.header_timeout_s, config.max_connections_per_client) == (2.5, 7)
    assert config.body_timeout_s == default_of(GatewayConfig, "body_timeout_s")     # not given: the field's
    shown = " ".join(ap.format_help().split())
    for name in ("header_timeout_s", "max_header_bytes"):
        assert f"(default: {default_of(GatewayConfig, name)})" in shown


def test_a_started_gateway_has_frozen_its_start_up_heap():
    """A flood's allocations run full collections often; what start-up built (tokenizer, app)
    is frozen out of them (gc.freeze), so none of them scans it with the event loop stopped."""
    gc.unfreeze()
    with gateway():
        assert gc.get_freeze_count() > 10_000
    assert gc.get_freeze_count() == 0                  # stopped: collectable again
