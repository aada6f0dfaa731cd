"""Draining a worker (issue 19): a Drain call stops admissions (DRAINING, Health and Stats say
draining), lets live requests finish within the grace period, then ends the rest with DRAINING
and frees their pages (committed or not, I6); undo admits again.  worker/drain.py's rules
(an undone drain ends nothing, a request on two roles counts once) are tested on fakes."""

from __future__ import annotations

import threading
from collections import Counter

import grpc
import pytest

from deploy.colocated import start_colocated_worker
from engine.errors import ErrorCode
from engine.params import SamplingParams
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc
from tests.workers import channel, config, generate_order, module_worker, run, start_decode, start_prefill, wait_idle
from worker.drain import DrainResult, drain

LONG = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

decode = module_worker(start_decode)
prefill = module_worker(start_prefill)


def _open(ch: grpc.Channel, rid: str, ids: list[int], params: SamplingParams):
    """A Generate stream and the Prefill call that fills its reservation (its first message)."""
    order = generate_order(rid, ids, params, timeout_s=120)
    call = wpb_grpc.DecodeServiceStub(ch).Generate(order.to_proto(), timeout=120)
    first = next(call)
    assert first.WhichOneof("kind") == "reservation", first
    return call, order.prefill_order(first.reservation).to_proto()


def _read_after_first_token(call, started: threading.Event, out: list) -> None:
    for msg in call:
        if msg.WhichOneof("kind") == "tokens":
            started.set()
        out.append(msg)


def test_a_drain_lets_short_requests_finish_and_ends_the_rest(decode, prefill, shipped_llm):
    dch, pch = channel(decode.address), channel(prefill.address)
    dstub, pstub = wpb_grpc.DecodeServiceStub(dch), wpb_grpc.PrefillServiceStub(pch)
    ids = shipped_llm.tokenizer.encode("def add(a, b):\n    return")
    # L decodes (long), W holds a reservation whose prefill never comes, S is reserved and prefilled
    # once the drain began: S finishes within the grace period, L and W are ended after it
    long_call, long_fill = _open(dch, "L", ids, LONG)
    long_prefill = pstub.Prefill.future(long_fill, timeout=120)
    started, long_msgs = threading.Event(), []
    reader = threading.Thread(target=_read_after_first_token, args=(long_call, started, long_msgs), daemon=True)
    reader.start()
    assert started.wait(60), long_prefill.result()
    wait_call, _ = _open(dch, "W", ids, SHORT)
    short_call, short_fill = _open(dch, "S", ids, SHORT)
    reply: list[wpb.DrainReply] = []
    drainer = threading.Thread(target=lambda: reply.append(dstub.Drain(wpb.DrainRequest(grace_s=2), timeout=60)))
    drainer.start()
    assert _wait(lambda: dstub.Health(wpb.HealthRequest()).draining)
    refused = list(dstub.Generate(generate_order("new", ids, SHORT, timeout_s=None).to_proto(), timeout=60))
    assert [m.error.code for m in refused] == ["DRAINING"]
    assert pstub.Prefill(short_fill, timeout=60).ok
    short = list(short_call)
    assert [m.WhichOneof("kind") for m in short] == ["tokens", "tokens", "finish"]
    drainer.join(60)
    reader.join(60)
    assert long_prefill.result().ok
    assert reply and (reply[0].finished, reply[0].drained, reply[0].draining) == (1, 2, True)
    assert long_msgs[-1].WhichOneof("kind") == "error" and long_msgs[-1].error.code == "DRAINING"
    assert 1 < len(long_msgs) - 1 < LONG.max_tokens
    assert [m.error.code for m in wait_call] == ["DRAINING"]
    wait_idle(decode, prefill)
    stats = dstub.Stats(wpb.StatsRequest())
    assert stats.draining and stats.requests_drained == 2 and stats.kv_pages_free == stats.kv_pages_capacity
    assert not dstub.Drain(wpb.DrainRequest(undo=True), timeout=10).draining
    assert not dstub.Health(wpb.HealthRequest()).draining
    assert run(dch, pch, "after", ids, SHORT).finish is not None      # admitted again


def test_a_draining_prefill_worker_refuses_prompts_until_undone(decode, prefill, shipped_llm):
    pch = channel(prefill.address)
    stub = wpb_grpc.PrefillServiceStub(pch)
    ids = shipped_llm.tokenizer.encode("Say hello")
    assert stub.Drain(wpb.DrainRequest(grace_s=0), timeout=10) == wpb.DrainReply(draining=True)
    assert stub.Health(wpb.HealthRequest()).draining and stub.Stats(wpb.StatsRequest()).draining
    r = run(channel(decode.address), pch, "pd", ids, SHORT)
    assert r.error is not None and r.error.code == "DRAINING"
    assert stub.Drain(wpb.DrainRequest(undo=True), timeout=10) == wpb.DrainReply(draining=False)
    assert run(channel(decode.address), pch, "pd2", ids, SHORT).error is None
    wait_idle(decode, prefill)


def test_drain_calls_are_checked(decode):
    stub = wpb_grpc.DecodeServiceStub(channel(decode.address))
    with pytest.raises(grpc.RpcError) as e:
        stub.Drain(wpb.DrainRequest(grace_s=-1), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:        # like every worker RPC: the cluster secret first
        wpb_grpc.DecodeServiceStub(grpc.insecure_channel(decode.address)).Drain(wpb.DrainRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not decode.roles[0].draining


def test_a_colocated_worker_drains_both_roles(shipped_llm):
    worker = start_colocated_worker(config())
    try:
        ch = channel(worker.address)
        stub = wpb_grpc.DecodeServiceStub(ch)
        ids = shipped_llm.tokenizer.encode("The quick brown fox")
        call, _ = _open(ch, "CL", ids, LONG)
        started, msgs = threading.Event(), []
        reader = threading.Thread(target=_read_after_first_token, args=(call, started, msgs), daemon=True)
        reader.start()
        assert started.wait(60)
        reply = stub.Drain(wpb.DrainRequest(grace_s=0), timeout=60)
        reader.join(60)
        assert (reply.finished, reply.drained, reply.draining) == (0, 1, True)
        assert msgs[-1].error.code == "DRAINING"
        assert all(role.draining for role in worker.roles)
        wait_idle(worker)
    finally:
        worker.stop()


class FakeEngine:
    def __init__(self, ids: list[str]):
        self.ids, self.draining, self.counts = list(ids), False, Counter[str]()
        self.ended: list[str] = []

    def start_drain(self) -> None:
        self.draining = True

    def undrain(self) -> None:
        self.draining = False

    def live(self) -> list[str]:
        return list(self.ids)

    def end_live(self, code: ErrorCode, message: str) -> int:
        self.ended += self.ids
        n, self.ids = len(self.ids), []
        return n


def test_a_request_on_two_roles_counts_once_and_an_undone_drain_ends_nothing():
    prefill, dec = FakeEngine(["a"]), FakeEngine(["a", "b"])
    assert drain([prefill, dec], grace_s=0, poll_s=0.001) == DrainResult(finished=0, drained=2)
    assert prefill.ended == ["a"] and dec.ended == ["a", "b"]
    e = FakeEngine(["x"])
    undo = threading.Timer(0.05, e.undrain)
    undo.start()
    assert drain([e], grace_s=30, poll_s=0.01) == DrainResult(finished=0, drained=0)
    assert e.ended == [] and not e.draining


def _wait(cond, timeout_s: float = 30.0) -> bool:
    import time
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False
