"""Every way a request can end early ends it with a coded error and leaves every pool intact
and fully free: cancel mid-stream, Abort, a reservation that receives nothing, a prefill worker
killed mid-push, and a prompt over the worker's own limit (refused before any page)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from engine.params import SamplingParams
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc
from tests.workers import SECRET, channel, config, module_worker, run, start_decode, start_prefill, wait_idle
from worker.client import generate
from worker.convert import params_to_proto
from worker.server import build_core

LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


decode = module_worker(start_decode, transfer_timeout_s=1.0, max_model_len=1024)
prefill = module_worker(start_prefill)


@pytest.fixture
def ids(shipped_llm):
    return shipped_llm.tokenizer.encode("def add(a, b):\n    return")


def open_stream(decode, rid, ids, params):
    stub = wpb_grpc.DecodeServiceStub(channel(decode.address))
    return stub, stub.Generate(wpb.GenerateRequest(request_id=rid, tenant="acme", prompt_token_ids=ids,
                                                   params=params_to_proto(params)), timeout=60)


def test_an_oversized_prompt_is_refused_before_any_page(decode, ids):
    free = decode.core.pool.num_free
    _, call = open_stream(decode, "big", ids * 120, SamplingParams(max_tokens=16))
    msgs = list(call)
    assert len(msgs) == 1 and msgs[0].error.code == "PROMPT_TOO_LONG"
    assert "exceeds the model context of 1024 tokens" in msgs[0].error.message
    assert decode.core.pool.num_free == free and decode.roles[0].receiver.open_transfers == 0
    assert list(open_stream(decode, "bad", [10**6], SamplingParams())[1])[0].error.code == "INVALID_REQUEST"
    stub = wpb_grpc.DecodeServiceStub(channel(decode.address))
    bad_timeout = list(stub.Generate(wpb.GenerateRequest(request_id="neg", tenant="acme", prompt_token_ids=ids,
                                                         params=params_to_proto(SamplingParams()), timeout_s=-1)))
    assert bad_timeout[0].error.code == "INVALID_REQUEST" and decode.core.pool.num_free == free


def test_a_request_id_that_could_name_another_requests_pages_is_refused(decode, ids):
    free = decode.core.pool.num_free
    msgs = list(open_stream(decode, "x#prefill", ids, SamplingParams(max_tokens=4))[1])
    assert len(msgs) == 1 and msgs[0].error.code == "INVALID_REQUEST" and "'#'" in msgs[0].error.message
    assert decode.core.pool.num_free == free


def test_a_request_that_ends_on_its_first_token(decode, prefill, ids, shipped_llm):
    """The first token arrives with the transfer's commit: max_tokens=1 ends the request on it."""
    one = SamplingParams(max_tokens=1, temperature=0)
    got = run(channel(decode.address), channel(prefill.address), "one", ids, one)
    want = shipped_llm.generate([ids], one)[0]
    assert got.error is None and got.token_ids == want.token_ids and got.finish.finish_reason == "length"
    assert got.finish.completion_tokens == 1
    wait_idle(decode, prefill)


def test_cancelling_the_stream_mid_decode_frees_the_pages(decode, prefill, ids):
    gen = generate(channel(decode.address), channel(prefill.address),
                   "cancel-me", "acme", ids, LONG)
    kinds = [next(gen).WhichOneof("kind") for _ in range(4)]
    assert kinds == ["reservation", "tokens", "tokens", "tokens"]
    assert decode.core.pool.num_free < decode.core.pool.num_pages
    gen.close()                                                # the client goes away
    wait_idle(decode, prefill)


def test_abort_ends_the_stream_with_a_coded_error(decode, prefill, ids):
    gen = generate(channel(decode.address), channel(prefill.address),
                   "abort-me", "acme", ids, LONG)
    tid = next(gen).reservation.transfer_id
    assert next(gen).WhichOneof("kind") == "tokens"
    stub = wpb_grpc.DecodeServiceStub(channel(decode.address))
    assert stub.Abort(wpb.AbortRequest(request_id="abort-me", transfer_id=tid)).found
    last = list(gen)[-1]
    assert last.error.code == "ABORTED"
    assert not stub.Abort(wpb.AbortRequest(request_id="abort-me", transfer_id=tid)).found
    wait_idle(decode, prefill)


def test_a_reservation_that_receives_nothing_times_out(decode, ids):
    _, call = open_stream(decode, "no-prefill", ids, SamplingParams(max_tokens=8))
    msgs = list(call)                                          # nobody prefills: 1 s timeout
    assert msgs[0].WhichOneof("kind") == "reservation"
    assert msgs[-1].error.code == "TRANSFER_FAILED" and "EXPIRED" in msgs[-1].error.message
    wait_idle(decode)


def test_a_prefill_worker_killed_mid_push(decode, ids):
    env = dict(os.environ, TANDEM_CLUSTER_SECRET=SECRET.hex())
    proc = subprocess.Popen([sys.executable, "-m", "chaos.worker", "--role", "prefill",
                             "--decode-peer", decode.transfer_endpoint,
                             "--fault", "delay:after=3:seconds=60"],   # after the first layer group
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline().split()
        assert line[:2] == ["READY", "prefill"], line
        gen = generate(channel(decode.address), channel(line[2]),
                       "killed", "acme", ids * 4, SamplingParams(max_tokens=8))
        assert next(gen).WhichOneof("kind") == "reservation"
        receiver = decode.roles[0].receiver
        base = receiver.accepted_frames
        end = time.monotonic() + 30
        while receiver.accepted_frames == base and time.monotonic() < end:
            time.sleep(0.05)
        assert receiver.accepted_frames > base, "the push never started"
        proc.send_signal(signal.SIGKILL)                        # dies with frames in flight
        last = list(gen)[-1]
        assert last.WhichOneof("kind") == "error"
        assert last.error.code in ("TRANSFER_FAILED", "PREFILL_UNAVAILABLE"), last.error
    finally:
        proc.kill()
        proc.wait(timeout=10)
    wait_idle(decode)


def test_start_up_refuses_a_pool_smaller_than_the_context():
    with pytest.raises(ValueError, match="raise --kv-cache-tokens to at least 2048"):
        build_core(config(kv_cache_tokens=512))


def test_stopping_a_worker_ends_its_streams_with_an_explicit_error(prefill, ids):
    decode = start_decode(config())
    gen = generate(channel(decode.address), channel(prefill.address),
                   "in-flight", "acme", ids, LONG)
    assert [next(gen).WhichOneof("kind") for _ in range(3)] == ["reservation", "tokens", "tokens"]
    decode.stop()
    last = list(gen)[-1]
    assert last.WhichOneof("kind") == "error" and last.error.code in ("UNAVAILABLE", "DECODE_UNAVAILABLE")
    wait_idle(decode, prefill)
