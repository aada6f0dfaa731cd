"""Bounded callers (issue 15, part 4): a Generate's timeout is clamped, an Abort must name the
transfer id, the gRPC receiver caps and idles out Push streams, and a bare Hello fails nothing."""

from __future__ import annotations

import threading
import time
from typing import Iterator

import grpc
import pytest

from decode_worker.engine import DecodeEngine
from decode_worker.server import start_decode_worker
from engine.errors import ErrorCode
from engine.params import SamplingParams
from kv_transfer import auth
from kv_transfer.frame import PROTOCOL_VERSION
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import State
from kv_transfer.transport import TransportConfig, framing, grpc_stream
from kv_transfer.transport.grpc_server import GrpcTransferServer
from proto import kv_transfer_pb2 as pb
from proto import kv_transfer_pb2_grpc as pb_grpc
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc
from tests.kv_helpers import LAYERS, SECRET, make_pool, prepare
from tests.workers import channel, config, wait_idle
from worker.config import MAX_REQUEST_TIMEOUT_S
from worker.convert import params_to_proto
from worker.handoff import GenerateOrder
from worker.server import build_core
from worker.types import WorkerError

PARAMS = SamplingParams(max_tokens=8, temperature=0)


def wait_for(cond, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.01)


# ---- (a) a Generate's timeout is clamped ---------------------------------------------
@pytest.fixture(scope="module")
def decode():
    handle = start_decode_worker(config(transfer_timeout_s=1.0, max_model_len=1024))
    yield handle
    handle.stop()


def engine_of(handle) -> DecodeEngine:
    return next(r for r in handle.roles if isinstance(r, DecodeEngine))


def generate(handle, rid: str, ids: list[int], timeout_s: float) -> Iterator[wpb.GenerateResponse]:
    stub = wpb_grpc.DecodeServiceStub(channel(handle.address))
    return stub.Generate(wpb.GenerateRequest(request_id=rid, tenant="acme", prompt_token_ids=ids,
                                             params=params_to_proto(PARAMS), timeout_s=timeout_s), timeout=30)


def test_an_infinite_timeout_is_clamped_to_the_workers_maximum(decode):
    call = generate(decode, "forever", list(range(1, 40)), float("inf"))
    first = next(call)
    assert first.WhichOneof("kind") == "reservation"
    res = engine_of(decode).requests["forever"].reservation
    assert res.timeout_s == MAX_REQUEST_TIMEOUT_S and res.deadline < float("inf")
    call.cancel()
    wait_idle(decode)


def test_a_nan_timeout_is_refused(decode):
    msgs = list(generate(decode, "nan", list(range(1, 40)), float("nan")))
    assert [m.WhichOneof("kind") for m in msgs] == ["error"]
    assert msgs[0].error.code == ErrorCode.INVALID_REQUEST.value
    wait_idle(decode)


def order(rid: str, timeout_s: float) -> GenerateOrder:
    return GenerateOrder(rid, "acme", tuple(range(1, 40)), (), PARAMS, "", timeout_s)


def test_a_clamped_reservation_frees_its_pages_when_the_transfer_times_out():
    core = build_core(config(kv_cache_tokens=1024, max_model_len=1024))
    engine = DecodeEngine(core, SECRET, 30.0, threading.RLock(), threading.Event(), max_timeout_s=0.2)
    dreq = engine.reserve(order("huge", 1e30))
    assert dreq.reservation.timeout_s == 0.2
    assert core.pool.num_free < core.pool.num_pages
    end = time.monotonic() + 10
    while core.pool.num_free != core.pool.num_pages and time.monotonic() < end:
        engine.handle_inbox()             # expires the transfer, then ends the request
        time.sleep(0.02)
    core.pool.check_integrity()
    assert core.pool.num_free == core.pool.num_pages
    assert dreq.done and dreq.reservation.state == State.FAILED
    with pytest.raises(WorkerError) as e:
        engine.reserve(order("zero", 0.0))
    assert e.value.code == ErrorCode.INVALID_REQUEST


# ---- (b) Abort names the transfer id ---------------------------------------------------
def test_abort_needs_the_reservations_transfer_id(decode):
    call = generate(decode, "victim", list(range(1, 40)), 5.0)
    tid = next(call).reservation.transfer_id
    stub = wpb_grpc.DecodeServiceStub(channel(decode.address))
    assert not stub.Abort(wpb.AbortRequest(request_id="victim"), timeout=10).found
    assert not stub.Abort(wpb.AbortRequest(request_id="victim", transfer_id=bytes(len(tid))), timeout=10).found
    assert not stub.Abort(wpb.AbortRequest(request_id="victim", transfer_id=tid[:-1]), timeout=10).found
    res = engine_of(decode).requests["victim"].reservation
    assert res.state == State.RESERVED and not engine_of(decode).requests["victim"].done
    assert stub.Abort(wpb.AbortRequest(request_id="victim", transfer_id=tid), timeout=10).found
    rest = list(call)
    assert rest[-1].error.code == ErrorCode.ABORTED.value
    wait_idle(decode)


# ---- (c), (d) the gRPC receiver --------------------------------------------------------
class Stalled:
    """A raw Push stream: Hello (and any messages given), then nothing until `end()`."""

    def __init__(self, server: GrpcTransferServer, transfer_id: bytes, messages: tuple[bytes, ...] = ()):
        self.gate = threading.Event()
        hello = pb.Hello(versions=[PROTOCOL_VERSION], transfer_id=transfer_id)
        first = [framing.encode(pb.PushMessage(hello=hello)), *messages]
        ch = auth.channel(f"127.0.0.1:{server.port}", SECRET)
        push = ch.stream_unary(grpc_stream.PUSH, request_serializer=None,
                               response_deserializer=pb.PushReply.FromString)
        self.future = push.future(self._messages(first), timeout=30)

    def _messages(self, first: list[bytes]) -> Iterator[bytes]:
        yield from first
        self.gate.wait(30)

    def end(self) -> None:
        self.gate.set()


def frame_message(header: pb.FrameHeader, payload: bytes) -> bytes:
    return framing.encode(pb.PushMessage(frame=pb.Frame(header=header)), [payload])


@pytest.fixture
def served():
    dst = make_pool(48, seed=2)
    recv = TransferReceiver(dst, SECRET, timeout_s=30)
    config = TransportConfig(max_push_streams=2, stream_idle_s=0.5, message_bytes=256)
    server = GrpcTransferServer(recv, config=config, secret=SECRET, max_workers=4)
    yield server, recv, dst
    server.stop()
    for tid in list(recv._live):
        res = recv.release(tid)
        assert res is not None
        dst.free(res.request_id)
    dst.check_integrity()
    assert dst.num_free == dst.num_pages


def test_streams_over_the_cap_are_refused_and_a_handshake_still_answers(served):
    server, recv, dst = served
    server.watch.idle_s = 30.0                     # these streams stall without being cut
    src = make_pool(48, seed=1)
    t = prepare(src, dst, recv, "a", 10)
    stalled = [Stalled(server, t.res.transfer_id) for _ in range(2)]
    try:
        wait_for(lambda: server.watch.live == 2)
        third = Stalled(server, t.res.transfer_id)
        with pytest.raises(grpc.RpcError) as e:
            third.future.result(timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert server.watch.refused == 1
        stub = pb_grpc.KvTransferStub(auth.channel(f"127.0.0.1:{server.port}", SECRET))
        assert stub.Handshake(pb.Hello(versions=[PROTOCOL_VERSION]), timeout=10).version == PROTOCOL_VERSION
    finally:
        for s in stalled:
            s.end()
    for s in stalled:
        assert not s.future.result(timeout=10).ok
    wait_for(lambda: server.watch.live == 0)
    assert t.res.state == State.RESERVED           # they only said Hello: nothing failed
    # another transfer goes through once the stalled streams are gone
    msgs = [frame_message(h, p) for h, p in t.frames] + [framing.encode(pb.PushMessage(commit=t.commit))]
    done = Stalled(server, t.res.transfer_id, tuple(msgs))
    reply = done.future.result(timeout=10)
    assert reply.ok and reply.committed and t.res.state == State.COMMITTED
    src.free("a")


def test_an_idle_stream_is_cut_and_its_transfer_fails(served):
    server, recv, dst = served
    src = make_pool(48, seed=1)
    t = prepare(src, dst, recv, "a", 10, groups=((0, LAYERS),))
    stream = Stalled(server, t.res.transfer_id, (frame_message(*t.frames[0]),))
    try:
        wait_for(lambda: t.res.state == State.FAILED)
        with pytest.raises(grpc.RpcError) as e:
            stream.future.result(timeout=10)
        assert e.value.code() == grpc.StatusCode.CANCELLED
        assert server.watch.cut >= 1 and t.res.reason is not None
        assert t.res.reason.value == "STREAM_CLOSED"
    finally:
        stream.end()
    src.free("a")


def test_a_hello_and_a_close_fail_nothing(served):
    server, recv, dst = served
    src = make_pool(48, seed=1)
    t = prepare(src, dst, recv, "a", 10)
    stream = Stalled(server, t.res.transfer_id)
    stream.end()                                   # Hello, then the stream closes
    reply = stream.future.result(timeout=10)
    assert not reply.ok
    assert t.res.state == State.RESERVED and t.res.reason is None
    assert recv.refused["STREAM_CLOSED"] == 0
    cut = Stalled(server, t.res.transfer_id)       # Hello, then idle until the server cuts it
    try:
        with pytest.raises(grpc.RpcError):
            cut.future.result(timeout=10)
    finally:
        cut.end()
    assert t.res.state == State.RESERVED and recv.open_transfers == 1
    src.free("a")


def test_a_hello_and_a_close_leave_a_receiving_transfer_open(served):
    """Another stream's verified frame moved the transfer on: a stranger's Hello + close
    still fails nothing, because the stranger's stream proved nothing."""
    server, recv, dst = served
    src = make_pool(48, seed=1)
    t = prepare(src, dst, recv, "a", 10)
    recv.receive(*t.frames[0])
    assert t.res.state == State.RECEIVING
    stranger = Stalled(server, t.res.transfer_id)
    stranger.end()
    assert not stranger.future.result(timeout=10).ok
    assert t.res.state == State.RECEIVING
    src.free("a")
