"""The CacheEvents stream of both worker roles (a reset with the keys cached now, then what
was stored and evicted, the keys equal to `engine.prefix_cache.page_keys`; heartbeats; a
bounded number of subscribers; authenticated like every RPC; ends with the worker), and the
cache's fields in Health and Stats."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import msgpack
import pytest

from engine import LLM
from engine.params import SamplingParams
from engine.prefix_cache import CacheEventLog, cache_salt, page_keys
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc
from tests.workers import (
    SECRET,
    channel,
    config,
    prefix_prompts,
    run,
    start_decode,
    start_prefill,
    wait_idle,
    worker_stats,
)
from worker.cache_events import MAX_SUBSCRIBERS, CacheEventStreams
from worker.server import WorkerHandle

PARAMS = SamplingParams(max_tokens=8, temperature=0)
S = 16                                   # the workers' page size


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(enable_prefix_cache=False)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[WorkerHandle, WorkerHandle]]:
    cfg = config(kv_audit=True)
    decode, prefill = start_decode(cfg), start_prefill(cfg)
    yield decode, prefill
    wait_idle(decode, prefill)
    decode.stop()
    prefill.stop()


def read_until(stream: Iterator[wpb.CacheEventBatch], want: set[bytes], reads: int = 20) -> tuple[set, list]:
    """Read batches until every key of `want` was stored (bounded); returns the keys stored and
    the batches read."""
    stored: set[bytes] = set()
    batches = []
    for _ in range(reads):
        batch = msgpack.unpackb(next(stream).events)
        batches.append(batch)
        stored |= set(batch["stored"])
        stored -= set(batch["evicted"])
        if want <= stored:
            break
    return stored, batches


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_cache_events_stream_a_reset_then_the_keys_of_what_was_cached(pair, reference, role):
    decode, prefill = pair
    handle = decode if role == "decode" else prefill
    dch, pch = channel(decode.address), channel(prefill.address)
    ch = channel(handle.address)
    stub = wpb_grpc.DecodeServiceStub(ch) if role == "decode" else wpb_grpc.PrefillServiceStub(ch)
    call = stub.CacheEvents(wpb.CacheEventsRequest(), timeout=60)
    try:
        reset = msgpack.unpackb(next(call).events)
        assert reset["reset"] and reset["page_size"] == S and not reset["evicted"]
        assert set(reset["stored"]) == {handle.core.pool.cache.key(p) for p in range(handle.core.pool.num_pages)
                                        if p in handle.core.pool.cache}
        _, (ids,) = prefix_prompts(reference.tokenizer, f"events on {role}", " What was stored?")
        out = run(dch, pch, f"events-{role}", ids, PARAMS, tenant="acme")
        assert out.error is None
        salt = cache_salt(SECRET, "acme")
        if role == "decode":      # prompt and output pages, all but the last token's KV computed
            computed = (ids + out.token_ids)[:len(ids) + len(out.token_ids) - 1]
        else:                     # prefill publishes the prompt's pages
            computed = ids
        want = set(page_keys(salt, computed, S))
        stored, batches = read_until(call, want)
        assert stored == want
        assert all(not b["reset"] and b["epoch"] == reset["epoch"] for b in batches)
    finally:
        call.cancel()
    wait_idle(decode, prefill)


def test_cache_events_are_bounded_and_authenticated(pair):
    decode, _ = pair
    streams = decode.cache_events
    assert streams is not None and streams.subscribers == 0
    stub = wpb_grpc.DecodeServiceStub(channel(decode.address))
    calls = [stub.CacheEvents(wpb.CacheEventsRequest(), timeout=60) for _ in range(MAX_SUBSCRIBERS)]
    try:
        for call in calls:
            assert msgpack.unpackb(next(call).events)["reset"]
        with pytest.raises(grpc.RpcError) as e:
            next(stub.CacheEvents(wpb.CacheEventsRequest(), timeout=60))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert streams.subscribers == MAX_SUBSCRIBERS
    finally:
        for call in calls:
            call.cancel()
    with grpc.insecure_channel(decode.address) as plain:
        with pytest.raises(grpc.RpcError) as e:
            next(wpb_grpc.DecodeServiceStub(plain).CacheEvents(wpb.CacheEventsRequest(), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # the cancelled streams give their places back (each notices within one wait of the log)
    gone = threading.Event()
    for _ in range(200):
        if streams.subscribers == 0:
            break
        gone.wait(0.05)
    assert streams.subscribers == 0
    call = stub.CacheEvents(wpb.CacheEventsRequest(), timeout=60)
    assert msgpack.unpackb(next(call).events)["reset"]
    call.cancel()


def test_stats_and_health_report_the_cache(pair, reference):
    decode, prefill = pair
    dch, pch = channel(decode.address), channel(prefill.address)
    _, prompts = prefix_prompts(reference.tokenizer, "statistics", " Mean?", " Median?")
    for i, ids in enumerate(prompts):
        assert run(dch, pch, f"stats-{i}", ids, PARAMS).error is None
    wait_idle(decode, prefill)
    for handle in (decode, prefill):
        ch = channel(handle.address)
        stub = wpb_grpc.PrefillServiceStub(ch) if handle is prefill else wpb_grpc.DecodeServiceStub(ch)
        health = stub.Health(wpb.HealthRequest())
        assert health.kv_page_size == S and health.prefix_cache
        s = stub.Stats(wpb.StatsRequest())
        pool = handle.core.pool
        assert s.kv_pages_cached == pool.num_cached > 0
        assert s.kv_pages_evictable == pool.num_evictable == pool.num_cached     # idle: none referenced
        assert s.kv_pages_free == s.kv_pages_capacity                         # evictable pages count as free
        assert s.cache_evictions == pool.evictions
        assert 0 < s.cache_hit_tokens < s.cache_query_tokens
    assert worker_stats(decode).transfer_bytes_accepted == decode.receiver.accepted_bytes > 0
    assert worker_stats(prefill).transfer_bytes_accepted == 0


class FakeContext:
    """What CacheEventStreams uses of a grpc.ServicerContext."""

    def __init__(self) -> None:
        self.active = True

    def is_active(self) -> bool:
        return self.active

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError(f"{code.name}: {details}")


def test_an_event_stream_sends_heartbeats_when_idle_deltas_when_not_and_ends_with_the_worker():
    log = CacheEventLog(page_size=S)
    log.stored(b"k" * 16)
    closing = threading.Event()
    streams = CacheEventStreams(log, closing.is_set, max_subscribers=1, wait_s=0.01, heartbeat_s=0.02)
    stream = streams.stream(FakeContext())
    reset = msgpack.unpackb(next(stream).events)
    assert reset["reset"] and reset["stored"] == [b"k" * 16] and reset["seq"] == 1
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED: at most 1 CacheEvents subscribers"):
        next(streams.stream(FakeContext()))
    beat = msgpack.unpackb(next(stream).events)          # nothing changed: a heartbeat
    assert not beat["reset"] and beat["stored"] == beat["evicted"] == [] and beat["seq"] == 1
    log.evicted(b"k" * 16)
    log.stored(b"m" * 16)
    delta = msgpack.unpackb(next(stream).events)
    assert (delta["stored"], delta["evicted"], delta["seq"]) == ([b"m" * 16], [b"k" * 16], 3)
    assert streams.subscribers == 1
    closing.set()
    with pytest.raises(StopIteration):
        next(stream)
    assert streams.subscribers == 0
    cancelled = FakeContext()
    stream = streams.stream(cancelled)                    # the place was given back
    next(stream)
    cancelled.active = False
    assert list(stream) == [] and streams.subscribers == 0


def test_a_large_reset_goes_out_in_messages_of_bounded_size():
    log = CacheEventLog(page_size=S)
    keys = [bytes([i]) * 16 for i in range(5)]
    for k in keys:
        log.stored(k)
    log.evicted(keys[0])
    streams = CacheEventStreams(log, lambda: False, wait_s=0.01, max_keys=2)
    stream = streams.stream(FakeContext())
    batches = [msgpack.unpackb(next(stream).events) for _ in range(2)]
    assert [(b["reset"], b["stored"]) for b in batches] == [(True, keys[1:3]), (False, keys[3:5])]
    log.close()
    assert list(stream) == [] and streams.subscribers == 0

