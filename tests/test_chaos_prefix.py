"""The chaos suite's prefix-cache scenarios (issue 18): their parts on their own (the poisoned
frame against a real receiver in front of a pool with a cached prefix, the pool squeeze, the
idle accounting with cached pages, the cohort rule, the page hashes).  The three scenarios in a
real run are checked in the chaos smoke (tests/test_chaos_smoke.py), which runs each of them with
the requests its workload plans: a run of their own here repeated it (140 s of the suite)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from chaos.client import Outcome
from chaos.control import SQUEEZE_ID, ChaosControl, cached_page_digests
from chaos.judges import Refusals
from chaos.ledger import Ledger, Logged
from chaos.prefix import CachePoison, CrossTenant, EvictUnderLoad, Phased
from chaos.prefix_checks import digests_changed, own_bound
from chaos.prompts import Job
from chaos.report import ScenarioResult
from chaos.scenarios import BY_NAME
from chaos.sender_faults import FaultInjector
from engine.kv_pool import CACHED, PagePool
from engine.prefix_cache import max_cached_pages, page_keys
from kv_transfer.errors import Refusal, TransferRefused
from kv_transfer.receiver import TransferReceiver
from kv_transfer.reservation import Reservation, State
from kv_transfer.sender import TransferSender, TransferTicket
from kv_transfer.transport import connect
from kv_transfer.transport.local import LocalServer
from tests.kv_helpers import LAYERS, PAGE, SECRET, digest_of, make_pool, prompt_ids
from worker.types import Role

PREFIX = ("cross_tenant_probe", "cache_poison", "evict_under_load")
PROMPT = 21          # 6 pages of 4; up to 5 may be cached
SALT = b"acme-salt-16byte"


def keys_of(rid: str) -> list[bytes]:
    return page_keys(SALT, prompt_ids(rid, PROMPT)[:max_cached_pages(PROMPT, PAGE) * PAGE], PAGE)


def warm(pool: PagePool, rid: str, pages: int) -> None:
    """An earlier request of `rid`'s prompt left its first `pages` pages cached (evictable)."""
    pool.allocate_prefixed("earlier", pages, [], SALT)
    pool.mark_written("earlier", pool.page_table("earlier"))
    assert pool.publish("earlier", keys_of(rid)[:pages], SALT) == pages
    pool.free("earlier")


@pytest.fixture
def rig():
    src, dst = make_pool(32, seed=1), make_pool(32, seed=2)     # bf16, full of stale bytes
    recv = TransferReceiver(dst, SECRET)
    server = LocalServer(recv, f"chaos-prefix-{id(recv)}")
    yield src, dst, recv, server
    server.stop()


def push(src: PagePool, dst: PagePool, recv: TransferReceiver, server: LocalServer, rid: str, cached_pages: int,
         hooks: FaultInjector) -> tuple[object, TransferRefused | None]:
    """`rid` admitted on `dst` with its first `cached_pages` pages from the cache (warmed before);
    `src` pushes the rest through `hooks`.  Returns the reservation and the refusal (None: committed)."""
    hits = dst.allocate_prefixed(rid, dst.pages_for(PROMPT) + 1, keys_of(rid)[:cached_pages], SALT)
    assert hits == cached_pages
    res = recv.reserve(rid, "acme", PROMPT, digest_of(rid, PROMPT), cached_tokens=hits * PAGE)
    src.allocate(rid, src.pages_for(PROMPT))
    ticket = TransferTicket(res.transfer_id, rid, "acme", res.prompt_digest)
    sender = TransferSender(connect(server.endpoint, res.transfer_id), ticket, SECRET, src, src.page_table(rid),
                            PROMPT, hooks=hooks, cached_tokens=hits * PAGE)
    try:
        sender.send_layers(0, LAYERS)
        sender.commit(1, -0.5)
    except TransferRefused as e:
        return res, e
    return res, None


def test_a_frame_for_a_cached_page_is_refused_and_the_page_keeps_its_bytes(rig):
    src, dst, recv, server = rig
    faults = FaultInjector(seed=1)
    faults.arm("poison_cached", times=5)
    res, err = push(src, dst, recv, server, "plain", 0, faults)     # a whole transfer: nothing to aim at
    assert err is None and faults.fired["poison_cached"] == 0
    warm(dst, "victim", 4)
    before = cached_page_digests(dst)
    assert len(before) == 4 and all(dst.owner(p) == CACHED for p in before)
    res, err = push(src, dst, recv, server, "victim", 4, faults)
    assert err is not None and err.reason == Refusal.CACHED_PAGE
    assert res.state == State.FAILED and faults.fired["poison_cached"] == 1
    assert list(faults.log) == [("poison_cached", res.transfer_id.hex())]
    assert (res.transfer_id.hex(), "CACHED_PAGE") in list(recv.refusal_log)
    assert cached_page_digests(dst) == before                    # nothing written into the shared pages
    recv.release(res.transfer_id)
    dst.free("victim")
    dst.check_integrity()


def test_without_the_receivers_check_the_poison_lands_and_the_hashes_show_it(rig, monkeypatch):
    src, dst, recv, server = rig
    """With neither the CACHED_PAGE nor the owner check (STALE_PAGE), the forged frame is written
    into the shared page; only the pool's read-only assertion stops it, after the bytes changed."""
    monkeypatch.setattr(Reservation, "first_page", property(lambda self: 0))
    monkeypatch.setattr(TransferReceiver, "_check_page", lambda self, res, ref, cached=False: None)
    faults = FaultInjector(seed=1)
    faults.arm("poison_cached", times=1)
    warm(dst, "victim", 4)
    before = cached_page_digests(dst)
    with pytest.raises(AssertionError, match="is cached"):
        push(src, dst, recv, server, "victim", 4, faults)
    assert faults.fired["poison_cached"] == 1
    assert digests_changed(before, cached_page_digests(dst))[1] == [dst.page_table("victim")[3]]


def test_an_unarmed_injector_leaves_a_delta_transfer_alone(rig):
    src, dst, recv, server = rig
    warm(dst, "clean", 3)
    res, err = push(src, dst, recv, server, "clean", 3, FaultInjector(seed=1))
    assert err is None and res.state == State.COMMITTED and res.cached_tokens == 3 * PAGE


def control_on(pool: PagePool) -> ChaosControl:
    """A decode worker's ChaosControl over `pool` alone (no model, no server)."""
    control = ChaosControl(Role.DECODE, seed=0)
    control._handle = SimpleNamespace(core=SimpleNamespace(pool=pool, paged_experts=lambda: {}),
                                      lock=threading.RLock())
    return control


def test_idle_accounting_counts_referenced_cached_pages_not_evictable_ones():
    pool = make_pool(32, seed=3)
    control = control_on(pool)
    warm(pool, "a", 4)
    idle = control.idle_check(contents=True)
    assert (idle["used"], idle["private"], idle["cached"], idle["evictable"], idle["integrity"]) == (0, 0, 4, 4, "")
    pool.allocate_prefixed("b", 6, keys_of("a")[:4], SALT)          # 4 cached pages referenced, 2 private
    busy = control.idle_check()
    assert (busy["used"], busy["private"], busy["evictable"]) == (6, 2, 0)
    res = ScenarioResult("x", "prefix", "")
    res.check_pools({"decode-0": busy})
    assert res.pages_leaked == 6 and "2 private, 4 cached and still referenced" in res.violations[0]
    pool.free("b")
    assert control.idle_check()["used"] == 0


def test_the_contents_check_finds_a_cached_page_written_in_place():
    pool = make_pool(32, seed=4)
    control = control_on(pool)
    warm(pool, "a", 3)
    assert control.idle_check(contents=True)["integrity"] == ""
    page = next(p for p in range(pool.num_pages) if pool.owner(p) == CACHED)
    pool.kv[0, 0, page, 0] += 1                                      # a write behind the pool's back
    problem = control.idle_check(contents=True)["integrity"]
    assert f"cached pages [{page}] changed" in problem


def test_the_squeeze_evicts_cached_pages_and_gives_every_page_back():
    pool = make_pool(32, seed=5)
    control = control_on(pool)
    warm(pool, "a", 4)
    assert control.squeeze(keep_pages=6) == {"held": 26, "kept": 6}
    assert pool.evictions == 0 and pool.num_evictable == 4          # the free list went first
    pool.allocate("r", 5)                                            # a request needing room evicts
    assert pool.evictions == 3
    assert control.pool_state() == {"used": 31, "free": 1, "private": 31, "cached": 1, "evictable": 1,
                                    "evictions": 3}
    pool.free("r")
    assert control.unsqueeze() == 26 and not pool.has(SQUEEZE_ID)
    assert control.idle_check()["used"] == 0


def outcome(tenant: str, ids: list[int], out: list[int] = (), salt: str | None = None, cached: int | None = None,
            index: int = 0) -> Outcome:
    return Outcome(Job(index, "p", tenant, "canary 0", list(ids), 4, cache_salt=salt), "ok", token_ids=list(out),
                   cached_tokens=cached)


def test_a_request_may_be_served_only_its_own_cohorts_prefix():
    prompt = list(range(100, 150))                                   # 50 tokens: at most 3 pages of 16
    own = outcome("acme", prompt[:40] + [1] * 10, out=[9])
    other = outcome("globex", prompt)
    salted = outcome("acme", prompt, salt="s1")
    me = outcome("acme", prompt)
    assert own_bound(me, [own, other, salted, me], 16) == 32          # 40 common tokens: 2 whole pages
    assert own_bound(me, [other, salted, me], 16) == 0                # another tenant or salt: nothing
    assert own_bound(me, [outcome("acme", prompt[:20], out=prompt[20:49])], 16) == 48   # output counts, capped


def test_page_digests_compare_only_pages_of_the_same_generation():
    before = {1: (3, "aa"), 2: (5, "bb"), 3: (1, "cc")}
    after = {1: (3, "aa"), 2: (6, "zz"), 3: (1, "dd")}               # page 2 evicted and reused
    assert digests_changed(before, after) == (2, [3])


class FakeCluster:
    def ledger(self, wid: str) -> Ledger:
        return Ledger(pid=1, page_size=16)

    def workers(self, role=None):
        return {"decode-0": None}


def test_cross_tenant_judge_flags_a_probe_served_another_tenants_pages():
    from chaos.prompts import PromptMaker
    from engine.config import SHIPPED_MODEL
    from engine.tokenizer import Tokenizer
    work = CrossTenant(FakeCluster(), PromptMaker(Tokenizer(SHIPPED_MODEL), 1), "cross_tenant_probe", 10)
    assert [len(p.outs) for p in work.phases] == [2] * 5 and BY_NAME["cross_tenant_probe"].sends(10) == 10
    assert [(p.outs[0].job.tenant, p.outs[0].job.cache_salt, p.probe) for p in work.phases] == [
        ("acme", None, False), ("globex", None, True), ("globex", None, False), ("acme", "probe-1", True),
        ("acme", "probe-2", True)]
    first, probe, again = (p.outs for p in work.phases[:3])
    assert [o.job.ids for o in first] == [o.job.ids for o in probe] != [o.job.ids for o in again]
    for p in work.phases:
        for o in p.outs:
            o.outcome, o.token_ids, o.cached_tokens = "ok", [5, 6], 0
    for o in again:
        o.cached_tokens = 160                                        # its own prefix, cached by globex's probe
    res = ScenarioResult("cross_tenant_probe", "prefix", "")
    work.judge(res, Logged())
    assert res.violations == [] and (res.faults_injected, res.faults_detected) == (6, 6)
    probe[1].cached_tokens = 16                                      # a page of acme's reached globex
    res = ScenarioResult("cross_tenant_probe", "prefix", "")
    work.judge(res, Logged())
    assert (res.faults_injected, res.faults_detected) == (6, 5)
    assert len(res.violations) == 1 and "globex" in res.violations[0] and "(I10)" in res.violations[0]


def test_prefix_workloads_are_registered():
    assert [BY_NAME[n].workload for n in PREFIX] == [Phased(CrossTenant), Phased(CachePoison), Phased(EvictUnderLoad)]
    poison = BY_NAME["cache_poison"]
    assert poison.judged == (Refusals("CACHED_PAGE"),) and poison.faults is not None
    assert (poison.faults.point, poison.faults.phase) == ("poison_cached", 1)          # armed for the poisoned phase
    assert BY_NAME["evict_under_load"].sends(3) == 16 and poison.sends(3) == 6
    assert BY_NAME["redos"].sends(4) == 8 and BY_NAME["flipped_bit"].sends(4) == 4
