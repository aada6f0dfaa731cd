"""The fault hooks: each named injection point produces the refusal the receiver must
report (or, for reorder and delay, a transfer that still succeeds)."""

from __future__ import annotations

import time

import pytest

from chaos.sender_faults import POINTS, FaultInjector
from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import State
from kv_transfer.transport.grpc_server import GrpcTransferServer
from kv_transfer.transport.local import LocalServer
from kv_transfer.transport.nixl_agent import unavailable
from kv_transfer.transport.shm_server import ShmTransferServer
from tests import kv_helpers
from tests.kv_helpers import LAYERS, SECRET, end_transfer, make_pool, pages_equal

PROMPT = 18     # 5 pages
NO_NIXL = unavailable()


TRANSPORTS = ("local", "shm", "grpc", "nixl")


@pytest.fixture(params=TRANSPORTS)
def cluster(request, tmp_path):
    """A sender's pool, a receiver and its server, over each transport in turn."""
    src, dst = make_pool(64, seed=1), make_pool(64, seed=2)
    recv = TransferReceiver(dst, SECRET)
    if request.param == "local":
        server = LocalServer(recv, f"faults-{id(recv)}")
    elif request.param == "shm":
        server = ShmTransferServer(recv, str(tmp_path / "kv.sock"))
    elif request.param == "grpc":
        server = GrpcTransferServer(recv, secret=SECRET)
    else:
        if NO_NIXL:
            pytest.skip(NO_NIXL)
        from kv_transfer.transport.nixl_server import NixlTransferServer
        server = NixlTransferServer(recv, str(tmp_path / "kv.sock"))
    yield src, dst, recv, server
    server.stop()
    dst.check_integrity()
    assert dst.num_free == dst.num_pages


def open_transfer(src, dst, recv, server, rid, faults):
    return kv_helpers.open_transfer(src, dst, recv, server, rid, faults, PROMPT)


def run(sender) -> TransferRefused | None:
    try:
        sender.send_layers(0, LAYERS)
        sender.commit(3, -0.1)
    except TransferRefused as e:
        return e
    return None


@pytest.mark.parametrize("point, reason", [
    ("corrupt_payload", Refusal.BAD_CHECKSUM),
    ("alter_header", Refusal.BAD_CHECKSUM),
    ("drop", Refusal.INCOMPLETE),
    ("duplicate", Refusal.DUPLICATE),
    ("commit_early", Refusal.INCOMPLETE),
    ("replay_foreign", Refusal.BAD_TAG),
    ("cut", Refusal.STREAM_CLOSED),
    ("reorder", None),
    ("delay", None),
])
def test_each_point_is_caught_with_its_code(cluster, point, reason):
    src, dst, recv, server = cluster
    faults = FaultInjector(seed=1)
    first, sender = open_transfer(src, dst, recv, server, "warm", faults)
    assert run(sender) is None                            # an earlier transfer to replay from
    faults.arm(point, after=0 if point == "commit_early" else 1, seconds=0.05)   # a placeholder: first frame
    res, sender = open_transfer(src, dst, recv, server, "victim", faults)
    err = run(sender)
    assert faults.fired[point] == 1
    if reason is None:
        assert err is None and res.state == State.COMMITTED
        assert pages_equal(src, dst, "victim", PROMPT)
    elif point == "cut" and res.state == State.RESERVED:
        # cut before a batching transport delivered the first frame: no stream proved it owns
        # the transfer, so the reservation's own timeout ends it; nothing was accepted
        assert err is not None and not res.frames and server.endpoint.split(":")[0] != "local"
    else:
        wait_for(lambda: res.state == State.FAILED)     # a cut is seen when the receiver reads it
        assert err is not None and res.reason == reason, (err, res.reason)
        assert recv.refused[reason.value] >= 1
    end_transfer(src, dst, recv, res, "victim")
    end_transfer(src, dst, recv, first, "warm")


def test_a_stale_replay_is_refused_and_spares_the_live_transfer(cluster):
    src, dst, recv, server = cluster
    faults = FaultInjector()
    old, sender = open_transfer(src, dst, recv, server, "old", faults)
    assert run(sender) is None
    end_transfer(src, dst, recv, old, "old")                      # finished and released
    faults.arm("replay_stale")
    res, sender = open_transfer(src, dst, recv, server, "new", faults)
    err = run(sender)
    assert err is not None and err.reason == Refusal.EXPIRED
    assert recv.refused[Refusal.EXPIRED.value] == 1
    end_transfer(src, dst, recv, res, "new")


def wait_for(cond, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)


@pytest.mark.parametrize("cluster", ["local"], indirect=True)     # it counts on refusals per frame
def test_swapped_pages_fail_both_transfers(cluster):
    src, dst, recv, server = cluster
    faults = FaultInjector()
    faults.arm("swap_pages")
    a, sa = open_transfer(src, dst, recv, server, "a", faults)
    b, sb = open_transfer(src, dst, recv, server, "b", faults)
    sa.send_page(0, 0, LAYERS)                            # held until a partner comes
    with pytest.raises(TransferRefused) as e:
        sb.send_page(0, 0, LAYERS)                        # b gets a's bytes ...
    assert e.value.reason == Refusal.BAD_CHECKSUM
    with pytest.raises(TransferRefused) as e:             # ... and a gets b's with its own next frame
        sa.send_page(1, 0, LAYERS)                        # (its own sender: one thread per stream)
    assert a.reason == b.reason == Refusal.BAD_CHECKSUM and faults.fired["swap_pages"] == 2
    assert [p for p, _ in faults.log] == ["swap_pages", "swap_pages"]
    end_transfer(src, dst, recv, a, "a")
    end_transfer(src, dst, recv, b, "b")


def test_arming_checks_its_arguments():
    faults = FaultInjector()
    with pytest.raises(ValueError, match="unknown fault point 'melt'"):
        faults.arm("melt")
    with pytest.raises(ValueError, match="probability=0"):
        faults.arm("drop", probability=0)
    assert set(POINTS) >= {"corrupt_payload", "swap_pages", "replay_stale", "cut"}
