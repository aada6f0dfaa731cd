"""Every worker RPC proves knowledge of the cluster secret (I9): a call without credentials,
with credentials made with another secret, with a replayed nonce or with a stale timestamp is
refused with UNAUTHENTICATED before anything changes; the refusal is counted."""

from __future__ import annotations

import time

import grpc
import pytest

from engine.params import SamplingParams
from kv_transfer import auth
from kv_transfer.frame import PROTOCOL_VERSION
from proto import kv_transfer_pb2 as kpb
from proto import worker_pb2 as wpb
from tests.workers import SECRET, channel, module_worker, start_decode, start_prefill, wait_idle
from worker.convert import params_to_proto

OTHER = b"another-cluster-secret-012345678"
DECODE, PREFILL, KV = "/tandem.worker.DecodeService/", "/tandem.worker.PrefillService/", "/tandem.kv.KvTransfer/"


decode = module_worker(start_decode, max_model_len=1024)
prefill = module_worker(start_prefill)


def gen_request(rid: str = "auth") -> wpb.GenerateRequest:
    return wpb.GenerateRequest(request_id=rid, tenant="acme", prompt_token_ids=[1, 2, 3],
                               params=params_to_proto(SamplingParams(max_tokens=4)))


CALLS = {   # method -> (service, kind, request, response type)
    "Generate": (DECODE, "unary_stream", gen_request(), wpb.GenerateResponse),
    "Abort": (DECODE, "unary_unary", wpb.AbortRequest(request_id="auth"), wpb.AbortReply),
    "Health": (DECODE, "unary_unary", wpb.HealthRequest(), wpb.HealthReply),
    "Stats": (DECODE, "unary_unary", wpb.StatsRequest(), wpb.StatsReply),
    "Prefill": (PREFILL, "unary_unary", wpb.PrefillRequest(request_id="auth", tenant="acme", prompt_token_ids=[1, 2],
                                                           params=params_to_proto(SamplingParams()),
                                                           decode_endpoint="grpc://127.0.0.1:1",
                                                           transfer_id=b"t" * 16), wpb.PrefillReply),
    "PrefillHealth": (PREFILL, "unary_unary", wpb.HealthRequest(), wpb.HealthReply),
}


def forged(method: str) -> dict[str, list[tuple[str, str]] | None]:
    """Each way of failing to prove the secret, as the metadata a call carries."""
    key, now = auth.rpc_key(SECRET), int(time.time() * 1000)
    return {
        "none": None,
        "wrong secret": auth.credentials(auth.rpc_key(OTHER), method),
        "stale": auth.credentials(key, method, now_ms=now - 120_000),
        "future": auth.credentials(key, method, now_ms=now + 120_000),
        "other method": auth.credentials(key, method + "x"),
        "garbled": [(auth.TS_KEY, "x"), (auth.NONCE_KEY, "n"), (auth.MAC_KEY, "m")],
    }


def call(address: str, method: str, kind: str, request, response, metadata):
    ch = grpc.insecure_channel(address)
    try:
        rpc = getattr(ch, kind)(method, request_serializer=type(request).SerializeToString,
                                response_deserializer=response.FromString)
        got = rpc(request, metadata=metadata, timeout=30)
        return list(got) if kind == "unary_stream" else got
    finally:
        ch.close()


def snapshot(*handles) -> list:
    return [(h.core.pool.num_free, dict(h.counts()) | {"unauthenticated": 0},
             h.receiver.open_transfers if h.receiver else None) for h in handles]


@pytest.mark.parametrize("name", list(CALLS))
def test_a_call_that_does_not_prove_the_secret_is_refused_before_anything_changes(decode, prefill, name):
    service, kind, request, response = CALLS[name]
    method = service + name.removeprefix("Prefill") if name == "PrefillHealth" else service + name
    handle = prefill if service == PREFILL else decode
    before, refused = snapshot(decode, prefill), handle.counts()["unauthenticated"]
    for why, metadata in forged(method).items():
        with pytest.raises(grpc.RpcError) as e:
            call(handle.address, method, kind, request, response, metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (why, e.value)
    assert snapshot(decode, prefill) == before
    assert handle.counts()["unauthenticated"] == refused + len(forged(method))


def test_a_replayed_credential_is_refused(decode):
    method = DECODE + "Health"
    creds = auth.credentials(auth.rpc_key(SECRET), method)
    assert call(decode.address, method, "unary_unary", wpb.HealthRequest(), wpb.HealthReply, creds).ready
    refused = decode.counts()["unauthenticated"]
    with pytest.raises(grpc.RpcError) as e:
        call(decode.address, method, "unary_unary", wpb.HealthRequest(), wpb.HealthReply, creds)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "replayed" in (e.value.details() or "")
    assert decode.counts()["unauthenticated"] == refused + 1


def test_refusals_are_counted_in_stats(decode, prefill):
    with pytest.raises(grpc.RpcError):
        call(prefill.address, PREFILL + "Stats", "unary_unary", wpb.StatsRequest(), wpb.StatsReply, None)
    for handle, service in ((decode, DECODE), (prefill, PREFILL)):
        stats = call(handle.address, service + "Stats", "unary_unary", wpb.StatsRequest(), wpb.StatsReply,
                     auth.credentials(auth.rpc_key(SECRET), service + "Stats"))
        assert stats.rpc_unauthenticated == handle.counts()["unauthenticated"] > 0


def test_the_transfer_service_refuses_a_stream_without_credentials(decode):
    """A reservation is open on the decode worker; Handshake and Push to its transfer server
    without valid credentials are refused and leave the reservation as it was."""
    stream = channel(decode.address).unary_stream(
        DECODE + "Generate", request_serializer=wpb.GenerateRequest.SerializeToString,
        response_deserializer=wpb.GenerateResponse.FromString)(gen_request("kv-auth"), timeout=60)
    reservation = next(stream).reservation
    tid, target = reservation.transfer_id, reservation.transfer_endpoint.removeprefix("grpc://")
    state, free = decode.receiver.get(tid).state, decode.core.pool.num_free
    refused = decode.counts()["unauthenticated"]
    ch = grpc.insecure_channel(target)
    hello = kpb.Hello(versions=[PROTOCOL_VERSION], sender="forger", streams=1, transfer_id=tid)
    handshake = ch.unary_unary(KV + "Handshake", request_serializer=kpb.Hello.SerializeToString,
                               response_deserializer=kpb.HelloReply.FromString)
    push = ch.stream_unary(KV + "Push", request_serializer=kpb.PushMessage.SerializeToString,
                           response_deserializer=kpb.PushReply.FromString)
    try:
        for why, metadata in forged(KV + "Handshake").items():
            with pytest.raises(grpc.RpcError) as e:
                handshake(hello, metadata=metadata, timeout=30)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, why
        for why, metadata in forged(KV + "Push").items():
            with pytest.raises(grpc.RpcError) as e:
                push(iter([kpb.PushMessage(hello=hello)]), metadata=metadata, timeout=30)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, why
        assert decode.receiver.get(tid).state == state and decode.core.pool.num_free == free
        assert decode.counts()["unauthenticated"] == refused + 2 * len(forged(KV))
        # the same calls with credentials reach the receiver
        assert handshake(hello, timeout=30, metadata=auth.credentials(auth.rpc_key(SECRET), KV + "Handshake")).version
    finally:
        ch.close()
        stream.cancel()
    wait_idle(decode)


def test_the_replay_window_is_bounded():
    v = auth.Verifier(SECRET, skew_s=30, cap=4)
    key = auth.rpc_key(SECRET)
    for _ in range(10):
        assert v.check("/m", auth.credentials(key, "/m")) is None
    assert len(v._seen) <= 4 and v.refused == 0


def test_tandem_status_reads_stats_through_each_workers_actor():
    """`tandem status` runs where the cluster secret is not: each worker's actor makes the
    authenticated Stats call for it; a direct call without credentials is refused."""
    import ray

    from deploy import registry as reg
    from deploy.launcher import Deployment
    from deploy.settings import ServeSettings
    from deploy.status import read_stats
    from engine.options import build

    settings = build(ServeSettings, colocated=True, port=0, worker_host="127.0.0.1", kv_cache_tokens=4096,
                     max_model_len=512, log_level="error")
    d = Deployment(settings, say=lambda _: None).start(timeout_s=180)
    try:
        entries = ray.get(reg.lookup().workers.remote())
        assert entries
        for w in entries:
            report = read_stats(w)
            assert report["health"] == "ok" and report["kv_tokens_capacity"] >= 4096, report
            with pytest.raises(grpc.RpcError) as e:
                call(w["address"], DECODE + "Stats", "unary_unary", wpb.StatsRequest(), wpb.StatsReply, None)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        d.stop()


def test_the_gateway_authenticates_and_exports_the_refusals(decode, prefill):
    from tests.gateway_helpers import get, post, start_gateway

    with pytest.raises(grpc.RpcError):
        call(decode.address, DECODE + "Health", "unary_unary", wpb.HealthRequest(), wpb.HealthReply, None)
    gw = start_gateway(decode=[decode.address], prefill=[prefill.address])
    try:
        status, body = post(gw.url, "/v1/completions", {"model": "tiny-moe", "prompt": "x", "max_tokens": 2})
        assert status == 200, body
        want = f'tandem_worker_rpc_unauthenticated{{role="decode",worker="{decode.address}"}} ' \
               f'{float(decode.counts()["unauthenticated"])}'
        end = time.monotonic() + 10
        while want not in (text := get(gw.url, "/metrics", key=None)[1]) and time.monotonic() < end:
            time.sleep(0.1)
        assert want in text
    finally:
        gw.stop()
    wait_idle(decode, prefill)
