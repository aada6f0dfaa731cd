"""Admission: oversized prompts are refused with 400 before any worker sees them (the workers'
counters prove no reservation and no KV byte), a prompt exactly at the limit passes, and the
queue's limits answer 429."""

from __future__ import annotations

import threading

import pytest

from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc
from tests.gateway_helpers import gateway_cluster, post
from tests.workers import channel, config

CONTEXT = 256


@pytest.fixture(scope="module")
def cluster():
    with gateway_cluster(config(max_model_len=CONTEXT), config(max_model_len=CONTEXT),
                         tenant_max_concurrency=2) as c:
        yield c


def stats(handle, kind):
    ch = channel(handle.address)
    stub = wpb_grpc.DecodeServiceStub(ch) if kind == "decode" else wpb_grpc.PrefillServiceStub(ch)
    return stub.Stats(wpb.StatsRequest())


def counters(decode, prefill):
    d, p = stats(decode, "decode"), stats(prefill, "prefill")
    recv = decode.roles[0].receiver
    return (d.requests_finished, d.requests_failed, recv.accepted_bytes, recv.committed, p.requests_finished,
            p.requests_failed, prefill.roles[0].counts["pushed"])


@pytest.mark.parametrize("over", [1, 5000])
def test_an_oversized_prompt_is_refused_before_any_worker(cluster, over):
    gw, decode, prefill = cluster
    before = counters(decode, prefill)
    status, body = post(gw.url, "/v1/completions", {"model": "tiny-moe", "prompt": [7] * (CONTEXT - 4 + over),
                                                    "max_tokens": 4})
    assert status == 400 and body["error"]["code"] == "context_length"
    message = body["error"]["message"]
    assert f"prompt_tokens ({CONTEXT - 4 + over}) + max_tokens (4) = {CONTEXT + over}" in message
    assert f"context length of {CONTEXT} tokens" in message
    assert counters(decode, prefill) == before                 # no reservation, no KV byte
    assert decode.core.pool.num_free == decode.core.pool.num_pages


def test_a_prompt_exactly_at_the_limit_passes(cluster):
    gw, decode, prefill = cluster
    before = counters(decode, prefill)
    status, body = post(gw.url, "/v1/completions", {"model": "tiny-moe", "prompt": [7] * (CONTEXT - 4),
                                                    "max_tokens": 4, "ignore_eos": True, "temperature": 0})
    assert status == 200, body
    usage = body["usage"]
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]     # what the decode worker's cache held
    assert usage == {"prompt_tokens": CONTEXT - 4, "completion_tokens": 4, "total_tokens": CONTEXT}
    assert 0 <= cached < CONTEXT - 4
    assert counters(decode, prefill)[0] == before[0] + 1


def test_chat_prompts_are_counted_after_the_template(cluster):
    status, body = post(cluster[0].url, "/v1/chat/completions", {
        "model": "tiny-moe", "messages": [{"role": "user", "content": "word " * 300}], "max_tokens": 4})
    assert status == 400 and body["error"]["code"] == "context_length"


def test_a_tenant_over_its_limit_gets_429(cluster):
    gw = cluster[0]
    body = {"model": "tiny-moe", "prompt": "while True:\n", "max_tokens": 200, "ignore_eos": True}
    results = []
    threads = [threading.Thread(target=lambda: results.append(post(gw.url, "/v1/completions", body)[0]))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results).count(200) >= 2 and 429 in results      # limit 2 per tenant
    status, text = post(gw.url, "/v1/completions", {"model": "tiny-moe", "prompt": "x", "max_tokens": 1})
    assert status == 200


def test_requests_wait_for_room_when_every_decode_worker_is_full():
    """Three requests that each need half the decode pool: the third waits for room, no 503."""
    with gateway_cluster(config(max_model_len=256, kv_cache_tokens=512), config(max_model_len=256)) as (gw, decode, _):
        body = {"model": "tiny-moe", "prompt": [7] * 200, "max_tokens": 56, "ignore_eos": True}
        results = []
        threads = [threading.Thread(target=lambda: results.append(post(gw.url, "/v1/completions", body)))
                   for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [status for status, _ in results] == [200, 200, 200], results
        assert all(b["usage"]["completion_tokens"] == 56 for _, b in results)
