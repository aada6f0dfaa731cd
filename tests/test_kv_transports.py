"""Each transport moves a multi-layer transfer byte-exactly, fails closed on a version
mismatch, carries refusals back to the sender, and fails the transfer when cut."""

from __future__ import annotations

import time

import pytest
import torch

from chaos.sender_faults import FaultInjector
from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.hooks import PLAIN_SENDER
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import State
from kv_transfer.sender import TransferSender, TransferTicket
from kv_transfer.tls import ClusterCA
from kv_transfer.transport import TransportConfig, connect, grpc_stream, shm
from kv_transfer.transport.grpc_server import GrpcTransferServer
from kv_transfer.transport.local import LocalServer
from kv_transfer.transport.nixl_agent import unavailable as nixl_unavailable
from kv_transfer.transport.shm_server import ShmTransferServer
from tests.kv_helpers import LAYERS, SECRET, digest_of, make_pool, pages_equal

KINDS = {
    "local": TransportConfig(),
    "shm": TransportConfig(shm_bytes=1 << 16),            # small ring: it wraps many times
    "grpc": TransportConfig(streams=1, message_bytes=256),       # a message per frame
    "grpc-3-streams": TransportConfig(streams=3, message_bytes=256),
    "grpc-batched": TransportConfig(),                            # the defaults: frames batched
    # mutual TLS, as across nodes: sender and receiver hold certificates of one cluster CA
    "grpc-tls": TransportConfig(streams=2, message_bytes=256, tls=ClusterCA().issue("kv-test")),
    "nixl": TransportConfig(shm_bytes=1 << 16),           # one-sided writes into a small staging ring
}
NO_NIXL = nixl_unavailable()


class Clock:
    """time.monotonic, plus whatever a test adds to jump past a timeout."""

    def __init__(self):
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


@pytest.fixture(params=list(KINDS))
def served(request, tmp_path):
    kind = request.param
    dst = make_pool(48, seed=2)
    recv = TransferReceiver(dst, SECRET, timeout_s=30, clock=Clock())
    if kind == "local":
        server = LocalServer(recv, f"t-{id(recv)}")
    elif kind == "shm":
        server = ShmTransferServer(recv, str(tmp_path / "kv.sock"))
    elif kind == "nixl":
        if NO_NIXL:
            pytest.skip(NO_NIXL)
        from kv_transfer.transport.nixl_server import NixlTransferServer
        server = NixlTransferServer(recv, str(tmp_path / "kv.sock"))
    else:
        server = GrpcTransferServer(recv, config=KINDS[kind], secret=SECRET)
    yield KINDS[kind], server, recv, dst, kind
    server.stop()
    dst.check_integrity()
    assert dst.num_free == dst.num_pages, "pages left reserved after the test"


def start(src, dst, recv, rid, prompt_len, endpoint, config, hooks=PLAIN_SENDER):
    src.allocate(rid, src.pages_for(prompt_len))
    dst.allocate(rid, dst.pages_for(prompt_len) + 2)
    res = recv.reserve(rid, "acme", prompt_len, digest_of(rid, prompt_len))
    stream = connect(endpoint, res.transfer_id, config, secret=SECRET)
    sender = TransferSender(stream, TransferTicket(res.transfer_id, rid, "acme", res.prompt_digest), SECRET, src,
                            src.page_table(rid), prompt_len, hooks=hooks)
    return res, sender, stream


def finish(src, dst, recv, res, rid):
    recv.release(res.transfer_id)
    dst.free(rid)
    src.free(rid)


def wait_for(cond, timeout_s=10.0):
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.01)


def test_a_multi_layer_transfer_arrives_byte_exact(served):
    config, server, recv, dst, kind = served
    src = make_pool(48, seed=1)
    for rid, prompt_len in (("a", 37), ("b", 1), ("c", 64)):
        res, sender, _ = start(src, dst, recv, rid, prompt_len, server.endpoint, config)
        for l0 in range(LAYERS):                       # one layer group at a time, as prefill computes
            sender.send_layers(l0, l0 + 1)
        reply = sender.commit(first_token_id=11, first_logprob=-1.5)
        assert reply.ok and reply.committed and reply.frames_accepted == LAYERS * src.pages_for(prompt_len)
        assert res.state == State.COMMITTED and res.first_token_id == 11
        assert pages_equal(src, dst, rid, prompt_len)
        finish(src, dst, recv, res, rid)


def test_a_version_mismatch_fails_closed(served):
    config, server, recv, dst, kind = served
    with pytest.raises(TransferRefused) as e:
        connect(server.endpoint, b"t" * 16, TransportConfig(versions=(7,), streams=config.streams, tls=config.tls),
                secret=SECRET)
    assert e.value.reason == Refusal.BAD_VERSION


def test_a_refusal_reaches_the_sender_and_nothing_is_written(served):
    config, server, recv, dst, kind = served
    src = make_pool(48, seed=1)
    faults = FaultInjector(seed=0)
    faults.arm("corrupt_payload", after=2)
    res, sender, _ = start(src, dst, recv, "a", 20, server.endpoint, config, faults)
    before = dst.kv.clone()
    with pytest.raises(TransferRefused) as e:
        sender.send_layers(0, LAYERS)
        sender.commit(1, 0.0)
    assert e.value.reason in (Refusal.BAD_CHECKSUM, Refusal.AFTER_FAILURE), e.value
    assert res.state == State.FAILED and res.reason == Refusal.BAD_CHECKSUM
    assert faults.fired["corrupt_payload"] == 1
    table = dst.page_table("a")          # the corrupt frame carried page 2
    assert not dst.is_written(table[2])
    assert torch.equal(dst.kv[:, :, table[2]], before[:, :, table[2]])
    finish(src, dst, recv, res, "a")


def test_a_cut_stream_fails_the_transfer(served):
    config, server, recv, dst, kind = served
    src = make_pool(48, seed=1)
    res, sender, stream = start(src, dst, recv, "a", 20, server.endpoint, config)
    sender.send_layers(0, 1)
    if config.message_bytes <= 256:          # every frame is its own message: it arrives
        wait_for(lambda: res.state == State.RECEIVING)
    stream.close()
    try:
        wait_for(lambda: res.state == State.FAILED, timeout_s=3)
        assert res.reason in (Refusal.STREAM_CLOSED, Refusal.TRANSPORT)
    except AssertionError:
        # Cut before the server read the stream's first message: nothing names the transfer,
        # so the reservation's own timeout ends it (and nothing was written).
        assert res.state == State.RESERVED and not res.frames
        recv._clock.offset = recv.timeout_s
        assert recv.expire() == [res] and res.reason == Refusal.EXPIRED
    finish(src, dst, recv, res, "a")


@pytest.fixture(autouse=True, scope="module")
def _close_cached_channels():
    yield
    grpc_stream.close_channels()
    shm.close_channels()


def test_a_stalled_but_healthy_grpc_receiver_is_not_cut():
    """The receiver reads nothing for longer than several keepalive intervals; the stream,
    backpressured by flow control, must survive and complete."""
    config = TransportConfig(streams=1, message_bytes=1024, queue_messages=1, keepalive_s=0.2,
                             keepalive_timeout_s=0.5, deadline_s=30)
    dst, src = make_pool(48, seed=2), make_pool(48, seed=1)
    recv = TransferReceiver(dst, SECRET)
    stalls = []
    inner = recv.receive

    def slow_receive(h, payload):
        if not stalls:
            stalls.append(h.seq)
            time.sleep(1.5)
        inner(h, payload)

    recv.receive = slow_receive
    server = GrpcTransferServer(recv, config=config, secret=SECRET)
    try:
        res, sender, _ = start(src, dst, recv, "a", 64, server.endpoint, config)
        sender.send_layers(0, LAYERS)
        assert sender.commit(1, 0.0).committed
        assert pages_equal(src, dst, "a", 64) and stalls
        finish(src, dst, recv, res, "a")
    finally:
        server.stop()
