"""The NIXL transport's one-sided rules (kv_transfer/one_sided.py): only a transfer's own pages
are registered, and only for a sender that proved its tag; a page written in place is verified
at the commit where it lies and is never marked written before; the registration is dropped
at the commit and before the pages may be freed.  (The transport's common behaviour is in
test_kv_transports.py's nixl row.)"""

from __future__ import annotations

import time

import pytest

from engine.kv_pool import CACHED
from engine.prefix_cache import page_keys
from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import State
from kv_transfer.sender import TransferSender, TransferTicket
from kv_transfer.transport import TransportConfig, connect
from kv_transfer.transport.nixl_agent import unavailable
from proto import kv_transfer_pb2 as pb
from tests.kv_helpers import LAYERS, PAGE, SECRET, digest_of, make_pool, pages_equal, prepare, prompt_ids

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
CONFIG = TransportConfig(shm_bytes=1 << 16)
SALT = b"acme-salt-16byte"


@pytest.fixture
def served(tmp_path):
    from kv_transfer.transport import nixl
    from kv_transfer.transport.nixl_server import NixlTransferServer
    dst = make_pool(48, seed=2)
    recv = TransferReceiver(dst, SECRET, timeout_s=30)
    server = NixlTransferServer(recv, str(tmp_path / "kv.sock"))
    yield server, recv, dst
    nixl.close_channels()
    server.stop()
    dst.check_integrity()
    assert dst.num_free == dst.num_pages, "pages left reserved after the test"


def start(dst, recv, endpoint, rid="a", prompt_len=21, cached_tokens=0, src=None):
    src = src if src is not None else make_pool(48, seed=1)
    src.allocate(rid, src.pages_for(prompt_len))
    if not cached_tokens:
        dst.allocate(rid, dst.pages_for(prompt_len))
    res = recv.reserve(rid, "acme", prompt_len, digest_of(rid, prompt_len), cached_tokens=cached_tokens)
    stream = connect(endpoint, res.transfer_id, CONFIG, secret=SECRET)
    sender = TransferSender(stream, TransferTicket(res.transfer_id, rid, "acme", res.prompt_digest), SECRET,
                            src, src.page_table(rid), prompt_len, cached_tokens=cached_tokens)
    return src, res, sender, stream


def end(dst, recv, res, rid="a"):
    recv.release(res.transfer_id)
    dst.free(rid)


def test_pages_land_in_place_and_are_marked_written_only_once_the_commit_verified(served):
    server, recv, dst = served
    src, res, sender, stream = start(dst, recv, server.endpoint)
    sender.send_layers(0, LAYERS)
    stream.settle(5.0)                        # every frame written and announced, no commit yet
    table = dst.page_table("a")
    assert res.state == State.RECEIVING and len(res.frames) == 6
    assert all(r.in_place for r in res.frames.values())
    assert pages_equal(src, dst, "a", 21)     # the bytes are there ...
    assert not any(dst.is_written(p) for p in table)          # ... but nothing may read them
    exposure = res.exposure
    assert exposure is not None and exposure._reg.live
    assert sender.commit(3, -0.25).committed
    assert not exposure._reg.live             # deregistered before the pages were verified
    assert all(dst.is_written(p) for p in table) and res.state == State.COMMITTED
    end(dst, recv, res)


def test_only_the_transfers_own_pages_are_registered_as_runs(served):
    server, recv, dst = served
    dst.allocate("other", 3)                  # pages 0-2 belong to someone else
    dst.allocate("a", 6)                      # pages 3-8 ...
    dst.free("other")
    prompt_len = 5 * PAGE + 1                 # ... of which the prompt uses 6
    res = recv.reserve("a", "acme", prompt_len, digest_of("a", prompt_len))
    exposure = recv.expose(res.transfer_id, res.tag, server._register)
    kv, item = dst.kv, dst.kv.element_size()
    pages = [ref.page for ref in res.sent_pages]
    want = [(kv[layer, c, pages[0]].data_ptr(), len(pages) * kv.stride(2) * item)
            for layer in range(LAYERS) for c in range(kv.shape[1])]
    assert pages == list(range(pages[0], pages[0] + 6))      # consecutive: one run per (layer, c)
    assert exposure._reg.regions == want
    end(dst, recv, res)
    assert not exposure._reg.live             # released: deregistered


def test_a_cached_prefix_is_never_registered_and_a_frame_aimed_at_it_fails_the_transfer(served):
    server, recv, dst = served
    prompt_len, cached = 3 * PAGE + 2, 2 * PAGE
    keys = page_keys(SALT, prompt_ids("a", prompt_len)[:cached], PAGE)
    dst.allocate_prefixed("earlier", 2, [], SALT)            # an earlier request left 2 pages cached
    dst.mark_written("earlier", dst.page_table("earlier"))
    assert dst.publish("earlier", keys, SALT) == 2
    dst.free("earlier")
    assert dst.allocate_prefixed("a", dst.pages_for(prompt_len), keys, SALT) == 2
    _, res, sender, stream = start(dst, recv, server.endpoint, prompt_len=prompt_len, cached_tokens=cached)
    sender.send_layers(0, LAYERS)
    stream.settle(5.0)
    regions = res.exposure._reg.regions
    for ref in res.pages[:2]:                 # no byte of a cached page is writable
        lo = dst.kv[0, 0, ref.page].data_ptr()
        assert all(not (first <= lo < first + n) for first, n in regions)
    h = pb.FrameHeader()                      # a forged frame for a cached page is refused
    h.CopyFrom(next(iter(res.frames.values())).header)
    h.page_index, h.first_token, h.num_tokens, h.seq = 1, PAGE, PAGE, 99
    h.shape[2] = PAGE
    with pytest.raises(TransferRefused) as e:
        recv.receive_in_place(h)
    assert e.value.reason == Refusal.CACHED_PAGE and res.state == State.FAILED
    assert all(dst.owner(ref.page) == CACHED for ref in res.pages[:2])
    stream.close()
    end(dst, recv, res)


def test_a_wrong_tag_registers_nothing_and_fails_the_transfer(served):
    server, recv, dst = served
    dst.allocate("a", 3)
    res = recv.reserve("a", "acme", 9, digest_of("a", 9))
    made = []
    with pytest.raises(TransferRefused) as e:
        recv.expose(res.transfer_id, bytes(16), lambda r: made.append(r))
    assert e.value.reason == Refusal.BAD_TAG and not made and res.state == State.FAILED
    end(dst, recv, res)


def test_a_frame_of_a_transfer_not_opened_to_writes_is_refused(served):
    server, recv, dst = served
    src = make_pool(48, seed=1)
    t = prepare(src, dst, recv, "a", 9)
    with pytest.raises(TransferRefused) as e:
        recv.receive_in_place(t.frames[0][0])
    assert e.value.reason == Refusal.TRANSPORT and t.res.state == State.FAILED
    end(dst, recv, t.res)


def test_bytes_changed_after_the_write_fail_the_commit_and_nothing_is_marked_written(served):
    server, recv, dst = served
    src, res, sender, stream = start(dst, recv, server.endpoint)
    sender.send_layers(0, LAYERS)
    stream.settle(5.0)
    table = dst.page_table("a")
    dst.kv[1, 0, table[2], 0, 0, 0] += 1      # a write nobody verified (a late or rogue one)
    with pytest.raises(TransferRefused) as e:
        sender.commit(3, -0.25)
    assert e.value.reason == Refusal.BAD_CHECKSUM and res.state == State.FAILED
    assert not any(dst.is_written(p) for p in table)
    assert not res.exposure._reg.live
    end(dst, recv, res)


def test_a_cut_connection_fails_the_transfer_and_release_does_not_wait(served):
    server, recv, dst = served
    src, res, sender, stream = start(dst, recv, server.endpoint)
    sender.send_layers(0, 1)
    stream.settle(5.0)
    stream.close()                            # waits for its writes, then closes
    deadline = time.monotonic() + 5
    while res.state != State.FAILED and time.monotonic() < deadline:
        time.sleep(0.01)
    assert res.state == State.FAILED and res.reason == Refusal.STREAM_CLOSED
    assert res.exposure is not None and res.exposure.quiet(0)
    end(dst, recv, res)
    assert recv.unquiet_exposures == 0
