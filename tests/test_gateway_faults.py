"""The gateway under faults: fuzzed and malformed requests (never a 5xx, never a hang), a
client that disconnects (pages freed at once), a decode worker killed mid-stream (an error
event, never a silent truncated 200), and a peer stalled for 40 s under backpressure that
must not fail a request whose timeout is longer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway_helpers import API_KEY, connection, gateway_cluster, get, post, start_gateway, wait_ready
from tests.workers import DECODE_ENDPOINTS, SECRET, config, start_decode, start_prefill, wait_idle


@pytest.fixture(scope="module")
def cluster():
    with gateway_cluster(config(max_model_len=512), config(), request_timeout_s=60) as c:
        yield c


# integers past every bound the gateway or the wire has (int32, uint32, int64, uint64 and beyond)
huge_ints = st.sampled_from([2**31, 2**32, 2**33, 2**40, 2**63, 2**64, 2**80, -2**31 - 1, -2**63, -2**70])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 600), st.floats(-3, 3), st.just(float("nan")),
                    st.text(max_size=12), st.lists(st.integers(-5, 5000), max_size=4), huge_ints,
                    st.lists(st.integers(0, 5000), min_size=2000, max_size=3000))
short_text = st.text(max_size=6)


def ints(low: int, high: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(low, high), huge_ints)


VALUES = {
    "max_tokens": ints(-2, 40), "max_completion_tokens": ints(-2, 40),
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "n": ints(0, 10),
    "stream": st.booleans(), "stop": st.one_of(short_text, st.lists(short_text, max_size=3),
                                               st.lists(short_text, min_size=500, max_size=1000)),
    "seed": st.integers(-5, 2**64) | huge_ints, "top_k": ints(-3, 5000), "min_tokens": ints(-1, 50),
    "stop_token_ids": st.one_of(st.lists(ints(-5, 5000), max_size=3),
                                st.lists(st.integers(0, 4095), min_size=1000, max_size=3000)),
    "stop_regex": st.one_of(short_text, st.lists(short_text, max_size=2)),
    "no_stop_trim": st.booleans(), "ignore_eos": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "presence_penalty": st.sampled_from([0, 0.5]), "echo": st.booleans(), "prompt_logprobs": ints(-1, 25),
    "logit_bias": st.dictionaries(st.sampled_from(["1", "77", "x", "99999", "-1", "00"]), st.floats(-200, 200),
                                  max_size=3),
}
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                 "content": st.text(max_size=20)})
messages = st.one_of(st.lists(message, max_size=3), st.lists(message, min_size=300, max_size=600))
prompts = st.one_of(st.text(max_size=30), st.lists(st.integers(-3, 5000), max_size=8),
                    st.lists(st.text(max_size=10), max_size=3), st.lists(ints(0, 4095), max_size=4),
                    st.lists(st.integers(0, 4095), min_size=1000, max_size=5000))


@st.composite
def bodies(draw, chat: bool):
    """Mostly well-formed requests with edge values, now and then a field of the wrong type."""
    body = {"model": draw(st.sampled_from(["tiny-moe", "tiny-moe", "nope"]))}
    body["messages" if chat else "prompt"] = draw(messages if chat else prompts)
    for name in draw(st.lists(st.sampled_from(sorted(VALUES)), max_size=6, unique=True)):
        body[name] = draw(VALUES[name])
    body["logprobs"] = draw(st.booleans() if chat else ints(-1, 7))
    if chat and draw(st.booleans()):
        body["top_logprobs"] = draw(ints(-1, 25))
    if draw(st.integers(0, 4)) == 0:
        body[draw(st.sampled_from(sorted(body)))] = draw(scalars)
    return body


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(chat=st.booleans(), data=st.data())
def test_fuzzed_requests_never_5xx_and_never_hang(cluster, chat, data):
    body = data.draw(bodies(chat))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, got = post(cluster[0].url, path, body, timeout_s=60)          # a hang fails by timeout
    assert status < 500, (status, got)
    if status != 200:
        assert got["error"]["message"]
        assert not any(leak in json.dumps(got) for leak in ("127.0.0.1", "Traceback", "/work")), got


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b"null", b'{"model": "tiny-moe", "messages": 3}',
                                 "{\"model\": \"tiny-moe\", \"prompt\": \"\udcff\"}".encode("utf-8", "surrogatepass")])
def test_malformed_bodies_are_4xx(cluster, raw):
    status, got = post(cluster[0].url, "/v1/completions", None, raw=raw)
    assert 400 <= status < 500, (status, got)


def test_a_client_that_disconnects_frees_the_pages(cluster):
    gw, decode, prefill = cluster
    conn = connection(gw.url)
    conn.request("POST", "/v1/completions", body=json.dumps({
        "model": "tiny-moe", "prompt": "while True:\n", "max_tokens": 400, "ignore_eos": True, "stream": True}),
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    assert decode.core.pool.num_free < decode.core.pool.num_pages           # decoding, pages held
    conn.close()                                                           # the client goes away
    wait_idle(decode, prefill)


def test_a_client_that_leaves_a_non_streaming_request_ends_it_at_once(cluster):
    """Before the response starts, only the request's receive channel tells that the client
    left: nothing between the server and the handler may hide it (a wrapping middleware did)."""
    gw, decode, prefill = cluster
    counts = decode.roles[0].counts
    finished, failed = counts["finished"], counts["failed"]
    conn = connection(gw.url)
    conn.request("POST", "/v1/completions", body=json.dumps({
        "model": "tiny-moe", "prompt": "while True:\n", "max_tokens": 500, "ignore_eos": True}),
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    end = time.monotonic() + 10
    while decode.core.pool.num_free == decode.core.pool.num_pages and time.monotonic() < end:
        time.sleep(0.01)
    assert decode.core.pool.num_free < decode.core.pool.num_pages             # generating
    conn.close()                                                            # the client goes away
    wait_idle(decode, prefill, timeout_s=3.0)
    assert counts["finished"] == finished and counts["failed"] == failed + 1


def test_a_decode_worker_killed_mid_stream_gives_an_error_event(cluster):
    """The only decode worker dies mid-stream: the gateway tries to continue the stream on
    another (issue 19), finds none within its capacity wait and ends the stream with an
    explicit MIGRATION_FAILED event, never a truncated 200 (tests/test_gateway_migration.py
    has the streams that do continue)."""
    _, _, prefill = cluster
    env = dict(os.environ, TANDEM_CLUSTER_SECRET=SECRET.hex())
    proc = subprocess.Popen([sys.executable, "-m", "deploy.worker", "--role", "decode", "--kv-cache-tokens", "8192"],
                            stdout=subprocess.PIPE, text=True, env=env)
    gw = None
    try:
        _, _, address, endpoint = proc.stdout.readline().split()     # READY decode ADDRESS ENDPOINT
        DECODE_ENDPOINTS.add(endpoint)
        gw = start_gateway([address], [prefill.address], queue_timeout_s=2.0)
        wait_ready(gw.url)
        conn = connection(gw.url)
        conn.request("POST", "/v1/completions", body=json.dumps({
            "model": "tiny-moe", "prompt": "while True:\n", "max_tokens": 1000, "ignore_eos": True,
            "stream": True}), headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        proc.send_signal(signal.SIGKILL)
        rest = resp.read().decode()
        events = [e.strip() for e in rest.split("\n\n") if e.strip().startswith("data: ")]
        assert events, rest
        last = events[-1][len("data: "):]
        assert last != "[DONE]" and "error" in json.loads(last), last     # explicit, not a truncated 200
        assert json.loads(last)["error"]["code"] == "migration_failed"
    finally:
        proc.kill()
        proc.wait(10)
        if gw is not None:
            gw.stop()
    wait_idle(prefill)


def test_a_peer_stalled_for_40_seconds_does_not_fail_a_longer_request():
    """The decode worker stops reading the KV push for 40 s (flow control backs the prefill
    worker up), then continues: with a 120 s request timeout the request completes."""
    decode, prefill = start_decode(config()), start_prefill(config())
    receiver = decode.roles[0].receiver
    inner, stalled = receiver.receive, []

    def stall_once(h, payload):
        if not stalled:
            stalled.append(time.monotonic())
            time.sleep(40)
        inner(h, payload)

    receiver.receive = stall_once
    gw = start_gateway([decode.address], [prefill.address], request_timeout_s=120)
    try:
        wait_ready(gw.url)
        start = time.monotonic()
        status, body = post(gw.url, "/v1/completions", {"model": "tiny-moe", "prompt": "word " * 200,
                                                        "max_tokens": 4, "temperature": 0}, timeout_s=150)
        assert status == 200, body
        assert stalled and time.monotonic() - start >= 40 and body["usage"]["completion_tokens"] >= 1
    finally:
        gw.stop()
        wait_idle(decode, prefill)
        decode.stop()
        prefill.stop()


def test_a_prefill_worker_killed_mid_push_is_retried_on_another():
    """The first prefill worker dies with frames in flight: the decode reservation is released,
    and the request completes through the other prefill worker."""
    env = dict(os.environ, TANDEM_CLUSTER_SECRET=SECRET.hex())
    decode, spare = start_decode(config()), start_prefill(config())
    doomed = subprocess.Popen([sys.executable, "-m", "chaos.worker", "--role", "prefill",
                               "--decode-peer", str(decode.transfer_endpoint),
                               "--fault", "delay:after=7:seconds=60"],    # after the first layer group
                              stdout=subprocess.PIPE, text=True, env=env)
    gw = None
    try:
        doomed_address = doomed.stdout.readline().split()[2]
        gw = start_gateway([decode.address], [doomed_address, spare.address])   # the doomed one is picked first
        wait_ready(gw.url)
        end = time.monotonic() + 30
        while sum(w["healthy"] for w in json.loads(get(gw.url, "/v1/server_info")[1])["workers"]) < 3:
            assert time.monotonic() < end, "workers never all healthy"
            time.sleep(0.1)
        receiver = decode.roles[0].receiver

        def kill_when_pushing():
            end = time.monotonic() + 60
            while receiver.accepted_frames == 0 and time.monotonic() < end:
                time.sleep(0.05)                 # the first layer group arrived; the next is held
            doomed.send_signal(signal.SIGKILL)

        killer = threading.Thread(target=kill_when_pushing)
        killer.start()
        status, body = post(gw.url, "/v1/completions", {"model": "tiny-moe", "prompt": "word " * 100,
                                                        "max_tokens": 4, "temperature": 0}, timeout_s=120)
        killer.join()
        assert status == 200, body
        assert decode.roles[0].counts["failed"] == 1          # the first attempt ended, pages freed
        assert decode.roles[0].counts["finished"] == 1
        end = time.monotonic() + 10                              # the spare's report lands on its loop
        while spare.roles[0].counts["pushed"] != 1 and time.monotonic() < end:
            time.sleep(0.02)
        assert spare.roles[0].counts["pushed"] == 1
    finally:
        doomed.kill()
        doomed.wait(10)
        if gw is not None:
            gw.stop()
        wait_idle(decode, spare)
        decode.stop()
        spare.stop()


def test_a_push_refused_by_one_decode_worker_is_retried_on_another():
    """The first decode worker's transfer server is gone (as if its stream cap were full): the
    prefill worker's push to it fails, its Prefill reply says TRANSFER_FAILED before any token,
    and the gateway retries the request on the other decode worker; nothing is left reserved."""
    broken, healthy, prefill = start_decode(config()), start_decode(config()), start_prefill(config())
    broken.closers[0]()                          # stop its KV transfer server: every push is refused
    gw = start_gateway([broken.address, healthy.address], [prefill.address], request_timeout_s=60)
    try:
        wait_ready(gw.url)
        for i in range(6):
            status, body = post(gw.url, "/v1/completions", {"model": "tiny-moe", "prompt": f"x{i} = ",
                                                            "max_tokens": 3, "temperature": 0})
            assert status == 200 and body["usage"]["completion_tokens"] >= 1, body
        assert broken.counts()["failed"] >= 1, "no request was routed to the broken worker: nothing retried"
        assert healthy.counts()["finished"] == 6
    finally:
        gw.stop()
        wait_idle(broken, healthy, prefill)
        for h in (broken, healthy, prefill):
            h.stop()
