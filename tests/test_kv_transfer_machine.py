"""A hypothesis state machine over one receiving pool and several concurrent transfers:
reserve, send (good, corrupt, duplicate, out of range, wrong tag, stale), commit, cancel and
close in any interleaving.  After every step I2-I6 hold and the model of every transfer's
state matches the receiver's."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv_pool import PoolExhausted
from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import State
from tests.kv_helpers import SECRET, copy_header, make_pool, pages_equal, prepare


class TransferMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.src, self.dst = make_pool(64, seed=1), make_pool(24, seed=2)
        self.recv = TransferReceiver(self.dst, SECRET)
        self.live: dict[str, object] = {}       # rid -> Transfer
        self.sent: dict[str, set[int]] = {}     # rid -> indexes of frames accepted
        self.released: list = []                # frames of transfers already released
        self.generations: dict[int, int] = {}
        self.n = 0

    # ---- helpers ---------------------------------------------------------------
    def _pick(self, data, open_only=False):
        rids = sorted(r for r, t in self.live.items() if not open_only or not t.res.terminal)
        return data.draw(st.sampled_from(rids)) if rids else None

    def _refused(self, rid, reason, call, fails=True):
        t = self.live[rid]
        was_open = not t.res.terminal
        before = self.dst.kv.clone()
        try:
            call()
        except TransferRefused as e:
            assert torch.equal(self.dst.kv, before), "a refusal changed pool bytes"
            if was_open and fails:
                assert e.reason == reason, (e.reason, reason)
                assert t.res.state == State.FAILED
            elif not was_open:
                assert e.reason in (Refusal.AFTER_COMMIT, Refusal.AFTER_FAILURE), e.reason
            return
        raise AssertionError(f"expected a refusal ({reason})")

    # ---- rules -------------------------------------------------------------------
    @rule(prompt_len=st.integers(1, 12), tenant=st.sampled_from(["a", "b"]))
    def reserve(self, prompt_len, tenant):
        rid = f"r{self.n}"
        self.n += 1
        try:
            t = prepare(self.src, self.dst, self.recv, rid, prompt_len, tenant=tenant)
        except PoolExhausted:
            if self.src.has(rid):
                self.src.free(rid)
            return
        for p in self.dst.page_table(rid):
            assert self.dst.generation(p) > self.generations.get(p, 0), "I5: generation not bumped"
            self.generations[p] = self.dst.generation(p)
        self.live[rid], self.sent[rid] = t, set()

    @rule(data=st.data())
    def send_good(self, data):
        rid = self._pick(data)
        if rid is None:
            return
        t = self.live[rid]
        i = data.draw(st.integers(0, len(t.frames) - 1))
        if t.res.terminal or i in self.sent[rid]:
            expect = Refusal.DUPLICATE
            self._refused(rid, expect, lambda: self.recv.receive(*t.frames[i]))
        else:
            self.recv.receive(*t.frames[i])
            self.sent[rid].add(i)

    @rule(data=st.data(), kind=st.sampled_from(["corrupt", "range", "tag"]))
    def send_bad(self, data, kind):
        rid = self._pick(data)
        if rid is None:
            return
        t = self.live[rid]
        i = data.draw(st.integers(0, len(t.frames) - 1))
        h, p = t.frames[i]
        if kind == "corrupt":
            bad = bytearray(p)
            bad[-1] ^= 0x80
            reason = Refusal.DUPLICATE if i in self.sent[rid] else Refusal.BAD_CHECKSUM
            call = lambda: self.recv.receive(h, bytes(bad))  # noqa: E731
        elif kind == "range":
            h2 = copy_header(h, page_index=len(t.res.pages))
            call, reason = (lambda: self.recv.receive(h2, p)), Refusal.OUT_OF_RANGE
        else:
            other = self._pick(data)
            h2 = copy_header(self.live[other].frames[0][0], transfer_id=t.res.transfer_id)
            if other == rid:
                h2.ownership_tag = bytes(16)
            call, reason = (lambda: self.recv.receive(h2, self.live[other].frames[0][1])), Refusal.BAD_TAG
        self._refused(rid, reason, call)

    @precondition(lambda self: self.released)
    @rule(data=st.data())
    def send_stale(self, data):
        h, p = data.draw(st.sampled_from(self.released))
        before = self.dst.kv.clone()
        try:
            self.recv.receive(h, p)
            raise AssertionError("a stale frame was accepted")
        except TransferRefused as e:
            assert e.reason == Refusal.EXPIRED
        assert torch.equal(self.dst.kv, before)

    @rule(data=st.data())
    def commit(self, data):
        rid = self._pick(data)
        if rid is None:
            return
        t = self.live[rid]
        complete = len(self.sent[rid]) == len(t.frames)
        if not t.res.terminal and complete:
            assert self.recv.commit(t.commit).state == State.COMMITTED
        else:
            self._refused(rid, Refusal.INCOMPLETE, lambda: self.recv.commit(t.commit))

    @rule(data=st.data())
    def close_stream(self, data):
        rid = self._pick(data)
        if rid is not None:
            before = self.live[rid].res.state
            self.recv.stream_closed(self.live[rid].res.transfer_id)
            if before == State.RECEIVING:
                assert self.live[rid].res.reason == Refusal.STREAM_CLOSED
            else:                  # no frame accepted yet: no stream proved it, nothing fails
                assert self.live[rid].res.state == before

    @rule(data=st.data())
    def release(self, data):
        """The pool owner ends the request (cancel, abort, or decode finished)."""
        rid = self._pick(data)
        if rid is None:
            return
        t = self.live.pop(rid)
        self.sent.pop(rid)
        self.recv.release(t.res.transfer_id)
        assert t.res.writers == 0
        self.dst.free(rid)
        self.src.free(rid)
        self.released.extend(t.frames[:2])

    # ---- invariants ----------------------------------------------------------------
    @invariant()
    def pool_intact(self):
        self.dst.check_integrity()
        used = sum(len(self.dst.page_table(r)) for r in self.live)
        assert self.dst.num_free + used == self.dst.num_pages               # I6

    @invariant()
    def coverage_and_integrity(self):
        for rid, t in self.live.items():
            pages = t.res.pages
            complete = {p for p in range(len(pages)) if t.res.page_complete(p)}
            written = {i for i, ref in enumerate(pages) if self.dst.is_written(ref.page)}
            if t.res.state != State.FAILED:
                assert written == complete                                     # I4
            assert written <= complete
            if t.res.state == State.COMMITTED:
                assert written == set(range(len(pages)))
                assert pages_equal(self.src, self.dst, rid, t.prompt_len)      # I2, I3
            assert t.res.writers == 0

    def teardown(self):
        for rid, t in list(self.live.items()):
            self.recv.release(t.res.transfer_id)
            self.dst.free(rid)
        self.dst.check_integrity()
        assert self.dst.num_free == self.dst.num_pages and self.recv.open_transfers == 0


TransferMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_transfer_machine = TransferMachine.TestCase
