"""The chaos suite's parts on their own: the receiver-side injectors against a real receiver,
the expert guard, the sender's one-fault-per-transfer log, and the accounting that matches
injections with refusals."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from chaos.injectors import ReceiverFaults, corrupt_expert
from chaos.judges import match
from chaos.ledger import Ledger, Logged
from chaos.report import ScenarioResult
from chaos.scenarios import SCENARIOS, select, split
from chaos.sender_faults import FaultInjector
from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.hooks import PLAIN_SENDER
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import State
from kv_transfer.sender import TransferSender, TransferTicket
from kv_transfer.transport import connect
from kv_transfer.transport.local import LocalServer
from tests.kv_helpers import LAYERS, SECRET, digest_of, make_pool, pages_equal, prompt_ids
from tests.test_paged_experts import small_layer

PROMPT = 10     # 3 pages of 4


def transfer(src, dst, recv, server, rid, hooks=PLAIN_SENDER):
    src.allocate(rid, src.pages_for(PROMPT))
    dst.allocate(rid, dst.pages_for(PROMPT))
    res = recv.reserve(rid, "acme", PROMPT, digest_of(rid, PROMPT))
    ticket = TransferTicket(res.transfer_id, rid, "acme", res.prompt_digest)
    sender = TransferSender(connect(server.endpoint, res.transfer_id), ticket,
                            SECRET, src, src.page_table(rid), PROMPT, hooks=hooks)
    try:
        sender.send_layers(0, LAYERS)
        sender.commit(1, -0.5)
        err = None
    except TransferRefused as e:
        err = e
    return res, err


@pytest.fixture
def pools():
    src, dst = make_pool(32, seed=1), make_pool(32, seed=2)
    faults = ReceiverFaults(seed=3)
    recv = TransferReceiver(dst, SECRET)
    recv.install_hooks(faults)
    server = LocalServer(recv, f"chaos-{id(recv)}")
    yield src, dst, recv, server, faults
    server.stop()


def test_a_page_marked_written_without_its_bytes_fails_the_recheck(pools):
    src, dst, recv, server, faults = pools
    faults.arm("unwritten_page", times=1)
    res, err = transfer(src, dst, recv, server, "victim")
    assert err is not None and err.reason == Refusal.RECHECK_FAILED
    assert res.state == State.FAILED and faults.fired["unwritten_page"] == 1
    assert list(recv.refusal_log) == [(res.transfer_id.hex(), "RECHECK_FAILED")]
    assert list(faults.log) == [("unwritten_page", res.transfer_id.hex())]
    res2, err2 = transfer(src, dst, recv, server, "next")     # fired once: the next one is clean
    assert err2 is None and pages_equal(src, dst, "next", PROMPT)


def test_an_unwritten_page_is_not_injected_where_the_page_already_holds_the_bytes(pools):
    """A page reused from an earlier request with the same prompt (with the prefix cache: another
    tenant's, evicted) may already hold exactly the frame's bytes: skipping that copy changes
    nothing, so the point does not fire there (the run would count an injection that no check
    can find); it fires on the next transfer, whose pages hold other bytes."""
    src, dst, recv, server, faults = pools
    faults.arm("unwritten_page", times=1)
    src.allocate("same", src.pages_for(PROMPT))
    dst.allocate("same", dst.pages_for(PROMPT))
    for s_page, d_page in zip(src.page_table("same"), dst.page_table("same")):
        dst.kv[:, :, d_page] = src.kv[:, :, s_page]             # stale bytes equal to the new ones
    res = recv.reserve("same", "acme", PROMPT, digest_of("same", PROMPT))
    sender = TransferSender(connect(server.endpoint, res.transfer_id),
                            TransferTicket(res.transfer_id, "same", "acme", res.prompt_digest),
                            SECRET, src, src.page_table("same"), PROMPT)
    sender.send_layers(0, LAYERS)
    sender.commit(1, -0.5)
    assert res.state == State.COMMITTED and faults.fired["unwritten_page"] == 0
    res2, err2 = transfer(src, dst, recv, server, "other")
    assert err2 is not None and err2.reason == Refusal.RECHECK_FAILED and faults.fired["unwritten_page"] == 1


def test_a_stalled_receiver_still_commits(pools):
    src, dst, recv, server, faults = pools
    faults.arm("stall", times=1, seconds=0.05)
    res, err = transfer(src, dst, recv, server, "slow")
    assert err is None and res.state == State.COMMITTED and faults.fired["stall"] == 1
    assert pages_equal(src, dst, "slow", PROMPT)


def test_receiver_faults_refuse_bad_arguments():
    with pytest.raises(ValueError, match="unknown receiver fault 'drop'"):
        ReceiverFaults().arm("drop")
    with pytest.raises(ValueError, match="probability=0"):
        ReceiverFaults().arm("stall", probability=0)


def test_the_sender_faults_a_transfer_once_and_logs_its_victim(pools):
    src, dst, recv, server, _ = pools
    faults = FaultInjector(seed=1)
    faults.arm("corrupt_payload", times=5)
    res, err = transfer(src, dst, recv, server, "once", faults)
    assert err.reason == Refusal.BAD_CHECKSUM
    assert faults.fired["corrupt_payload"] == 1                # one per transfer, though 5 were armed
    assert list(faults.log) == [("corrupt_payload", res.transfer_id.hex())]


def test_a_misbound_push_states_another_prompt_and_is_refused_for_it(pools):
    src, dst, recv, server, _ = pools
    faults = FaultInjector(seed=1)
    faults.arm("misbind", times=1)
    res, err = transfer(src, dst, recv, server, "plain", faults)
    assert err is None and faults.fired["misbind"] == 0        # without the secret it never fires
    faults.bind_prompts(SECRET, lambda rid: prompt_ids(rid, PROMPT))
    res, err = transfer(src, dst, recv, server, "victim", faults)
    assert err is not None and err.reason == Refusal.PROMPT_MISMATCH   # the tag held: only the digest differs
    assert res.state == State.FAILED and list(faults.log) == [("misbind", res.transfer_id.hex())]
    assert (res.transfer_id.hex(), "PROMPT_MISMATCH") in list(recv.refusal_log)


def test_expert_guard_repairs_a_corrupted_slot_before_use():
    layer, _ = small_layer(k=3)
    slots = layer.slots
    slots.verify_on_use = True
    ids = torch.tensor([[0], [1], [2]])
    x = torch.randn(3, 4)
    want = layer(x, ids)
    where = corrupt_expert(type("L", (), {"paged_experts": lambda self: {0: layer}})(), random.Random(0))
    assert where is not None and where[0] == 0
    assert torch.equal(layer(x, ids), want)                    # repaired before the step read it
    assert slots.counters.corrupt_slots == 1
    slots.verify_on_use = False
    corrupt_expert(type("L", (), {"paged_experts": lambda self: {0: layer}})(), random.Random(1))
    assert not torch.equal(layer(x, ids), want)                 # without the guard it would leak out
    assert slots.verify(range(3)) and slots.counters.corrupt_slots == 2


def test_matching_counts_each_refusal_once_and_names_the_misses():
    res = ScenarioResult("x", "transfer", "")
    match(res, "drop", ["aa", "aa", "bb"], [("aa", "INCOMPLETE"), ("aa", "AFTER_FAILURE"), ("cc", "INCOMPLETE")],
           ("INCOMPLETE",))
    assert (res.faults_injected, res.faults_detected) == (3, 1)
    assert len(res.violations) == 2 and "bb" in res.violations[1] and "AFTER_FAILURE" in res.violations[0]


def test_what_was_logged_starts_from_zero_for_a_restarted_worker():
    raw = {"pid": 1, "page_size": 16, "injected": [("x", "a")], "refusals": [("a", "R")], "failures": [],
           "corrupt_slots": 2, "accepted_bytes": 10, "counts": {"reserved": 3}}
    before = {"d": Ledger.read(raw)}
    same = {"d": Ledger.read({**raw, "injected": [("x", "a"), ("y", "b")], "accepted_bytes": 15, "corrupt_slots": 3})}
    restarted = {"d": replace(same["d"], pid=2)}
    assert Logged.between(before, same).injected == [("y", "b")] and Logged.between(before, same).victims("y") == ["b"]
    assert Logged.between(before, same).accepted_bytes == 5 and Logged.between(before, same).corrupt_slots == 1
    assert Logged.between(before, restarted).injected == [("x", "a"), ("y", "b")]
    assert Logged.between(before, restarted).reserved == 3
    prefill = Ledger.read({"pid": 4, "page_size": 16, "injected": [], "corrupt_slots": 0, "counts": {"submitted": 2}})
    assert (prefill.refusals, prefill.accepted_bytes) == ((), 0)       # no receiver: nothing refused
    assert (before["d"].pid, before["d"].page_size) == (1, 16)
    assert Logged.between({}, {"p": prefill}).submitted == 2


def test_scenario_selection_and_split():
    assert [s.name for s in select("all")] == [s.name for s in SCENARIOS]
    with pytest.raises(ValueError, match="unknown scenario.*nope"):
        select("flipped_bit,nope")
    counts = split(2000, list(SCENARIOS))
    assert min(counts) >= 2 and sum(counts) == 2000
    assert len({s.name for s in SCENARIOS}) == len(SCENARIOS) == 33


def test_the_oracles_catch_wrong_tokens_and_foreign_canaries():
    from chaos.client import Outcome
    from chaos.oracle import judge
    from chaos.prompts import Job

    class Ref:
        def tokens(self, ids, max_tokens):
            return [7, 8, 9][len(ids) - 2:]

        def logprobs(self, ids, max_tokens):
            return [{7: -0.1, 6: -2.0}, {8: -0.1, 6: -2.0}, {9: -0.1, 6: -2.0}][len(ids) - 2:]

        def text(self, ids, max_tokens):
            return "seven eight nine"
    jobs = [Job(i, "x", "acme", f"canary {i:010x}", [1, 2], 3) for i in range(5)]
    outs = [Outcome(jobs[0], "ok", token_ids=[7, 8, 9], text="fine canary 0000000000"),   # its own canary
            Outcome(jobs[1], "ok", token_ids=[7, 8, 6]),                                  # wrong last token
            Outcome(jobs[2], "aborted", token_ids=[7, 8]),                                # a correct prefix
            Outcome(jobs[3], "error", token_ids=[9]),                                     # a wrong prefix
            Outcome(jobs[4], "ok", token_ids=[7, 8, 9], text="x canary 0000000002 y")]    # request 2's canary
    r = ScenarioResult("x", "transfer", "", outcomes=outs)
    judge([r], Ref())
    assert (r.corrupted, r.leaks) == (2, 1)
    assert any("request 1 (ok)" in v for v in r.violations) and any("request 3 (error)" in v for v in r.violations)
    assert any("carries the canary of request 2" in v for v in r.violations)
    # answers without token ids (the Responses and Messages APIs) are judged by their text
    texts = [Job(i, "x", "acme", f"canary {i:010x}", [1, 2], 3, api="messages", text="t") for i in range(10, 14)]
    outs = [Outcome(texts[0], "ok", text="seven eight nine"), Outcome(texts[1], "ok", text="seven eight"),
            Outcome(texts[2], "error", text="seven eig"), Outcome(texts[3], "aborted", text="six")]
    r = ScenarioResult("x", "hostile", "", outcomes=outs)
    judge([r], Ref())
    assert r.corrupted == 2 and any("request 11 (messages, ok)" in v for v in r.violations)
    assert any("request 13 (messages, aborted)" in v for v in r.violations)


def test_expert_guard_recomputes_when_a_slot_flips_during_the_compute(monkeypatch):
    import engine.experts.paged as paged
    layer, _ = small_layer(k=3)
    layer.slots.verify_on_use = True
    ids, x = torch.tensor([[0], [1], [2]]), torch.randn(3, 4)
    want = layer(x, ids)
    flips = []

    def flipping(real):
        def run(*args, **kw):
            if not flips:                                      # the first compute reads a flipped slot
                flips.append(corrupt_expert(type("L", (), {"paged_experts": lambda self: {0: layer}})(),
                                            random.Random(2)))
            return real(*args, **kw)
        return run
    monkeypatch.setattr(paged, "gathered_all", flipping(paged.gathered_all))
    monkeypatch.setattr(paged, "expert_outputs", flipping(paged.expert_outputs))
    assert torch.equal(layer(x, ids), want) and flips and layer.slots.counters.corrupt_slots == 1
