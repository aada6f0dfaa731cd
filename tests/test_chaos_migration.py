"""The chaos run's rules around migration, without a cluster: every injected fault is detected
or tolerated (the accounting rule), a token that differs at a near-tie is reported as one and
never passed silently, the migration gap's percentiles read from the gateway's histogram, and
the kill and drain scenarios' accounting."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from chaos.client import Outcome
from chaos.gauges import parse_metrics
from chaos.judges import Moves
from chaos.ledger import Logged
from chaos.migrations import MigrationCounts, bucket_quantile, read
from chaos.moving import Move, MoveKind
from chaos.oracle import NEAR_TIE, compare, judge
from chaos.prompts import Job
from chaos.report import ScenarioResult, table, totals


def test_a_fault_neither_detected_nor_tolerated_makes_the_run_not_ok():
    kill = ScenarioResult("kill_decode", "process", "", faults_injected=1)     # a kill that showed nothing
    assert kill.unaccounted == 1 and not kill.ok
    kill.account()
    assert kill.violations == ["1 of 1 injected faults were neither detected (0) nor tolerated (0)"]
    stall = ScenarioResult("stalled_peer", "process", "", faults_injected=5, tolerated=True)
    hog = ScenarioResult("kv_hog", "hostile", "", faults_injected=80, faults_detected=64, faults_tolerated=16)
    drain = ScenarioResult("drain_decode", "process", "", faults_injected=2, faults_detected=1, faults_tolerated=1)
    for r in (stall, hog, drain):
        r.account()
        assert r.ok and r.unaccounted == 0 and not r.violations, r
    t = totals([kill, stall, hog, drain], seed=1, seconds=1.0)
    assert (t["faults_injected"], t["faults_detected"], t["faults_tolerated"], t["faults_unaccounted"]) == \
        (88, 65, 22, 1)
    assert not t["ok"]
    rows = {s["name"]: s for s in t["scenarios"]}
    assert rows["stalled_peer"]["faults_detected"] is None and rows["stalled_peer"]["faults_tolerated"] == 5
    assert rows["kill_decode"]["faults_unaccounted"] == 1 and not rows["kill_decode"]["ok"]


class Ref:
    """A greedy reference over a toy vocabulary: after any prefix, the next token is 7, 8, 9, ...
    by position, except that position 2 is a near-tie between 9 and 5 (logprobs 1e-6 apart)
    and position 3 a clear choice."""

    def tokens(self, ids, max_tokens):
        return [7 + len(ids) + k - 2 for k in range(max_tokens)]        # ids start as [1, 2]

    def logprobs(self, ids, max_tokens):
        out = []
        for k in range(max_tokens):
            pos, want = len(ids) + k - 2, 7 + len(ids) + k - 2
            out.append({want: -0.5, 5: -0.5 - 1e-6} if pos == 2 else {want: -0.1, 5: -3.0})
        return out


def test_a_near_tie_is_reported_and_the_rest_compared_with_the_continued_reference():
    assert compare([7, 8, 9, 10], [1, 2], 4, True, Ref()).wrong is None
    tie = compare([7, 8, 5, 10], [1, 2], 4, True, Ref())          # the other side of the tie, then exact
    assert tie.wrong is None and len(tie.near_ties) == 1 and "token 2: 5 for the reference's 9" in tie.near_ties[0]
    assert compare([7, 8, 5, 11], [1, 2], 4, True, Ref()).wrong == (
        "token 3 is 11 where the reference has 10 (the reference's logprobs: -0.1000000 for 10, not among its "
        "top 2 for 11)")
    assert compare([7, 8, 9, 5], [1, 2], 4, True, Ref()).wrong.endswith("-0.1000000 for 10, -3.0000000 for 5)")
    assert compare([7, 8], [1, 2], 4, False, Ref()).wrong is None            # cut short: a prefix
    assert compare([7, 8], [1, 2], 4, True, Ref()).wrong == "2 tokens where the reference has 4"
    assert compare([7, 8, 5], [1, 2], 3, True, Ref()).wrong is None          # a tie at the last token
    assert 1e-6 < NEAR_TIE < 1e-4


def test_the_oracle_counts_near_ties_apart_from_corrupted_responses():
    jobs = [Job(i, "kill_decode", "acme", f"canary {i:010x}", [1, 2], 4) for i in range(3)]
    outs = [Outcome(jobs[0], "ok", token_ids=[7, 8, 5, 10]), Outcome(jobs[1], "ok", token_ids=[7, 8, 5, 12]),
            Outcome(jobs[2], "ok", token_ids=[7, 8, 9, 10])]
    r = ScenarioResult("kill_decode", "process", "", outcomes=outs)
    judge([r], Ref())
    assert (r.near_ties, r.corrupted) == (2, 1)
    assert any("request 0 (ok): a near-tie" in n and "the rest equals the reference" in n for n in r.notes)
    assert any("request 1 (ok): token 3 is 12" in v for v in r.violations) and not r.ok
    assert "ties" in table([r]).splitlines()[0]


def gateway_metrics(gaps: list[float], causes: dict[str, int], prefill: int = 0) -> str:
    """The gateway's migration metrics as prometheus_client renders them."""
    reg = CollectorRegistry()
    c = Counter("tandem_migrations", "migrations by cause", ["cause"], registry=reg)
    Counter("tandem_migrations_failed", "failed migrations", ["reason"], registry=reg).labels("bound").inc(0)
    Counter("tandem_migration_prefill_tokens", "re-prefilled tokens", registry=reg).inc(prefill)
    h = Histogram("tandem_migration_gap_seconds", "gap", buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 30),
                  registry=reg)
    for cause, n in causes.items():
        c.labels(cause).inc(n)
    for g in gaps:
        h.observe(g)
    return generate_latest(reg).decode()


def test_migrations_by_cause_and_the_gap_read_from_the_gateways_metrics():
    before = read(parse_metrics(gateway_metrics([0.07], {"lost": 1})))
    after = read(parse_metrics(gateway_metrics([0.07] + [0.03] * 9 + [0.2] * 10, {"lost": 12, "drain": 8}, 640)))
    moved = after - before
    assert moved.by_cause == {"lost": 11, "drain": 8} and moved.total == 19 and moved.prefill_tokens == 640
    f = moved.figures()
    assert f["migrations"] == 19 and f["migrations_error"] == 0 and f["migration_gap_count"] == 19
    # 9 gaps in (0.025, 0.05], 10 in (0.1, 0.25] (the one at 0.07 was there before): rank 9.5 of 19
    assert f["migration_gap_p50_s"] == pytest.approx(0.1 + 0.15 * 0.5 / 10, abs=1e-4)
    assert f["migration_gap_p99_s"] == pytest.approx(0.1 + 0.15 * (18.81 - 9) / 10, abs=1e-4)
    assert "interpolated within" in moved.summary()
    assert MigrationCounts().figures()["migration_gap_p50_s"] is None


def test_bucket_quantile_interpolates_within_a_bucket():
    assert bucket_quantile({1.0: 0, 2.0: 10, math.inf: 10}, 0.5) == pytest.approx(1.5)
    assert bucket_quantile({1.0: 4, math.inf: 8}, 0.9) == 1.0        # in +Inf: the highest finite bound
    assert bucket_quantile({1.0: 0, math.inf: 0}, 0.5) is None


def _outs(n: int, outcome: str = "ok") -> list[Outcome]:
    return [Outcome(Job(i, "x", "acme", f"canary {i:010x}", [1], 4), outcome) for i in range(n)]


def moved_streams(res: ScenarioResult, moves: list[Move], want: int) -> None:
    """Judge `moves` as a moving scenario wanting `want` of them (on a 2-decode-worker cluster)."""
    from chaos.scenario import Evidence
    from chaos.scenarios import BY_NAME
    Moves(want).judge(BY_NAME[res.name], res, Evidence(Logged(), moves, 512, 2))


def test_kills_and_drains_are_detected_by_the_gateways_migrations():
    kill = Move(MoveKind.KILL, "decode-0", [0, 1], held=2, held_resumed=0, migrated={"lost": 2}, recovered_s=3.0)
    again = replace(kill, kind=MoveKind.KILL_MIGRATED, worker="decode-1", held_resumed=1, migrated={"lost": 1})
    r = ScenarioResult("kill_decode_twice", "process", "", outcomes=_outs(3))
    moved_streams(r, [kill, again], 2)
    r.account()
    assert (r.faults_injected, r.faults_detected) == (2, 2) and r.ok
    assert "killed decode-0 holding 2 streams mid-way (0 of them migrated there); the gateway migrated 2" in r.notes[0]
    nothing = ScenarioResult("kill_decode", "process", "", outcomes=_outs(3))
    moved_streams(nothing, [replace(kill, migrated={})], 1)                 # the kill moved no stream
    nothing.account()
    assert nothing.unaccounted == 1 and not nothing.ok
    short = ScenarioResult("kill_decode_twice", "process", "", outcomes=_outs(3))
    moved_streams(short, [kill], 2)
    assert any("1 of its 2 kills or drains" in v for v in short.violations)

    drain = Move(MoveKind.DRAIN, "decode-0", [0], held=1, held_resumed=0, reply={"finished": 1, "drained": 2},
                 migrated={"drain": 2}, recovered_s=2.0)
    quiet = replace(drain, worker="decode-1", reply={"finished": 3, "drained": 0}, migrated={})
    d = ScenarioResult("drain_decode", "process", "", outcomes=_outs(2))
    moved_streams(d, [drain, quiet], 2)
    d.account()
    assert (d.faults_detected, d.faults_tolerated, d.ok) == (1, 1, True)
    cut = ScenarioResult("drain_decode", "process", "", outcomes=_outs(2))
    moved_streams(cut, [replace(drain, migrated={"drain": 1, "lost": 1})], 1)
    assert any("cut 1 streams" in v for v in cut.violations)


def test_waves_hold_requests_until_the_driver_opens_them_and_all_open_when_it_ends():
    import asyncio

    from chaos.drivers import Waves
    from chaos.scenarios import BY_NAME, split
    from chaos.workloads import Streams

    async def run() -> list[str]:
        waves, seen = Waves(3), []

        async def request(wave: int, name: str) -> None:
            await waves.reach(wave)
            seen.append(name)
        tasks = [asyncio.create_task(request(w, n)) for w, n in ((0, "a"), (1, "b"), (2, "c"), (1, "d"))]
        await asyncio.sleep(0.01)
        assert seen == [] and waves.more            # nothing goes before the driver is ready
        waves.open(0)
        await asyncio.sleep(0.01)
        assert seen == ["a"]
        waves.open(1)
        await asyncio.sleep(0.01)
        assert sorted(seen) == ["a", "b", "d"] and waves.more
        waves.open_all()
        assert not waves.more
        await asyncio.gather(*tasks)
        return seen
    assert asyncio.run(run())[-1] == "c"
    moving = [BY_NAME[n] for n in ("kill_decode", "kill_decode_twice", "drain_decode")]
    assert split(6, moving) == [6, 8, 8]                     # the moving scenarios' least requests
    # a wave per kill or drain (one per decode worker: two), and one to spare
    assert [s.workload for s in moving] == [Streams(48, waves=2), Streams(48, waves=2), Streams(48, waves=3)]
    assert [s.judged[0] for s in moving] == [Moves(1), Moves(2), Moves(None)]


def test_pace_lets_a_loop_apply_one_steps_output_per_hold():
    """The moving scenarios' pace (chaos.injectors.Pacer) on a loop shaped like the worker's:
    schedule under the lock, compute without it, apply the output under it."""
    import threading
    import time

    from chaos.injectors import Pacer

    lock, applied, stop = threading.RLock(), [0], threading.Event()

    def loop() -> None:
        while not stop.is_set():
            with lock:
                pass                                   # schedule
            time.sleep(0.003)                          # compute
            with lock:
                applied[0] += 1                        # update: the token path

    def steps_in(seconds: float) -> int:
        first = applied[0]
        time.sleep(seconds)
        return applied[0] - first

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    pacer = Pacer(lock, lambda: applied[0])
    try:
        assert steps_in(0.3) > 20                      # unpaced: about one step per 3 ms
        pacer.start(0.05)
        assert pacer.running and steps_in(0.6) <= 0.6 / 0.05 + 2
        pacer.stop()
        assert not pacer.running and steps_in(0.3) > 20
        assert lock.acquire(blocking=False)            # stopped: the lock is free
        lock.release()
    finally:
        pacer.stop()
        stop.set()
        thread.join()
    for bad in (0.0, 2.0):
        with pytest.raises(ValueError, match="pace"):
            pacer.start(bad)
