"""Running one scenario against the live cluster (chaos.scenario says how its parts fit): plan
its requests, arm its faults, drive the requests with its driver and attack, let the cluster go
idle, and judge the row by the scenario's rules on what the workers logged."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence

from chaos import migrations
from chaos.client import Outcome, send
from chaos.cluster import ChaosCluster
from chaos.drivers import Strike, Waves
from chaos.gauges import percentile
from chaos.ledger import Ledger, Logged
from chaos.moving import Move
from chaos.prompts import ATTACKER, PromptMaker
from chaos.report import ScenarioResult
from chaos.scenario import Driver, Evidence, Group, Scenario, Stage
from chaos.workloads import Phase, Plan
from worker.types import Role

REQUEST_TIMEOUT_S = 180.0
Records = list[Strike | Move]


class ScenarioRunner:
    def __init__(self, cluster: ChaosCluster, maker: PromptMaker, keys: dict[str, str], model: str,
                 concurrency: int, seed: int) -> None:
        self.cluster, self.maker, self.model = cluster, maker, model
        self.key_of = {tenant: key for key, tenant in keys.items()}
        self.concurrency = concurrency
        self.rng = random.Random(seed)
        self.stage = Stage(cluster, maker, cluster.limit(), model, self.key_of[ATTACKER])

    def run(self, sc: Scenario, n: int) -> ScenarioResult:
        """Run `sc` with `n` requests (its workload may send more) and judge it; the cluster is
        idle before and after."""
        t0 = time.monotonic()
        res = ScenarioResult(sc.name, sc.group.value, sc.about)
        before = self.cluster.ledgers()
        moved_before = migrations.now(self.cluster.url)
        plan = sc.workload.plan(self.stage, sc.name, n)
        if plan.baseline:                   # the same requests without the attack: the TTFT baseline
            asyncio.run(self._drive(Phase("baseline", plan.baseline), None))
            self.cluster.wait_idle()
        records = self._attacked(sc, plan, res)
        self.cluster.disarm()
        checks = self.cluster.wait_idle()
        self._judge(sc, plan, res, checks, self._evidence(before, records))
        self._migrations(sc, res, migrations.now(self.cluster.url) - moved_before)
        res.account()
        res.seconds = time.monotonic() - t0
        return res

    def _attacked(self, sc: Scenario, plan: Plan, res: ScenarioResult) -> Records:
        """The plan's phases within the scenario's attack (begun before, ended after, always)."""
        attack = sc.attack.build(self.stage, plan.outcomes) if sc.attack is not None else None
        try:
            if attack is not None:
                attack.begin(res)
            return self._phases(sc, plan, res)
        finally:
            if attack is not None:
                attack.end(res)

    def _phases(self, sc: Scenario, plan: Plan, res: ScenarioResult) -> Records:
        """The phases one after another, the cluster idle between them, the scenario's faults
        armed for theirs, its driver alongside each.  Returns the driver's records."""
        records: Records = []
        try:
            for i, phase in enumerate(plan.phases):
                if i:
                    self.cluster.wait_idle()
                plan.before(i, res)
                self._arm(sc, i, phase)
                records += asyncio.run(self._drive(phase, sc.driver))
        finally:
            plan.end(res)
        return records

    def _arm(self, sc: Scenario, index: int, phase: Phase) -> None:
        """Arm the scenario's point before its phase; disarm it before the next one."""
        if sc.faults is None:
            return
        if index == sc.faults.phase:
            sc.faults.arm(self.cluster, len(phase.outs))
        elif index == sc.faults.phase + 1:
            self.cluster.disarm()

    async def _drive(self, phase: Phase, driver: Driver | None) -> Sequence[Strike | Move]:
        """Send the phase's requests (`concurrency` at once, each once its wave is open) with
        `driver` alongside; returns its records."""
        sem = asyncio.Semaphore(self.concurrency)
        done = asyncio.Event()
        waves = Waves(phase.waves)

        async def one(o: Outcome) -> None:
            await waves.reach(o.job.wave)
            async with sem:
                await send(self.cluster.url, self.key_of[o.job.tenant], self.model, o, REQUEST_TIMEOUT_S)
        task = None
        if driver is not None:
            task = asyncio.create_task(driver.drive(self.cluster, phase.outs, done, self.rng, waves))
            task.add_done_callback(lambda _: waves.open_all())
        else:
            waves.open_all()
        await asyncio.gather(*(one(o) for o in phase.outs))
        done.set()
        return await task if task is not None else []

    def _evidence(self, before: dict[str, Ledger], records: Records) -> Evidence:
        logged = Logged.between(before, self.cluster.ledgers())
        return Evidence(logged, records, self.stage.limit, len(self.cluster.workers(Role.DECODE)))

    @staticmethod
    def _judge(sc: Scenario, plan: Plan, res: ScenarioResult, checks: dict[str, dict], ev: Evidence) -> None:
        """The oracles every scenario shares that need no reference (fail closed, pools at
        idle), then the scenario's rules in order, then its workload's own judgement."""
        res.outcomes = plan.baseline + plan.outcomes
        res.tally(res.outcomes)
        if plan.baseline:
            _ttft(res, plan.baseline, plan.outcomes)
        res.check_pools(checks)
        for rule in sc.judged:
            rule.judge(sc, res, ev)
        plan.judge(res, ev.logged)

    @staticmethod
    def _migrations(sc: Scenario, res: ScenarioResult, moved: migrations.MigrationCounts) -> None:
        """The gateway's migrations while the scenario ran (every process scenario shows them,
        any other only when there were some)."""
        if sc.group == Group.PROCESS or moved.total or moved.failed:
            res.figures.update(moved.figures())
            res.notes.append(moved.summary())


def _ttft(res: ScenarioResult, base: list[Outcome], attacked: list[Outcome]) -> None:
    """The victims' TTFT p99 without the attack and beside it, and their ratio (issue 16's
    target: at most 3x; reported, never asserted)."""
    p = [_round(percentile([t for o in outs if o.outcome == "ok" and (t := o.ttft) is not None], 99))
         for outs in (base, attacked)]
    ratio = _round(p[1] / p[0], 2) if p[0] and p[1] is not None else None
    res.figures.update(ttft_p99_baseline_s=p[0], ttft_p99_attack_s=p[1], ttft_ratio=ratio)
    res.notes.append(f"victims' TTFT p99 {_ms(p[0])} without the attack, {_ms(p[1])} beside it"
                     + (f" ({ratio:.2f}x; target <= 3x)" if ratio is not None else ""))


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.0f} ms"
