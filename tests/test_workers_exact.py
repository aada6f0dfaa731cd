"""Disaggregated (and colocated) greedy output equals the single-process engine's (I7), with
paged experts on (K = E/4) and off, for 18 prompts decoded concurrently."""

from __future__ import annotations

import gc
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from decode_worker.engine import DecodeEngine
from deploy.colocated import start_colocated_worker
from engine.params import SamplingParams
from engine.scheduler import Scheduler
from kv_transfer.reservation import State
from kv_transfer.transport.nixl_agent import unavailable as nixl_unavailable
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc
from tests.workers import Result, channel, config, run, start_decode, start_prefill, wait_idle
from worker.client import generate

CHATS = ["Repeat after me: blue kettle", "What does isinstance do?", "Say hello to Ada.",
         "Please repeat: paged experts keep the hot experts resident", "Name a Python keyword.",
         "Repeat after me: tandem-canary-7f3a", "What is a list?", "Write a haiku about pages."]
TEXTS = ["def add(a, b):\n    return", "import os\n\nfor name in os.listdir(", "class Stack:\n    def push(self",
         "The quick brown fox", "# Copyright 2026\n", "x = [i * i for i in range(", "while True:\n",
         "SELECT name FROM users WHERE", "if __name__ == '__main__':\n", "try:\n    value = int("]
PARAMS = SamplingParams(max_tokens=24, temperature=0, logprobs=2)


@pytest.fixture(scope="module")
def prompts(shipped_llm):
    tok = shipped_llm.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in CHATS]
    ids += [tok.encode(t) for t in TEXTS]
    ids.append(tok.encode("word " * 300))       # 300+ tokens: chunked prefill (budget below)
    return ids


@pytest.fixture(scope="module")
def reference(shipped_llm, prompts):
    return shipped_llm.generate(prompts, PARAMS)


@pytest.mark.parametrize("resident, transfer", [(None, "grpc"), (16, "grpc"), (None, "shm"), (None, "nixl")])
def test_disaggregated_greedy_equals_the_engine(prompts, reference, resident, transfer):
    if transfer == "nixl" and (why := nixl_unavailable()) is not None:
        pytest.skip(why)
    cfg = config(paged_experts_num_resident=resident, max_prefill_tokens=128, layer_group=2,
                 transfer=transfer)
    decode, prefill = start_decode(cfg), start_prefill(cfg)
    try:
        dch, pch = channel(decode.address), channel(prefill.address)
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda i: run(dch, pch, f"r{i}", prompts[i], PARAMS), range(len(prompts))))
        for want, got in zip(reference, results):
            assert got.error is None, got.error
            assert got.token_ids == want.token_ids
            assert got.finish.finish_reason == want.finish_reason
            assert got.text == want.text
            assert got.finish.completion_tokens == len(want.token_ids)
        wait_idle(decode, prefill)
        stats = wpb_grpc.DecodeServiceStub(dch).Stats(wpb.StatsRequest())
        assert stats.role == "decode" and stats.requests_finished == len(prompts)
        assert stats.kv_pages_free == stats.kv_pages_capacity and stats.running == stats.waiting == 0
        assert stats.transfers_accepted > 0 and not stats.transfers_refused
        assert [(e.paged, e.format) for e in stats.experts] == [(resident is not None, "float32")] * 6
        if resident is not None:
            assert sum(layer.misses for layer in stats.experts) > 0    # experts really were paged
        pstats = wpb_grpc.PrefillServiceStub(pch).Stats(wpb.StatsRequest())
        assert pstats.role == "prefill" and pstats.requests_finished == len(prompts)
        health = wpb_grpc.PrefillServiceStub(pch).Health(wpb.HealthRequest())
        assert health.ready and health.max_model_len == 2048 and health.kv_capacity_tokens == 8192
    finally:
        decode.stop()
        prefill.stop()


def test_colocated_greedy_equals_the_engine(prompts, reference):
    worker = start_colocated_worker(config(max_prefill_tokens=128))
    try:
        ch = channel(worker.address)
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: run(ch, None, f"c{i}", prompts[i], PARAMS), range(len(prompts))))
        for want, got in zip(reference, results):
            assert got.error is None and got.token_ids == want.token_ids and got.text == want.text
        wait_idle(worker)
        # one scheduler over the worker's pool, driven for both roles
        pool = worker.core.pool
        gc.collect()
        schedulers = [o for o in gc.get_objects() if type(o) is Scheduler and o.pool is pool]
        assert schedulers == [worker.core.scheduler] and len(worker.roles) == 2
        assert all(role.core is worker.core for role in worker.roles)
    finally:
        worker.stop()


def test_seeded_sampling_continues_the_engines_stream(shipped_llm, prompts):
    """The first token is sampled on the prefill worker, the rest on the decode worker: the
    seeded stream still equals the single-process one."""
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    want = shipped_llm.generate(prompts[:4], params)
    worker = start_colocated_worker(config())
    try:
        ch = channel(worker.address)
        for i, w in enumerate(want):
            assert run(ch, None, f"s{i}", prompts[i], params).token_ids == w.token_ids
    finally:
        worker.stop()


def test_a_colocated_worker_full_of_decodes_still_prefills(prompts, reference):
    """One scheduler, two kinds of request: while max_num_seqs requests decode, the next prompt
    is prefilled and its transfer committed at once (each kind has its own places), not held
    back until a running stream ends; it then decodes when a place frees."""
    worker = start_colocated_worker(config(max_num_seqs=2))
    decode = next(r for r in worker.roles if isinstance(r, DecodeEngine))
    ch = channel(worker.address)
    long = SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True)
    started = [threading.Event(), threading.Event()]
    streams = [generate(ch, None, f"long{i}", "acme", prompts[i], long) for i in range(2)]
    results: list[Result] = []

    def read(i: int) -> None:
        for msg in streams[i]:
            if msg.WhichOneof("kind") == "tokens":
                started[i].set()
    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
    short = threading.Thread(target=lambda: results.append(run(ch, None, "short", prompts[2], PARAMS)))
    try:
        for t in readers:
            t.start()
        assert all(e.wait(60) for e in started)       # both decode places are taken
        short.start()
        end = time.monotonic() + 60
        while time.monotonic() < end:
            dreq = decode.requests.get("short")
            if dreq is not None and dreq.reservation.state == State.COMMITTED:
                break
            time.sleep(0.005)
        assert all(t.is_alive() for t in readers), "the prompt waited for a running stream to end"
        assert decode.requests["short"].reservation.state == State.COMMITTED
    finally:
        stub = wpb_grpc.DecodeServiceStub(ch)
        for i in range(2):                            # the long streams end: a place frees
            dreq = decode.requests.get(f"long{i}")
            if dreq is not None:
                stub.Abort(wpb.AbortRequest(request_id=f"long{i}", transfer_id=dreq.reservation.transfer_id))
        for t in readers:
            t.join(30)
        short.join(60)
        wait_idle(worker)
        worker.stop()
    assert results and results[0].error is None and results[0].token_ids == reference[2].token_ids
