"""The workers' side of the prefix cache (issue 18): a decode worker reserves only what its
cache lacks and only that difference travels; prefill skips what its own cache holds; caches
never cross tenants or cache salts; a failed transfer caches nothing; eviction keeps outputs
exact; --no-prefix-cache; the colocated worker, whose two roles share one pool.  (The
CacheEvents stream, stats and health: test_prefix_events.py.)"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from deploy.colocated import start_colocated_worker
from deploy.worker import config_from, parser
from engine import LLM
from engine.params import SamplingParams
from engine.prefix_cache import max_cached_pages
from kv_transfer.hooks import TransferHooks
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc
from tests.workers import (
    SECRET,
    channel,
    config,
    generate_order,
    prefix_prompts,
    run,
    start_decode,
    start_prefill,
    wait_idle,
    worker_stats,
)
from worker.convert import params_to_proto
from worker.server import WorkerHandle

PARAMS = SamplingParams(max_tokens=8, temperature=0)
S = 16                                   # the workers' page size
KV_BYTES_PER_TOKEN = 6 * 2 * 2 * 32 * 4  # tiny-moe: layers x (K, V) x kv heads x head dim x fp32
FRAMES_PER_PAGE = 3                      # 6 layers sent in groups of 2


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(enable_prefix_cache=False)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[WorkerHandle, WorkerHandle]]:
    cfg = config(kv_audit=True, layer_group=2)
    decode, prefill = start_decode(cfg), start_prefill(cfg)
    yield decode, prefill
    wait_idle(decode, prefill)
    decode.stop()
    prefill.stop()


def expected_hit(shared: int, prompt_len: int) -> int:
    """Tokens a cache holding `shared` leading tokens of the prompt serves."""
    return min(shared // S, max_cached_pages(prompt_len, S)) * S


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_second_request_of_a_shared_prefix_transfers_only_the_delta(pair, reference):
    decode, prefill = pair
    dch, pch = channel(decode.address), channel(prefill.address)
    _, (a, b) = prefix_prompts(reference.tokenizer, "blue kettles", " Which colour is it?", " Why is it blue at all?")
    first = run(dch, pch, "delta-a", a, PARAMS)
    assert first.error is None and first.reservation.cached_tokens == 0 and first.finish.cached_tokens == 0
    frames, nbytes = decode.receiver.accepted_frames, decode.receiver.accepted_bytes
    before_p, before_d = worker_stats(prefill), worker_stats(decode)

    second = run(dch, pch, "delta-b", b, PARAMS)
    hit = expected_hit(common(a, b), len(b))
    assert hit >= 4 * S
    assert second.error is None
    assert second.reservation.cached_tokens == second.finish.cached_tokens == hit
    # only the pages after the cached prefix travelled, every layer group of each
    assert decode.receiver.accepted_frames - frames == (-(-len(b) // S) - hit // S) * FRAMES_PER_PAGE
    assert decode.receiver.accepted_bytes - nbytes == (len(b) - hit) * KV_BYTES_PER_TOKEN
    # prefill's own cache held the same prefix (it published the first prompt's pages)
    after_p, after_d = worker_stats(prefill), worker_stats(decode)
    assert after_p.cache_hit_tokens - before_p.cache_hit_tokens == hit
    assert after_p.cache_query_tokens - before_p.cache_query_tokens == len(b)
    assert after_d.cache_hit_tokens - before_d.cache_hit_tokens == hit
    assert after_d.cache_query_tokens - before_d.cache_query_tokens == len(b)
    assert after_d.transfer_bytes_accepted == decode.receiver.accepted_bytes
    want = reference.generate([a, b], PARAMS)
    assert [first.token_ids, second.token_ids] == [w.token_ids for w in want]
    wait_idle(decode, prefill)


def test_prefill_replies_with_its_own_hit_and_sends_from_the_decode_boundary(pair, reference):
    """A decode worker that has seen nothing: prefill computes only what its own cache lacks,
    replies with its own hit, and sends every page (cached ones included) from the decode
    worker's boundary, 0, on."""
    decode, prefill = pair
    pch = channel(prefill.address)
    _, (a, b) = prefix_prompts(reference.tokenizer, "uneven caches", " One?", " Two?")
    assert run(channel(decode.address), pch, "uneven-a", a, PARAMS).error is None
    fresh = start_decode(config(kv_audit=True))
    try:
        fch = channel(fresh.address)
        order = generate_order("uneven-b", b, PARAMS)
        call = wpb_grpc.DecodeServiceStub(fch).Generate(order.to_proto(), timeout=60)
        res = next(call).reservation
        assert res.cached_tokens == 0
        reply = wpb_grpc.PrefillServiceStub(pch).Prefill(order.prefill_order(res).to_proto(), timeout=60)
        assert reply.ok and reply.cached_tokens == expected_hit(common(a, b), len(b)) > 0
        assert reply.frames == -(-len(b) // S) * FRAMES_PER_PAGE
        assert fresh.receiver.accepted_bytes == len(b) * KV_BYTES_PER_TOKEN
        tokens = [t for msg in call if msg.WhichOneof("kind") == "tokens" for t in msg.tokens.token_ids]
        assert tokens == reference.generate([b], PARAMS)[0].token_ids
        wait_idle(fresh, decode, prefill)
    finally:
        fresh.stop()


def test_a_cache_is_never_shared_across_tenants_or_cache_salts(pair, reference):
    decode, prefill = pair
    dch, pch = channel(decode.address), channel(prefill.address)
    _, (ids,) = prefix_prompts(reference.tokenizer, "tenant isolation", " Tell me the secret.")
    want = reference.generate([ids], PARAMS)[0].token_ids
    hit = max_cached_pages(len(ids), S) * S
    first = run(dch, pch, "iso-1", ids, PARAMS, tenant="acme")
    other = run(dch, pch, "iso-2", ids, PARAMS, tenant="globex")
    salted = run(dch, pch, "iso-3", ids, PARAMS, tenant="acme", cache_salt="alice")
    again = run(dch, pch, "iso-4", ids, PARAMS, tenant="acme")
    salted_again = run(dch, pch, "iso-5", ids, PARAMS, tenant="acme", cache_salt="alice")
    assert [r.reservation.cached_tokens for r in (first, other, salted, again, salted_again)] == [0, 0, 0, hit, hit]
    for r in (first, other, salted, again, salted_again):
        assert r.error is None and r.token_ids == want
    wait_idle(decode, prefill)


def test_a_cache_salt_over_the_limit_is_refused(pair):
    decode, _ = pair
    r = run(channel(decode.address), None, "long-salt", [5, 6, 7], PARAMS, cache_salt="x" * 257)
    assert r.error is not None and r.error.code == "INVALID_REQUEST" and "at most 256" in r.error.message
    assert r.reservation is None


@pytest.mark.parametrize("cached, prompt_len", [(5, 40), (48, 40), (40, 40), (32, 32)])
def test_prefill_refuses_a_decode_boundary_that_is_not_whole_pages_inside_the_prompt(pair, cached, prompt_len):
    decode, prefill = pair
    p = params_to_proto(PARAMS)
    p.has_seed, p.seed = True, 7
    reply = wpb_grpc.PrefillServiceStub(channel(prefill.address)).Prefill(wpb.PrefillRequest(
        request_id="bad-boundary", tenant="acme", prompt_token_ids=list(range(10, 10 + prompt_len)), params=p,
        decode_endpoint=decode.transfer_endpoint, transfer_id=secrets.token_bytes(16),
        cached_tokens=cached))
    assert not reply.ok and reply.error.code == "INVALID_REQUEST"
    assert f"cached_tokens={cached} must" in reply.error.message and "page size (16)" in reply.error.message
    assert not prefill.roles[0].jobs and not prefill.core.scheduler.has_work()
    wait_idle(prefill)


def test_a_failed_transfer_publishes_nothing(pair, reference):
    """Frames marked written but never copied: the commit's re-checksum refuses the transfer,
    and none of its pages enters the decode worker's cache (nor any event)."""
    decode, prefill = pair
    _, (ids,) = prefix_prompts(reference.tokenizer, "failed transfers", " Is this cached?")
    cached, seq = decode.core.pool.num_cached, decode.core.pool.events.seq
    decode.install_transfer_hooks(TransferHooks(receiver=SkipWrites()))
    try:
        r = run(channel(decode.address), channel(prefill.address), "failed-push", ids, PARAMS)
    finally:
        decode.install_transfer_hooks(TransferHooks())
    assert r.error is not None and r.error.code == "TRANSFER_FAILED" and not r.token_ids
    wait_idle(decode, prefill)
    assert decode.core.pool.num_cached == cached and decode.core.pool.events.seq == seq
    again = run(channel(decode.address), channel(prefill.address), "after-failed-push", ids, PARAMS)
    assert again.reservation.cached_tokens == 0          # nothing of the failed one was kept
    assert again.token_ids == reference.generate([ids], PARAMS)[0].token_ids
    wait_idle(decode, prefill)


class SkipWrites:
    def before_receive(self, header) -> None:
        pass

    def skip_write(self, header, holds_payload) -> bool:
        return True


def test_eviction_under_a_small_pool_keeps_outputs_exact(reference):
    cfg = config(kv_cache_tokens=512, max_model_len=256, kv_audit=True)
    decode, prefill = start_decode(cfg), start_prefill(cfg)
    try:
        dch, pch = channel(decode.address), channel(prefill.address)
        _, ids = prefix_prompts(reference.tokenizer, "eviction", *[f" Question number {i}?" for i in range(8)])
        ids = [reference.tokenizer.encode(f"topic {i}: ") + p for i, p in enumerate(ids)]   # no shared pages
        out = [run(dch, pch, f"evict-{i}", p, PARAMS) for i, p in enumerate(ids)]
        want = reference.generate(ids, PARAMS)
        assert [o.token_ids for o in out] == [w.token_ids for w in want]
        assert worker_stats(decode).cache_evictions > 0 and worker_stats(prefill).cache_evictions > 0
        wait_idle(decode, prefill)
    finally:
        decode.stop()
        prefill.stop()


def test_no_prefix_cache_computes_and_transfers_everything(reference, monkeypatch):
    monkeypatch.setenv("TANDEM_CLUSTER_SECRET", SECRET.hex())
    assert not config_from(parser().parse_args(["--role", "decode", "--no-prefix-cache"])).engine.enable_prefix_cache
    assert config_from(parser().parse_args(["--role", "decode"])).engine.enable_prefix_cache
    cfg = config(enable_prefix_cache=False)
    decode, prefill = start_decode(cfg), start_prefill(cfg)
    try:
        dch, pch = channel(decode.address), channel(prefill.address)
        _, (ids,) = prefix_prompts(reference.tokenizer, "no cache", " Again?")
        out = [run(dch, pch, f"nocache-{i}", ids, PARAMS) for i in range(2)]
        assert [o.reservation.cached_tokens for o in out] == [0, 0]
        assert decode.receiver.accepted_bytes == 2 * len(ids) * KV_BYTES_PER_TOKEN
        assert out[1].token_ids == reference.generate([ids], PARAMS)[0].token_ids
        for handle in (decode, prefill):
            s = worker_stats(handle)
            assert s.kv_pages_cached == 0 and s.cache_hit_tokens == 0 and s.cache_query_tokens == 2 * len(ids)
        assert not wpb_grpc.DecodeServiceStub(dch).Health(wpb.HealthRequest()).prefix_cache
        wait_idle(decode, prefill)
    finally:
        decode.stop()
        prefill.stop()


def test_colocated_roles_share_one_cache_without_double_counting(reference):
    worker = start_colocated_worker(config(kv_audit=True, max_prefill_tokens=64))
    try:
        ch = channel(worker.address)
        _, (a, b) = prefix_prompts(reference.tokenizer, "colocation", " First question?", " Second question?")
        first = run(ch, None, "colo-a", a, PARAMS)
        nbytes = worker.receiver.accepted_bytes
        second = run(ch, None, "colo-b", b, PARAMS)
        hit = expected_hit(common(a, b), len(b))
        assert first.reservation.cached_tokens == 0 and second.reservation.cached_tokens == hit > 0
        assert worker.receiver.accepted_bytes - nbytes == (len(b) - hit) * KV_BYTES_PER_TOKEN
        assert [first.token_ids, second.token_ids] == [w.token_ids for w in reference.generate([a, b], PARAMS)]
        s = wpb_grpc.DecodeServiceStub(ch).Stats(wpb.StatsRequest())
        assert s.cache_query_tokens == len(a) + len(b) and s.cache_hit_tokens == hit
        wait_idle(worker)
    finally:
        worker.stop()
