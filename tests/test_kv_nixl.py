"""The NIXL transport's staging rule (kv_transfer/transport/nixl_server.py): a sender writes
one-sided only into a staging ring the receiver registered for its connection, never into the
pool; a frame is verified in the ring and copied into its page by the receiver; a ring is never
freed, so a late write through a stale sender's old descriptors changes no pool page, and one
that hits a frame being received fails that transfer.  Every buffer is bounded.  (The
transport's common behaviour is in test_kv_transports.py's nixl row, its fault points in
test_kv_faults.py and test_kv_nixl_faults.py.)"""

from __future__ import annotations

import time

import pytest
import torch

from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import State
from kv_transfer.sender import TransferSender, TransferTicket
from kv_transfer.transport import TransportConfig, connect
from kv_transfer.transport.nixl_agent import unavailable
from tests.kv_helpers import LAYERS, SECRET, digest_of, make_pool, pages_equal

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
CONFIG = TransportConfig(shm_bytes=1 << 16)


@pytest.fixture
def served(tmp_path):
    from kv_transfer.transport import nixl
    from kv_transfer.transport.nixl_server import NixlTransferServer
    dst = make_pool(48, seed=2)
    recv = TransferReceiver(dst, SECRET, timeout_s=30)
    server = NixlTransferServer(recv, str(tmp_path / "kv.sock"), staging_bytes=1 << 17, max_connections=2)
    registered: list[tuple[int, int]] = []
    register = server.agent.register

    def spy(regions, mem_type, device_id):
        registered.extend(regions)
        return register(regions, mem_type, device_id)
    server.agent.register = spy
    yield server, recv, dst, registered
    nixl.close_channels()
    server.stop()
    dst.check_integrity()
    assert dst.num_free == dst.num_pages, "pages left reserved after the test"


def start(dst, recv, endpoint, rid="a", prompt_len=21, config=CONFIG):
    src = make_pool(48, seed=1)
    src.allocate(rid, src.pages_for(prompt_len))
    dst.allocate(rid, dst.pages_for(prompt_len))
    res = recv.reserve(rid, "acme", prompt_len, digest_of(rid, prompt_len))
    stream = connect(endpoint, res.transfer_id, config, secret=SECRET)
    sender = TransferSender(stream, TransferTicket(res.transfer_id, rid, "acme", res.prompt_digest), SECRET,
                            src, src.page_table(rid), prompt_len)
    return src, res, sender, stream


def end(dst, recv, res, rid="a"):
    recv.release(res.transfer_id)
    dst.free(rid)


def wait_for(cond, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def outside_pool(pool, regions) -> bool:
    lo, hi = pool.kv.data_ptr(), pool.kv.data_ptr() + pool.kv.numel() * pool.kv.element_size()
    return all(addr + n <= lo or addr >= hi for addr, n in regions)


def stale_write(channel, fill: int) -> None:
    """What a stale sender does: write `fill` over the whole ring through the receiver's
    descriptors it kept from `channel` (whose connection may be long closed)."""
    buf = torch.full((channel.size,), fill, dtype=torch.uint8)
    reg = channel.agent.register([(buf.data_ptr(), channel.size)], "DRAM", 0)
    try:
        xfer = channel.agent.write([(buf.data_ptr(), channel.size)], [(channel.remote.base, channel.size)],
                                   "DRAM", 0, "DRAM", 0, channel.peer)
        xfer.wait(time.monotonic() + 5)
        xfer.release()
    finally:
        channel.agent.deregister(reg)


def test_frames_go_through_the_staging_ring_and_no_pool_byte_is_ever_registered(served):
    server, recv, dst, registered = served
    src, res, sender, stream = start(dst, recv, server.endpoint)
    sender.send_layers(0, LAYERS)
    stream.settle(5.0)                        # every frame written, announced and answered
    assert res.state == State.RECEIVING and len(res.frames) == 6
    assert all(dst.is_written(p) for p in dst.page_table("a"))   # verified and copied, as shm:// does
    assert sender.commit(3, -0.25).committed and pages_equal(src, dst, "a", 21)
    assert registered == [(stream._ch.remote.base, CONFIG.shm_bytes)]    # the ring the sender asked for
    assert outside_pool(dst, registered)
    end(dst, recv, res)


def test_a_late_write_after_the_transfer_ended_changes_no_pool_page(served):
    server, recv, dst, _ = served
    src, res, sender, stream = start(dst, recv, server.endpoint)
    sender.send_layers(0, LAYERS)
    assert sender.commit(3, -0.25).committed
    old = stream._ch                          # the stale sender keeps the old remote descriptors
    from kv_transfer.transport import nixl
    nixl.close_channels()                     # the connection ends: its ring is deregistered
    wait_for(lambda: server.rings.in_use == 0)
    end(dst, recv, res)
    dst.allocate("b", 6)                      # the freed pages serve someone else
    before = dst.kv.clone()
    stale_write(old, 0xA5)                    # UCX over cma lets it land: nothing checks the registration
    assert torch.equal(dst.kv, before)        # not one pool byte changed
    ring = server.rings._free[0]              # it landed in the idle ring, which nobody reads
    assert bool((ring[:old.size] == 0xA5).all())
    dst.free("b")


def test_a_late_write_into_a_ring_in_use_fails_that_transfer_and_writes_no_page(served):
    server, recv, dst, _ = served
    src, res, sender, stream = start(dst, recv, server.endpoint)
    sender.send_layers(0, LAYERS)
    assert sender.commit(3, -0.25).committed
    old = stream._ch
    from kv_transfer.transport import nixl
    nixl.close_channels()
    wait_for(lambda: server.rings.in_use == 0)
    end(dst, recv, res)

    class LateWriter:                         # the stale write lands as the next frame is verified
        def before_receive(self, h):
            if h.seq == 2:
                stale_write(old, 0x5A)

        def skip_write(self, h, holds_payload):
            return False
    recv.install_hooks(LateWriter())
    src, res, sender, stream = start(dst, recv, server.endpoint, rid="b")     # the same ring again
    before = dst.kv.clone()
    with pytest.raises(TransferRefused) as e:
        sender.send_layers(0, LAYERS)
        sender.commit(3, -0.25)
    assert e.value.reason in (Refusal.BAD_CHECKSUM, Refusal.AFTER_FAILURE)
    assert res.state == State.FAILED and res.reason == Refusal.BAD_CHECKSUM
    table = dst.page_table("b")
    assert not dst.is_written(table[2]) and torch.equal(dst.kv[:, :, table[2]], before[:, :, table[2]])
    end(dst, recv, res, "b")


def test_bytes_changed_in_the_ring_between_verify_and_copy_fail_the_commit(served):
    server, recv, dst, _ = served
    src, res, sender, stream = start(dst, recv, server.endpoint)

    class Scribbler:                          # a late write between the verify and the copy
        def before_receive(self, h):
            pass

        def skip_write(self, h, holds_payload):
            if h.seq == 5:                    # the last: the others verified and copied
                stale_write(stream._ch, 0x33)
            return False
    recv.install_hooks(Scribbler())
    with pytest.raises(TransferRefused) as e:
        sender.send_layers(0, LAYERS)
        sender.commit(3, -0.25)
    assert e.value.reason == Refusal.RECHECK_FAILED and res.state == State.FAILED
    end(dst, recv, res)


def test_a_cut_connection_fails_the_transfer_and_gives_its_ring_back(served):
    server, recv, dst, _ = served
    src, res, sender, stream = start(dst, recv, server.endpoint)
    sender.send_layers(0, 1)
    stream.settle(5.0)
    assert server.rings.in_use == 1
    stream.close()                            # waits for its writes, then closes
    wait_for(lambda: res.state == State.FAILED)
    assert res.reason == Refusal.STREAM_CLOSED
    wait_for(lambda: server.rings.in_use == 0)
    end(dst, recv, res)


def test_staging_is_bounded_and_says_its_limits(served):
    server, recv, dst, _ = served
    with pytest.raises(TransferRefused, match=r"staging ring of 262144 bytes was asked for; this receiver "
                                              r"gives 65536 to 131072") as e:
        connect(server.endpoint, b"t" * 16, TransportConfig(shm_bytes=1 << 18), secret=SECRET)
    assert e.value.reason == Refusal.TRANSPORT
    held = [connect(server.endpoint, b"t" * 16, CONFIG, secret=SECRET) for _ in range(2)]
    with pytest.raises(TransferRefused, match=r"all 2 NIXL staging rings of 131072 bytes are in use"):
        connect(server.endpoint, b"t" * 16, CONFIG, secret=SECRET)
    with pytest.raises(ValueError, match=r"frame of 65537 bytes exceeds the NIXL staging ring of 65536 bytes"):
        held[0].stage(CONFIG.shm_bytes + 1)
    for stream in held:
        stream.close()
    wait_for(lambda: server.rings.in_use == 0)
    assert server.rings._made == 2            # rings are kept, never freed


def test_a_payload_outside_the_ring_is_refused(served):
    server, recv, dst, _ = served
    from proto import kv_transfer_pb2 as pb
    src, res, sender, stream = start(dst, recv, server.endpoint)
    sender.send_layers(0, 1)
    stream.settle(5.0)
    h = next(iter(res.frames.values())).header
    with pytest.raises(TransferRefused) as e:
        server._receive(memoryview(bytearray(16)), pb.Frame(header=h, payload_offset=8, payload_length=16))
    assert e.value.reason == Refusal.BAD_GEOMETRY and "outside the staging ring of 16 bytes" in e.value.detail
    stream.close()
    end(dst, recv, res)
