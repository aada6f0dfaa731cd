"""A prefill worker pushes only to the deployment's decode workers (worker/peers.py): a Prefill
naming any other endpoint is refused with UNKNOWN_PEER before anything is queued, so holding
the secret is not enough to make prefill sign KV for an endpoint of one's choosing."""

from __future__ import annotations

from engine.params import SamplingParams
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc
from tests.workers import channel, config, module_worker, run, start_decode, wait_idle
from worker.convert import params_to_proto
from worker.peers import KnownPeers

decode = module_worker(start_decode, max_model_len=1024)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_fixed_peers_allow_only_themselves():
    peers = KnownPeers(["grpc://10.0.0.7:5000"])
    assert peers("grpc://10.0.0.7:5000")
    assert not peers("grpc://10.0.0.7:5001") and not peers("") and not peers("local://x")


def test_fetched_peers_are_read_again_on_a_miss_at_most_every_refresh():
    registry, reads, clock = {"grpc://a:1"}, [], Clock()

    def fetch() -> set[str]:
        reads.append(clock.t)
        return set(registry)

    peers = KnownPeers(fetch=fetch, refresh_s=0.5, clock=clock)
    assert peers("grpc://a:1") and reads == [0.0]
    registry.add("grpc://b:2")                    # a decode worker joined
    assert not peers("grpc://b:2")                # read 0 s ago: not read again
    clock.t = 0.6
    assert peers("grpc://b:2") and reads == [0.0, 0.6]
    assert peers("grpc://a:1") and len(reads) == 2   # a hit reads nothing
    clock.t = 0.7
    for _ in range(100):                          # a flood of misses reads at most once per refresh_s
        assert not peers("grpc://evil:9")
    assert len(reads) == 2


def test_a_registry_that_fails_refuses_the_miss_and_is_read_again_later():
    clock, calls = Clock(), []

    def fetch() -> list[str]:
        calls.append(clock.t)
        if len(calls) == 1:
            raise ConnectionError("registry restarting")
        return ["grpc://a:1"]

    peers = KnownPeers(fetch=fetch, refresh_s=0.5, clock=clock)
    assert not peers("grpc://a:1")
    clock.t = 1.0
    assert peers("grpc://a:1") and len(calls) == 2


def test_a_prefill_for_an_unknown_endpoint_is_refused_before_anything_is_queued(decode, shipped_llm):
    from prefill_worker.server import start_prefill_worker
    assert decode.transfer_endpoint is not None
    prefill = start_prefill_worker(config(decode_peers=(decode.transfer_endpoint,)))
    try:
        ids = shipped_llm.tokenizer.encode("def add(a, b):\n    return")
        stub = wpb_grpc.PrefillServiceStub(channel(prefill.address))
        before = (prefill.core.pool.num_free, dict(prefill.counts()))
        for endpoint in ("grpc://127.0.0.1:1", decode.transfer_endpoint + "0", "local://anything", "x" * 5000):
            reply = stub.Prefill(wpb.PrefillRequest(
                request_id="rogue", tenant="acme", prompt_token_ids=ids, params=params_to_proto(SamplingParams(seed=1)),
                decode_endpoint=endpoint, transfer_id=b"t" * 16), timeout=30)
            assert not reply.ok and reply.error.code == "UNKNOWN_PEER", reply
            assert "not a decode worker of this deployment" in reply.error.message
            assert len(reply.error.message) < 400                      # the endpoint is not echoed whole
        after = dict(prefill.counts())
        assert prefill.core.pool.num_free == before[0]
        assert after.get("submitted", 0) == before[1].get("submitted", 0) and after["unknown_peer"] == 4
        # the configured peer still works
        r = run(channel(decode.address), channel(prefill.address), "allowed", ids, SamplingParams(max_tokens=4))
        assert r.error is None and r.finish is not None and len(r.token_ids) == 4
        wait_idle(decode, prefill)
    finally:
        prefill.stop()


def test_a_plain_process_prefill_worker_needs_its_peers():
    import pytest

    from deploy.worker import config_from, parser
    with pytest.raises(ValueError, match="--decode-peer"):
        config_from(parser().parse_args(["--role", "prefill"]))
