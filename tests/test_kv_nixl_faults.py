"""The chaos run's transfer faults that once went undetected over NIXL (issue 36's note), over
nixl://: payloads swapped between two live transfers, a frame written after the decode side
gave the request's pages to another request, a prefill bound to another prompt, and a forged
frame for a shared cached page.  Each is refused with its code and no page but the faulted
transfer's own changes (test_kv_faults.py runs the other points over every transport)."""

from __future__ import annotations

import threading

import pytest
import torch

from chaos.sender_faults import FaultInjector
from engine.kv_pool import CACHED
from engine.prefix_cache import page_keys
from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import State
from kv_transfer.sender import TransferSender, TransferTicket
from kv_transfer.transport import connect
from kv_transfer.transport.nixl_agent import unavailable
from tests import kv_helpers
from tests.kv_helpers import LAYERS, PAGE, SECRET, digest_of, end_transfer, make_pool, prompt_ids

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
PROMPT = 18     # 5 pages
SALT = b"acme-salt-16byte"


@pytest.fixture
def cluster(tmp_path):
    from kv_transfer.transport import nixl
    from kv_transfer.transport.nixl_server import NixlTransferServer
    src, dst = make_pool(64, seed=1), make_pool(64, seed=2)
    recv = TransferReceiver(dst, SECRET)
    server = NixlTransferServer(recv, str(tmp_path / "kv.sock"))
    yield src, dst, recv, server
    nixl.close_channels()
    server.stop()
    dst.check_integrity()
    assert dst.num_free == dst.num_pages


def run(sender, first_page: int | None = None) -> TransferRefused | None:
    """Send the pages from `first_page` on (default: the first not cached) and commit; the
    refusal, if any."""
    try:
        start = sender.first_page if first_page is None else first_page
        for index in range(start, sender.pool.pages_for(sender.prompt_len)):
            sender.send_page(index, 0, LAYERS)
        sender.stream.flush()
        sender.commit(3, -0.1)
    except TransferRefused as e:
        return e
    return None


def test_swapped_pages_fail_both_transfers(cluster):
    src, dst, recv, server = cluster
    faults = FaultInjector()
    faults.arm("swap_pages")
    a, sa = kv_helpers.open_transfer(src, dst, recv, server, "a", faults, PROMPT)
    b, sb = kv_helpers.open_transfer(src, dst, recv, server, "b", faults, PROMPT)
    sa.send_page(0, 0, LAYERS)                 # held until a partner comes
    assert run(sb) is not None                 # b's page 0 carries a's bytes
    assert run(sa, 1) is not None              # a's carries b's, sent with a's next frame
    assert a.reason == b.reason == Refusal.BAD_CHECKSUM and faults.fired["swap_pages"] == 2
    for res in (a, b):
        assert not any(dst.is_written(p) for p in dst.page_table(res.request_id)[:1])
    end_transfer(src, dst, recv, a, "a")
    end_transfer(src, dst, recv, b, "b")


def test_a_late_write_after_the_pages_went_to_another_request_changes_none_of_them(cluster):
    src, dst, recv, server = cluster
    faults = FaultInjector()
    faults.arm("late_write", after=1, seconds=0.5)
    res, sender = kv_helpers.open_transfer(src, dst, recv, server, "gone", faults, PROMPT)
    table = dst.page_table("gone")
    taken: dict[str, torch.Tensor] = {}

    def give_up():                             # the client left: the decode side ends the request
        recv.release(res.transfer_id)          # and its pages serve the next one
        dst.free("gone")
        dst.allocate("next", dst.num_free)     # every free page, so those it held too
        taken["pages"] = torch.tensor(dst.page_table("next"))
        taken["kv"] = dst.kv.clone()
    timer = threading.Timer(0.2, give_up)
    timer.start()
    err = run(sender)                          # the frame after the first comes 0.5 s late
    timer.join()
    assert err is not None and err.reason.value in ("EXPIRED", "AFTER_FAILURE", "UNKNOWN_TRANSFER"), err
    assert set(table) <= set(taken["pages"].tolist())   # its pages are now the next request's
    assert torch.equal(dst.kv, taken["kv"])    # and nothing landed in any of them
    assert faults.fired["late_write"] == 1
    dst.free("next")
    src.free("gone")


def test_a_prefill_bound_to_another_prompt_is_refused(cluster):
    src, dst, recv, server = cluster
    faults = FaultInjector()
    faults.bind_prompts(SECRET, lambda rid: prompt_ids(rid, PROMPT))
    faults.arm("misbind")
    res, sender = kv_helpers.open_transfer(src, dst, recv, server, "a", faults, PROMPT)
    before = dst.kv.clone()
    err = run(sender)
    assert err is not None and res.reason == Refusal.PROMPT_MISMATCH and faults.fired["misbind"] == 1
    assert torch.equal(dst.kv, before) and not any(dst.is_written(p) for p in dst.page_table("a"))
    end_transfer(src, dst, recv, res, "a")


def test_a_forged_frame_for_a_cached_page_changes_no_cached_byte(cluster):
    src, dst, recv, server = cluster
    prompt_len, cached = 3 * PAGE + 2, 2 * PAGE
    keys = page_keys(SALT, prompt_ids("a", prompt_len)[:cached], PAGE)
    dst.allocate_prefixed("earlier", 2, [], SALT)            # an earlier request left 2 pages cached
    dst.mark_written("earlier", dst.page_table("earlier"))
    assert dst.publish("earlier", keys, SALT) == 2
    dst.free("earlier")
    assert dst.allocate_prefixed("a", dst.pages_for(prompt_len), keys, SALT) == 2
    src.allocate("a", src.pages_for(prompt_len))
    res = recv.reserve("a", "acme", prompt_len, digest_of("a", prompt_len), cached_tokens=cached)
    faults = FaultInjector()
    faults.arm("poison_cached")
    sender = TransferSender(connect(server.endpoint, res.transfer_id, secret=SECRET),
                            TransferTicket(res.transfer_id, "a", "acme", res.prompt_digest), SECRET, src,
                            src.page_table("a"), prompt_len, hooks=faults, cached_tokens=cached)
    shared = [ref.page for ref in res.pages[:2]]
    before = dst.kv[:, :, shared].clone()
    err = run(sender)
    assert err is not None and res.reason == Refusal.CACHED_PAGE and faults.fired["poison_cached"] == 1
    assert torch.equal(dst.kv[:, :, shared], before) and all(dst.owner(p) == CACHED for p in shared)
    assert res.state == State.FAILED
    end_transfer(src, dst, recv, res, "a")
