"""Every refusal of the KV transfer receiver: its reason code, the transfer failed, and not
one byte of the receiving pool changed."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.frame import PROTOCOL_VERSION, commit_digest, ownership_tag, prompt_digest
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import State
from tests.kv_helpers import SECRET, copy_commit, copy_header, digest_of, make_pool, pages_equal, prepare

PROMPT = 10            # 3 pages of 4 tokens (4, 4, 2); 2 layer groups -> 6 frames


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def rig():
    src, dst = make_pool(seed=1), make_pool(seed=2)
    clock = Clock()
    failed = []
    recv = TransferReceiver(dst, SECRET, timeout_s=5.0, clock=clock, on_failed=failed.append)
    t = prepare(src, dst, recv, "req-1", PROMPT)
    yield src, dst, recv, t, clock, failed
    recv.release(t.res.transfer_id)
    dst.free("req-1")
    dst.check_integrity()
    assert dst.num_free == dst.num_pages


def refused(recv, dst, reason: Refusal, call) -> TransferRefused:
    before = dst.kv.clone()
    count = recv.refused[reason.value]
    with pytest.raises(TransferRefused) as e:
        call()
    assert e.value.reason == reason, e.value
    assert recv.refused[reason.value] == count + 1
    assert torch.equal(dst.kv, before), "a refused frame changed the pool"
    return e.value


def test_a_good_transfer_commits_and_the_pages_equal_the_senders(rig):
    src, dst, recv, t, _, failed = rig
    assert len(t.frames) == 6
    for h, p in t.frames:
        recv.receive(h, p)
    res = recv.commit(t.commit)
    assert res.state == State.COMMITTED and (res.first_token_id, res.first_logprob) == (7, -0.25)
    assert pages_equal(src, dst, "req-1", PROMPT)
    assert [dst.is_written(p) for p in dst.page_table("req-1")] == [True, True, True, False]
    assert not failed and not recv.refused


def test_frames_in_any_order_are_fine(rig):
    src, dst, recv, t, _, _ = rig
    for h, p in reversed(t.frames):
        recv.receive(h, p)
    assert recv.commit(t.commit).state == State.COMMITTED


@pytest.mark.parametrize("change, reason", [
    (dict(transfer_id=b"\x00" * 16), Refusal.UNKNOWN_TRANSFER),
    (dict(protocol_version=PROTOCOL_VERSION + 1), Refusal.BAD_VERSION),
    (dict(ownership_tag=b"\x01" * 16), Refusal.BAD_TAG),
    (dict(tenant="other-tenant"), Refusal.BAD_TAG),
    (dict(request_id="req-2"), Refusal.BAD_TAG),
    (dict(page_index=3), Refusal.OUT_OF_RANGE),          # a page reserved for decode, not prompt
    (dict(layer_end=4), Refusal.OUT_OF_RANGE),
    (dict(first_token=1), Refusal.BAD_GEOMETRY),
    (dict(num_tokens=3), Refusal.BAD_GEOMETRY),
    (dict(dtype="float16"), Refusal.BAD_GEOMETRY),
    (dict(shape=[2, 2, 4, 2, 4]), Refusal.BAD_GEOMETRY),
    (dict(seq=99), Refusal.BAD_CHECKSUM),                # a field the geometry does not fix
    (dict(prompt_digest=b"\x02" * 32), Refusal.PROMPT_MISMATCH),   # the tag's digest is the reserved one
    (dict(checksum=12345), Refusal.BAD_CHECKSUM),
])
def test_a_bad_header_is_refused_and_fails_the_transfer(rig, change, reason):
    _, dst, recv, t, _, failed = rig
    h, p = t.frames[0]
    refused(recv, dst, reason, lambda: recv.receive(copy_header(h, **change), p))
    if reason != Refusal.UNKNOWN_TRANSFER:
        assert t.res.state == State.FAILED and t.res.reason == reason and failed == [t.res]
        refused(recv, dst, Refusal.AFTER_FAILURE, lambda: recv.receive(*t.frames[1]))
    assert not any(dst.is_written(pg) for pg in dst.page_table("req-1"))


def test_a_flipped_payload_bit_is_refused(rig):
    _, dst, recv, t, _, _ = rig
    h, p = t.frames[2]
    bad = bytearray(p)
    bad[len(bad) // 2] ^= 0x10
    refused(recv, dst, Refusal.BAD_CHECKSUM, lambda: recv.receive(h, bytes(bad)))


def test_a_short_payload_is_refused(rig):
    _, dst, recv, t, _, _ = rig
    h, p = t.frames[0]
    refused(recv, dst, Refusal.BAD_GEOMETRY, lambda: recv.receive(h, p[:-2]))


def test_a_duplicate_frame_is_refused(rig):
    _, dst, recv, t, _, _ = rig
    recv.receive(*t.frames[0])
    refused(recv, dst, Refusal.DUPLICATE, lambda: recv.receive(*t.frames[0]))
    assert t.res.state == State.FAILED


def test_an_overlapping_layer_range_is_a_duplicate(rig):
    src, dst, recv, t, _, _ = rig
    recv.receive(*t.frames[0])                   # page 0, layers [0, 2)
    dst2 = make_pool(seed=3)
    other = prepare(src, dst2, TransferReceiver(dst2, SECRET), "x", PROMPT, groups=((1, 3),))
    h = copy_header(other.frames[0][0], transfer_id=t.res.transfer_id, ownership_tag=t.res.tag,
                    request_id="req-1", prompt_digest=t.res.prompt_digest, seq=50)
    from kv_transfer.frame import frame_checksum
    h.checksum = frame_checksum(h, [other.frames[0][1]])
    refused(recv, dst, Refusal.DUPLICATE, lambda: recv.receive(h, other.frames[0][1]))


def test_frames_after_commit_are_refused(rig):
    _, dst, recv, t, _, _ = rig
    for f in t.frames:
        recv.receive(*f)
    recv.commit(t.commit)
    refused(recv, dst, Refusal.AFTER_COMMIT, lambda: recv.receive(*t.frames[0]))
    refused(recv, dst, Refusal.AFTER_COMMIT, lambda: recv.commit(t.commit))
    assert t.res.state == State.COMMITTED


def test_a_frame_after_release_is_expired_and_writes_nothing(rig):
    _, dst, recv, t, _, failed = rig
    recv.receive(*t.frames[0])
    recv.release(t.res.transfer_id)
    assert t.res.reason == Refusal.CANCELLED and failed == [t.res]
    refused(recv, dst, Refusal.EXPIRED, lambda: recv.receive(*t.frames[1]))


def test_a_reservation_that_receives_nothing_times_out(rig):
    _, dst, recv, t, clock, failed = rig
    clock.t = 4.9
    assert recv.expire() == []
    clock.t = 5.0
    assert recv.expire() == [t.res] and t.res.reason == Refusal.EXPIRED and failed == [t.res]
    refused(recv, dst, Refusal.AFTER_FAILURE, lambda: recv.receive(*t.frames[0]))


def test_a_page_reallocated_under_the_transfer_is_stale(rig):
    _, dst, recv, t, _, _ = rig
    dst.free("req-1")                 # an owner that freed without releasing (a bug)
    dst.allocate("req-1", 4)          # same pages, new generation
    refused(recv, dst, Refusal.STALE_PAGE, lambda: recv.receive(*t.frames[0]))


def test_the_handshake_fails_closed_on_unknown_versions():
    with pytest.raises(TransferRefused) as e:
        TransferReceiver.hello([PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1])   # version 2: no delta commits
    assert e.value.reason == Refusal.BAD_VERSION
    assert TransferReceiver.hello([PROTOCOL_VERSION - 1, PROTOCOL_VERSION]) == PROTOCOL_VERSION


# ---- commit ----------------------------------------------------------------------

def test_commit_with_a_missing_page_is_incomplete(rig):
    _, dst, recv, t, _, _ = rig
    for f in t.frames[:-1]:
        recv.receive(*f)
    refused(recv, dst, Refusal.INCOMPLETE, lambda: recv.commit(t.commit))
    assert t.res.state == State.FAILED


def test_the_placeholder_transfer_is_refused(rig):
    """The incident: one page shipped, then commit; decode must never attend the rest."""
    _, dst, recv, t, _, _ = rig
    recv.receive(*t.frames[0])
    early = copy_commit(t.commit, frame_count=1, digest=commit_digest([t.frames[0][0].checksum]))
    refused(recv, dst, Refusal.INCOMPLETE, lambda: recv.commit(early))


@pytest.mark.parametrize("change, reason", [
    (dict(tokens_covered=PROMPT - 1), Refusal.BAD_COVERAGE),
    (dict(frame_count=5), Refusal.BAD_COVERAGE),
    (dict(digest=1), Refusal.BAD_DIGEST),
    (dict(ownership_tag=b"\x00" * 16), Refusal.BAD_TAG),
    (dict(protocol_version=9), Refusal.BAD_VERSION),
    (dict(prompt_digest=b"\x02" * 32), Refusal.PROMPT_MISMATCH),
])
def test_a_bad_commit_is_refused(rig, change, reason):
    _, dst, recv, t, _, _ = rig
    for f in t.frames:
        recv.receive(*f)
    refused(recv, dst, reason, lambda: recv.commit(copy_commit(t.commit, **change)))
    assert t.res.state == State.FAILED


def test_the_destination_recheck_catches_a_bad_write(rig):
    _, dst, recv, t, _, _ = rig
    for f in t.frames:
        recv.receive(*f)
    page = dst.page_table("req-1")[1]
    dst.kv[2, 1, page, 3, 0, 0] += 1.0          # the write path went wrong after verification
    refused(recv, dst, Refusal.RECHECK_FAILED, lambda: recv.commit(t.commit))


def test_a_page_marked_written_without_data_fails_the_recheck(rig):
    src, dst, recv, t, _, _ = rig
    h, p = t.frames[0]
    page = dst.page_table("req-1")[0]
    recv.receive(h, p)
    for f in t.frames[1:]:
        recv.receive(*f)
    dst.kv[0:2, :, page].copy_(make_pool(seed=9).kv[0:2, :, page])   # data never landed
    refused(recv, dst, Refusal.RECHECK_FAILED, lambda: recv.commit(t.commit))


def test_a_stream_closed_before_commit_fails_the_transfer(rig):
    _, _, recv, t, _, failed = rig
    recv.receive(*t.frames[0])
    recv.stream_closed(t.res.transfer_id)
    assert t.res.reason == Refusal.STREAM_CLOSED and failed == [t.res]
    assert recv.refused[Refusal.STREAM_CLOSED.value] == 1


def test_a_foreign_key_cannot_forge_a_tag():
    src, dst = make_pool(seed=1), make_pool(seed=2)
    recv = TransferReceiver(dst, SECRET)
    t = prepare(src, dst, recv, "r", PROMPT, secret=b"k" * 32)
    refused(recv, dst, Refusal.BAD_TAG, lambda: recv.receive(*t.frames[0]))
    recv.release(t.res.transfer_id)
    dst.free("r")


def test_the_kv_of_another_prompt_of_the_same_length_is_refused_and_writes_nothing():
    """Issue 15: a sender with the right secret, tenant, request id and transfer id, but the
    KV of another prompt of the same length (a Prefill call that names the victim's
    reservation with the attacker's prompt) is refused on its first frame and its commit."""
    src, dst = make_pool(seed=1), make_pool(seed=2)
    failed: list = []
    recv = TransferReceiver(dst, SECRET, on_failed=failed.append)
    other = prompt_digest([7] * PROMPT)
    assert other != digest_of("victim", PROMPT)
    t = prepare(src, dst, recv, "victim", PROMPT, sent_digest=other)
    assert t.frames[0][0].prompt_digest == other and t.commit.prompt_digest == other
    before = [dst.kv[:, :, pg].clone() for pg in dst.page_table("victim")]
    e = refused(recv, dst, Refusal.PROMPT_MISMATCH, lambda: recv.receive(*t.frames[0]))
    assert "another prompt" in e.detail
    assert t.res.state == State.FAILED and t.res.reason == Refusal.PROMPT_MISMATCH and failed == [t.res]
    refused(recv, dst, Refusal.AFTER_FAILURE, lambda: recv.receive(*t.frames[1]))
    refused(recv, dst, Refusal.AFTER_FAILURE, lambda: recv.commit(t.commit))
    assert all(torch.equal(dst.kv[:, :, pg], b) for pg, b in zip(dst.page_table("victim"), before))
    assert not any(dst.is_written(pg) for pg in dst.page_table("victim"))
    assert recv.accepted_frames == 0 and recv.committed == 0
    recv.release(t.res.transfer_id)
    dst.free("victim")


def test_a_commit_for_another_prompt_is_refused():
    """Only the commit names another prompt (its tag keyed over that prompt's digest)."""
    src, dst = make_pool(seed=1), make_pool(seed=2)
    recv = TransferReceiver(dst, SECRET)
    t = prepare(src, dst, recv, "victim", PROMPT)
    other = prompt_digest([7] * PROMPT)
    for f in t.frames:
        recv.receive(*f)
    c = copy_commit(t.commit, prompt_digest=other,
                    ownership_tag=ownership_tag(SECRET, "acme", "victim", t.res.transfer_id, other))
    refused(recv, dst, Refusal.PROMPT_MISMATCH, lambda: recv.commit(c))
    assert t.res.state == State.FAILED and recv.committed == 0
    recv.release(t.res.transfer_id)
    dst.free("victim")


def test_prompt_digest_encoding():
    """SHA-256 over the count (u64 little-endian) and the ids (u32 little-endian)."""
    assert prompt_digest([1, 2]) == hashlib.sha256(struct.pack("<QII", 2, 1, 2)).digest()
    assert prompt_digest([1, 2]) != prompt_digest([2, 1]) != prompt_digest([1, 2, 0])
    assert len(prompt_digest([])) == 32
    with pytest.raises(ValueError, match="must lie in"):
        prompt_digest([-1])


def test_reserve_checks_its_arguments():
    dst = make_pool()
    recv = TransferReceiver(dst, SECRET)
    dst.allocate("r", 2)
    with pytest.raises(ValueError, match="needs 3 pages, it holds 2"):
        recv.reserve("r", "t", 9, digest_of("r", 9))
    with pytest.raises(ValueError, match="prompt digest of 3 bytes"):
        recv.reserve("r", "t", 8, b"abc")
    with pytest.raises(ValueError, match="holds no pages"):
        recv.reserve("nobody", "t", 9, digest_of("nobody", 9))
    with pytest.raises(ValueError, match="at least 16 bytes"):
        TransferReceiver(dst, b"short")
    with pytest.raises(ValueError, match="timeout_s"):
        TransferReceiver(dst, SECRET, timeout_s=0)
    assert recv.open_transfers == 0
    dst.free("r")
