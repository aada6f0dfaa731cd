"""KV page geometry: a pool's rows are [components, heads, dim] (K and V per head, or one MLA
latent row); the transfer frames carry that geometry, a pool of one component round-trips
through a real transport byte-exactly, and a frame of another geometry is refused
(BAD_GEOMETRY, naming expected and got) without a byte of the receiving pool changing."""

from __future__ import annotations

import pytest
import torch

from engine.kv_pool import PagePool
from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.pages import block_nbytes, block_shape
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import State
from kv_transfer.sender import TransferSender, TransferTicket
from kv_transfer.transport import connect
from kv_transfer.transport.local import LocalServer
from tests.kv_helpers import SECRET, digest_of, pages_equal, prepare

LAYERS, PAGE = 3, 4
MLA = (1, 1, 40)              # one latent row per token: kv_lora_rank 32 + rope key 8


def pool(geometry: tuple[int, int, int] = MLA, seed: int = 0, pages: int = 16,
         dtype: torch.dtype = torch.bfloat16) -> PagePool:
    c, h, d = geometry
    p = PagePool(pages, PAGE, LAYERS, h, d, dtype, kv_components=c)
    p.kv.copy_(torch.randn(p.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return p


def test_the_pool_shape_follows_the_geometry():
    p = pool()
    # 16 pages and the scratch page that padding rows of a compiled decode step use
    assert p.kv.shape == (LAYERS, 1, 17, PAGE, 1, 40) and p.geometry == MLA and p.scratch_page == 16
    assert block_shape(p, 0, 2, 3) == (2, 1, 3, 1, 40)
    assert block_nbytes(p, 0, 2, 3) == 2 * 1 * 3 * 1 * 40 * 2
    gqa = pool((2, 2, 8))
    assert gqa.kv.shape == (LAYERS, 2, 17, PAGE, 2, 8) and gqa.geometry == (2, 2, 8)
    with pytest.raises(ValueError, match="kv_components=3"):
        PagePool(4, PAGE, LAYERS, 1, 8, torch.float32, kv_components=3)


def test_audit_hashes_every_component():
    p = PagePool(4, PAGE, 2, 1, 40, torch.float32, audit=True, kv_components=1)
    p.allocate("a", 1)
    p.kv[:, :, p.page_table("a")] = 1.5
    p.mark_written("a", p.page_table("a"))
    p.publish("a", [b"k" * 16], b"salt")
    p.check_integrity(contents=True)
    p.kv[1, 0, p.page_table("a")[0], 3, 0, 39] = 2.5             # a write behind the pool's back
    with pytest.raises(AssertionError, match="written after it was published"):
        p.check_integrity(contents=True)


@pytest.mark.parametrize("prompt_len", [1, 4, 10, 17])
def test_latent_pages_round_trip_through_the_local_transport(prompt_len):
    src, dst = pool(seed=1), pool(seed=2)
    recv = TransferReceiver(dst, SECRET, timeout_s=30)
    server = LocalServer(recv, f"geometry-{id(recv)}")
    try:
        rid = "mla"
        src.allocate(rid, src.pages_for(prompt_len))
        dst.allocate(rid, dst.pages_for(prompt_len) + 1)
        res = recv.reserve(rid, "acme", prompt_len, digest_of(rid, prompt_len))
        sender = TransferSender(connect(server.endpoint, res.transfer_id, secret=SECRET),
                                TransferTicket(res.transfer_id, rid, "acme", res.prompt_digest), SECRET,
                                src, src.page_table(rid), prompt_len)
        sender.send_layers(0, 1)
        sender.send_layers(1, LAYERS)
        reply = sender.commit(first_token_id=5, first_logprob=-0.5)
        assert reply.ok and reply.committed
        assert res.state == State.COMMITTED
        assert pages_equal(src, dst, rid, prompt_len)
        recv.release(res.transfer_id)
    finally:
        server.stop()
    dst.free(rid)
    dst.check_integrity()
    assert dst.num_free == dst.num_pages


def test_captured_latent_frames_state_the_geometry():
    src, dst = pool(seed=1), pool(seed=2)
    recv = TransferReceiver(dst, SECRET)
    t = prepare(src, dst, recv, "r", 10, groups=((0, 2), (2, LAYERS)))
    shapes = {tuple(h.shape) for h, _ in t.frames}
    assert shapes == {(2, 1, 4, 1, 40), (2, 1, 2, 1, 40), (1, 1, 4, 1, 40), (1, 1, 2, 1, 40)}
    for h, payload in t.frames:
        recv.receive(h, payload)
    assert recv.commit(t.commit).state == State.COMMITTED
    assert pages_equal(src, dst, "r", 10)


@pytest.mark.parametrize("sent, got", [
    ((2, 1, 20), "shape=[2, 2, 4, 1, 20] (expected [2, 1, 4, 1, 40])"),   # K+V, same bytes per token
    ((2, 1, 40), "shape=[2, 2, 4, 1, 40] (expected [2, 1, 4, 1, 40])"),   # K+V of the latent's width
    ((1, 1, 48), "shape=[2, 1, 4, 1, 48] (expected [2, 1, 4, 1, 40])"),   # another latent width
    ((1, 2, 40), "shape=[2, 1, 4, 2, 40] (expected [2, 1, 4, 1, 40])"),   # two heads
])
def test_a_frame_of_another_geometry_is_refused_and_nothing_stays_reserved(sent, got):
    src, dst = pool(sent, seed=1), pool(seed=2)
    failed = []
    recv = TransferReceiver(dst, SECRET, on_failed=failed.append)
    t = prepare(src, dst, recv, "r", 10, groups=((0, 2), (2, LAYERS)))
    before = dst.kv.clone()
    with pytest.raises(TransferRefused) as e:
        recv.receive(*t.frames[0])
    assert e.value.reason == Refusal.BAD_GEOMETRY
    assert got in e.value.detail and "1 components, tokens, 1 heads, 40 dims" in e.value.detail
    assert torch.equal(dst.kv, before), "a refused frame changed the pool"
    assert t.res.state == State.FAILED and failed == [t.res]
    assert recv.open_transfers == 0
    assert not any(dst.is_written(p) for p in dst.page_table("r"))
    recv.release(t.res.transfer_id)
    dst.free("r")
    dst.check_integrity()
    assert dst.num_free == dst.num_pages


def test_a_gqa_frame_sent_to_a_latent_pool_through_a_transport_reaches_the_sender_refused():
    src, dst = pool((2, 1, 20), seed=1), pool(seed=2)
    recv = TransferReceiver(dst, SECRET, timeout_s=30)
    server = LocalServer(recv, f"geometry-bad-{id(recv)}")
    try:
        src.allocate("r", 3)
        dst.allocate("r", 3)
        res = recv.reserve("r", "acme", 10, digest_of("r", 10))
        sender = TransferSender(connect(server.endpoint, res.transfer_id, secret=SECRET),
                                TransferTicket(res.transfer_id, "r", "acme", res.prompt_digest), SECRET,
                                src, src.page_table("r"), 10)
        before = dst.kv.clone()
        with pytest.raises(TransferRefused) as e:
            sender.send_layers(0, LAYERS)
            sender.commit(1, 0.0)
        assert e.value.reason in (Refusal.BAD_GEOMETRY, Refusal.AFTER_FAILURE), e.value
        assert res.state == State.FAILED and res.reason == Refusal.BAD_GEOMETRY
        assert torch.equal(dst.kv, before)
        recv.release(res.transfer_id)
    finally:
        server.stop()
    dst.free("r")
    assert dst.num_free == dst.num_pages
