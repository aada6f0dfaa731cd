"""Delta-only KV transfer: when the decode side's prefix cache holds the first pages of a
prompt, only the pages after that boundary travel; the commit counts the cached tokens as
covered, a gap still fails, and no frame may touch a cached page."""

from __future__ import annotations

import re

import pytest
import torch

from engine.kv_pool import CACHED, PagePool
from engine.prefix_cache import max_cached_pages, page_keys
from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import Reservation, State
from kv_transfer.sender import TransferSender, TransferTicket
from kv_transfer.transport import TransportConfig, connect, grpc_stream
from kv_transfer.transport.grpc_server import GrpcTransferServer
from kv_transfer.transport.local import LocalServer
from tests.kv_helpers import (
    DIM,
    HEADS,
    LAYERS,
    PAGE,
    SECRET,
    CaptureStream,
    copy_commit,
    digest_of,
    prompt_ids,
)

PROMPT = 37            # 10 pages of 4 tokens, the last one holding 1
CACHED_TOKENS = 16            # the first 4 pages are the decode side's cached prefix
SALT = b"acme-salt-16byte"


def keys_of(rid: str, prompt_len: int = PROMPT) -> list[bytes]:
    return page_keys(SALT, prompt_ids(rid, prompt_len)[:max_cached_pages(prompt_len, PAGE) * PAGE], PAGE)


def warm(dst: PagePool, rid: str, cached_pages: int, prompt_len: int = PROMPT) -> None:
    """An earlier request with `rid`'s prompt left its first `cached_pages` pages in the cache."""
    dst.allocate_prefixed("earlier", cached_pages, [], SALT)
    dst.mark_written("earlier", dst.page_table("earlier"))
    assert dst.publish("earlier", keys_of(rid, prompt_len)[:cached_pages], SALT) == cached_pages
    dst.free("earlier")


def reserve(dst: PagePool, recv: TransferReceiver, rid: str, cached: int, prompt_len: int = PROMPT) -> Reservation:
    """`rid` admitted with a cached prefix of `cached` tokens (the pool's own: it must match)."""
    if cached:
        warm(dst, rid, cached // PAGE, prompt_len)
    hits = dst.allocate_prefixed(rid, dst.pages_for(prompt_len) + 1, keys_of(rid, prompt_len)[:cached // PAGE], SALT)
    assert hits * PAGE == cached
    return recv.reserve(rid, "acme", prompt_len, digest_of(rid, prompt_len), cached_tokens=cached)


def sender_for(src, res: Reservation, stream, cached_tokens: int, prompt_len: int = PROMPT) -> TransferSender:
    if not src.has(res.request_id):
        src.allocate(res.request_id, src.pages_for(prompt_len))
    ticket = TransferTicket(res.transfer_id, res.request_id, res.tenant, res.prompt_digest)
    return TransferSender(stream, ticket, SECRET, src, src.page_table(res.request_id), prompt_len,
                          cached_tokens=cached_tokens)


def captured(src, res: Reservation, cached_tokens: int, groups=((0, 2), (2, LAYERS))) -> CaptureStream:
    cap = CaptureStream()
    sender = sender_for(src, res, cap, cached_tokens)
    for l0, l1 in groups:
        sender.send_layers(l0, l1)
    sender.commit(first_token_id=5, first_logprob=-0.5)
    return cap


def same_pages(src, dst, rid: str, pages: range, prompt_len: int = PROMPT) -> bool:
    a, b = src.page_table(rid), dst.page_table(rid)
    return all(torch.equal(src.kv[:, :, a[i], :min(PAGE, prompt_len - i * PAGE)],
                           dst.kv[:, :, b[i], :min(PAGE, prompt_len - i * PAGE)]) for i in pages)


def audited_pool(seed: int) -> PagePool:
    """A pool full of random bytes that hashes each page it publishes (check_integrity(contents=True))."""
    pool = PagePool(32, PAGE, LAYERS, HEADS, DIM, torch.float16, audit=True)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


@pytest.fixture
def rig():
    src, dst = audited_pool(seed=1), audited_pool(seed=2)
    failed: list[Reservation] = []
    recv = TransferReceiver(dst, SECRET, timeout_s=30, on_failed=failed.append)
    yield src, dst, recv, failed
    for tid in [r.transfer_id for r in list(recv._live.values())]:
        recv.release(tid)
    for rid in list(dst._tables):
        dst.free(rid)
    dst.check_integrity(contents=True)          # no cached page was written after it was published
    assert dst.num_free == dst.num_pages, "pages left reserved after the test"


# ---- through a real transport ----------------------------------------------------------

@pytest.fixture(params=["local", "grpc"])
def served(request, rig):
    src, dst, recv, failed = rig
    config = TransportConfig() if request.param == "local" else TransportConfig(streams=2, message_bytes=256)
    server = (LocalServer(recv, f"delta-{id(recv)}") if request.param == "local"
              else GrpcTransferServer(recv, config=config, secret=SECRET))
    seen: list[int] = []
    inner = recv.receive

    def spy(h, payload):
        seen.append(h.page_index)
        inner(h, payload)

    recv.receive = spy                     # type: ignore[method-assign]
    yield src, dst, recv, server, config, seen
    server.stop()
    grpc_stream.close_channels()


def test_only_the_pages_past_the_boundary_travel(served):
    src, dst, recv, server, config, seen = served
    res = reserve(dst, recv, "a", CACHED_TOKENS)
    assert (res.cached_tokens, res.first_page) == (CACHED_TOKENS, 4)
    before = dst.kv.clone()
    sender = sender_for(src, res, connect(server.endpoint, res.transfer_id, config, secret=SECRET), res.cached_tokens)
    for l0 in range(LAYERS):
        sender.send_layers(l0, l0 + 1)
    reply = sender.commit(first_token_id=11, first_logprob=-1.5)
    assert reply.ok and reply.committed and reply.frames_accepted == LAYERS * 6
    assert sorted(set(seen)) == list(range(4, 10)) and len(seen) == LAYERS * 6
    assert res.state == State.COMMITTED and recv.accepted_frames == LAYERS * 6
    assert same_pages(src, dst, "a", range(4, 10))
    cached = dst.page_table("a")[:4]
    assert torch.equal(dst.kv[:, :, cached], before[:, :, cached]), "a cached page's bytes changed"


def test_a_full_transfer_still_works_beside_a_delta_one(served):
    src, dst, recv, server, config, seen = served
    res = reserve(dst, recv, "b", 0)
    sender = sender_for(src, res, connect(server.endpoint, res.transfer_id, config, secret=SECRET), 0)
    sender.send_layers(0, LAYERS)
    assert sender.commit(1, 0.0).committed and sorted(set(seen)) == list(range(10))
    assert same_pages(src, dst, "b", range(10))


def test_a_sender_that_ignores_the_boundary_is_refused_cached_page(served):
    src, dst, recv, server, config, seen = served
    res = reserve(dst, recv, "c", CACHED_TOKENS)
    before = dst.kv.clone()
    sender = sender_for(src, res, connect(server.endpoint, res.transfer_id, config, secret=SECRET), 0)
    with pytest.raises(TransferRefused) as e:
        sender.send_layers(0, LAYERS)
        sender.commit(1, 0.0)
    assert e.value.reason in (Refusal.CACHED_PAGE, Refusal.AFTER_FAILURE), e.value
    assert res.state == State.FAILED and res.reason == Refusal.CACHED_PAGE
    assert torch.equal(dst.kv, before) and not res.frames
    dst.check_integrity(contents=True)


# ---- the receiver's checks ---------------------------------------------------------------

def test_a_commit_covering_only_the_delta_passes_and_leaves_the_cached_pages_alone(rig):
    src, dst, recv, failed = rig
    res = reserve(dst, recv, "a", CACHED_TOKENS)
    cap = captured(src, res, res.cached_tokens)
    assert {h.page_index for h, _ in cap.frames} == set(range(4, 10)) and len(cap.frames) == 12
    c = cap.commits[0]
    assert (c.cached_tokens, c.tokens_covered, c.frame_count) == (CACHED_TOKENS, PROMPT, 12)
    before = dst.kv.clone()
    for h, p in cap.frames:
        recv.receive(h, p)
    assert recv.commit(c).state == State.COMMITTED and not failed
    table = dst.page_table("a")
    assert torch.equal(dst.kv[:, :, table[:4]], before[:, :, table[:4]])
    assert same_pages(src, dst, "a", range(4, 10))
    assert [dst.is_written(p) for p in table[4:10]] == [True] * 6
    assert [dst.owner(p) for p in table[:4]] == [CACHED] * 4 and dst.num_cached == 4
    dst.check_integrity(contents=True)


@pytest.mark.parametrize("drop", ["a page", "a layer group"])
def test_a_commit_that_leaves_a_gap_fails(rig, drop):
    src, dst, recv, failed = rig
    res = reserve(dst, recv, "a", CACHED_TOKENS)
    cap = captured(src, res, res.cached_tokens)
    skip = (lambda h: h.page_index == 4) if drop == "a page" else (lambda h: h.page_index == 7 and h.layer_start == 2)
    for h, p in cap.frames:
        if not skip(h):
            recv.receive(h, p)
    with pytest.raises(TransferRefused) as e:
        recv.commit(cap.commits[0])
    assert e.value.reason == Refusal.INCOMPLETE and res.state == State.FAILED and failed == [res]


def test_a_sender_that_starts_past_the_boundary_leaves_a_gap(rig):
    src, dst, recv, _ = rig
    res = reserve(dst, recv, "a", 8)             # the decode side caches 2 pages, prefill skips 3
    cap = captured(src, res, 3 * PAGE)
    for h, p in cap.frames:
        recv.receive(h, p)
    with pytest.raises(TransferRefused) as e:
        recv.commit(cap.commits[0])
    assert e.value.reason == Refusal.INCOMPLETE and "[2]" in e.value.detail


@pytest.mark.parametrize("change", [dict(cached_tokens=0), dict(cached_tokens=12), dict(cached_tokens=20),
                                    dict(tokens_covered=PROMPT - CACHED_TOKENS)])
def test_a_commit_whose_counts_differ_from_the_reservation_is_refused(rig, change):
    src, dst, recv, failed = rig
    res = reserve(dst, recv, "a", CACHED_TOKENS)
    cap = captured(src, res, res.cached_tokens)
    for h, p in cap.frames:
        recv.receive(h, p)
    count = recv.refused[Refusal.BAD_COVERAGE.value]
    with pytest.raises(TransferRefused) as e:
        recv.commit(copy_commit(cap.commits[0], **change))
    assert e.value.reason == Refusal.BAD_COVERAGE and res.state == State.FAILED and failed == [res]
    assert recv.refused[Refusal.BAD_COVERAGE.value] == count + 1


def test_a_frame_aimed_at_a_cached_page_is_refused_and_writes_nothing(rig):
    src, dst, recv, failed = rig
    res = reserve(dst, recv, "a", CACHED_TOKENS)
    full = captured(src, res, 0)                 # genuine frames, tag and checksum valid, for every page
    before = dst.kv.clone()
    h, p = next((h, p) for h, p in full.frames if h.page_index == 3)
    with pytest.raises(TransferRefused) as e:
        recv.receive(h, p)
    assert e.value.reason == Refusal.CACHED_PAGE and "cached prefix page" in e.value.detail
    assert recv.refused[Refusal.CACHED_PAGE.value] == 1
    assert torch.equal(dst.kv, before) and not res.frames and not any(res.layers_done[3])
    assert res.state == State.FAILED and res.reason == Refusal.CACHED_PAGE and failed == [res]
    with pytest.raises(TransferRefused) as e:
        recv.receive(*next((h, p) for h, p in full.frames if h.page_index == 4))
    assert e.value.reason == Refusal.AFTER_FAILURE and torch.equal(dst.kv, before)


@pytest.mark.parametrize("cached, prompt_len, message", [
    (3, PROMPT, "multiple of the page size 4"),
    (-4, PROMPT, "must lie in [0, 37)"),
    (40, PROMPT, "must lie in [0, 37)"),
    (8, 8, "must lie in [0, 8)"),                # the last prompt token is never cached
    (8, PROMPT, "cached_tokens=8, but its first 0 pages (0 tokens) are the pool's cached prefix"),
])
def test_reserve_validates_the_cached_prefix(rig, cached, prompt_len, message):
    _, dst, recv, _ = rig
    dst.allocate("a", dst.pages_for(prompt_len))
    with pytest.raises(ValueError, match=re.escape(message)):
        recv.reserve("a", "acme", prompt_len, digest_of("a", prompt_len), cached_tokens=cached)
    assert recv.open_transfers == 0 and not recv._live


@pytest.mark.parametrize("claimed", [0, 8, 20])
def test_reserve_refuses_a_cached_prefix_other_than_the_pools(rig, claimed):
    _, dst, recv, _ = rig
    warm(dst, "a", 4)
    assert dst.allocate_prefixed("a", 10, keys_of("a")[:4], SALT) == 4
    with pytest.raises(ValueError, match=re.escape(f"cached_tokens={claimed}, but its first 4 pages (16 tokens)")):
        recv.reserve("a", "acme", PROMPT, digest_of("a", PROMPT), cached_tokens=claimed)
    assert not recv._live


def test_the_sender_validates_its_cached_tokens(rig):
    src, dst, recv, _ = rig
    res = reserve(dst, recv, "a", CACHED_TOKENS)
    for bad in (-PAGE, 10 * PAGE, 3):
        with pytest.raises(ValueError, match=r"cached_tokens=-?\d+ must be a multiple of the page size 4 in \[0, 37\)"):
            sender_for(src, res, CaptureStream(), bad)


def test_without_the_cached_page_check_the_page_owner_check_still_refuses(rig, monkeypatch):
    """Defence in depth: a cached page is not the request's own (owner CACHED), so a frame for it
    that got past the boundary check is refused STALE_PAGE before any byte is copied."""
    src, dst, recv, _ = rig
    monkeypatch.setattr(Reservation, "check_uncached", lambda self, h: None)
    res = reserve(dst, recv, "a", CACHED_TOKENS)
    full = captured(src, res, 0)
    before = dst.kv.clone()
    with pytest.raises(TransferRefused) as e:
        recv.receive(*next((h, p) for h, p in full.frames if h.page_index == 0))
    assert e.value.reason == Refusal.STALE_PAGE and torch.equal(dst.kv, before)


def test_a_commit_refuses_a_cached_prefix_page_that_is_no_longer_the_one_reserved(rig):
    """Defence in depth: a pool owner that frees the request before its transfer ends (a bug)
    lets its cached prefix be evicted and reused; the commit finds the page changed and fails."""
    src, dst, recv, failed = rig
    res = reserve(dst, recv, "a", CACHED_TOKENS)
    cap = captured(src, res, res.cached_tokens)
    for h, p in cap.frames:
        recv.receive(h, p)
    dst.free("a")
    dst.allocate("thief", dst.num_free)          # every free page, then every evictable one
    assert dst.evictions >= 4
    with pytest.raises(TransferRefused) as e:
        recv.commit(cap.commits[0])
    page = res.pages[0].page
    assert e.value.reason == Refusal.STALE_PAGE
    assert e.value.detail == (f"page {page} is now (thief, generation {dst.generation(page)}), "
                              f"reserved as (<cached>, generation {res.pages[0].generation})")
    assert res.state == State.FAILED and failed == [res]
