"""What a chaos scenario is: one typed object holding what it sends (its `Workload`), the fault
point it arms on the workers (`Armed`), what it does to the cluster while its requests run (a
`Driver`), what attacks the cluster around or beside them (an `Attack`), and how it is judged
(its `Rule`s, on the `Evidence` the run gathered).  The scenarios are listed in
chaos.scenarios, one row each; chaos.runner runs one:

    plan = workload.plan(stage, name, n)         its requests, in phases (chaos.workloads)
    plan.baseline, driven alone                  a hostile scenario's victims without the attack
    attack.build(stage, outs).begin(row)         (chaos.attacks, chaos.attacker and its subclasses)
    for each phase i of the plan:
        plan.before(i); faults armed before phase `faults.phase`, disarmed before the next
        its requests sent, the driver alongside  (chaos.drivers, chaos.moving)
    attack.end(row)                              an attack judges itself into the row
    disarm; wait until every pool is idle; read every worker's ledger (chaos.ledger)
    each rule judges the row, in order; then plan.judge   (chaos.judges, chaos.prefix)

Every scenario is also judged by the oracles they all share (chaos.report, chaos.oracle:
fail closed, pools at idle, reference equality, canaries) and by the accounting rule (each
injected fault detected or tolerated).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from worker.types import Role

if TYPE_CHECKING:
    from chaos.client import Outcome
    from chaos.cluster import ChaosCluster
    from chaos.drivers import Strike, Waves
    from chaos.ledger import Logged
    from chaos.moving import Move
    from chaos.prompts import PromptMaker
    from chaos.report import ScenarioResult
    from chaos.workloads import Plan


class Group(StrEnum):
    """What a scenario attacks (the report's `group`)."""
    TRANSFER = "transfer"        # a KV transfer's frames
    POOL = "pool"                # a decode worker's pages or expert slots
    PROCESS = "process"          # worker processes and clients: kills, drains, stalls, hang-ups
    ADMISSION = "admission"      # prompts at and over the limit
    TRUST = "trust"              # the cluster's trust boundary (I9)
    HOSTILE = "hostile"          # one tenant against the others (I10)
    PREFIX = "prefix"            # the shared prefix cache (I10, I4, I6)


@dataclass(frozen=True)
class Armed:
    """A fault point armed on every worker of `role` (sender points on PREFILL, receiver and pool
    points on DECODE: chaos.sender_faults, chaos.injectors) before phase `phase` of the
    scenario's requests, disarmed once they are done (before the next phase, if any)."""
    point: str
    role: Role
    share: float = 0.4           # about this share of the phase's requests is faulted
    per_frame: float = 0.5       # chance per frame while the armed count lasts
    seconds: float = 0.0         # delay, late_write, stall
    after: int = 0               # frames each injector lets pass before it may fire
    phase: int = 0

    def arm(self, cluster: ChaosCluster, requests: int) -> None:
        """Arm the point for a phase of `requests` requests."""
        cluster.arm(self.role, self.point, times=max(1, math.ceil(requests * self.share)),
                    probability=self.per_frame, seconds=self.seconds, after=self.after)


@dataclass(frozen=True)
class Stage:
    """What a workload and an attack are built from: the running cluster and the run's prompts."""
    cluster: ChaosCluster
    maker: PromptMaker
    limit: int                   # the cluster's prompt_tokens + max_tokens limit
    model: str
    attacker_key: str            # the API key of the hostile tenant (chaos.prompts.ATTACKER)


class Workload(Protocol):
    """The requests a scenario sends."""

    def count(self, n: int) -> int:
        """How many requests it sends when the run gives it `n` (the JSON report's `requests`)."""
        ...

    def plan(self, stage: Stage, scenario: str, n: int) -> Plan:
        """This run's requests (in phases) and the workload's actions around them; draws from
        `stage.maker`'s random generator, so a seed replays it."""
        ...


class Driver(Protocol):
    """What a scenario does to the cluster while its requests run (kill, drain, corrupt)."""

    async def drive(self, cluster: ChaosCluster, live: list[Outcome], done: asyncio.Event, rng: random.Random,
                    waves: Waves) -> Sequence[Strike | Move]:
        """Act while `live` runs (until `done` is set); opens `waves` (wave 0 once it is ready
        to watch the requests).  Returns a record of each fault it injected."""
        ...


class Attack(Protocol):
    """An attack around a scenario's requests (trust) or beside them (hostile); it judges
    itself into the row when it ends."""

    @classmethod
    def build(cls, stage: Stage, outs: list[Outcome]) -> Attack:
        """The attack on this run's cluster; `outs`: the scenario's requests (not yet sent)."""
        ...

    def begin(self, res: ScenarioResult) -> None:
        """Before the scenario's requests (the cluster is idle)."""
        ...

    def end(self, res: ScenarioResult) -> None:
        """After the scenario's requests, also when driving them failed: undo what `begin`
        left open, and fill the row (faults injected and detected, violations)."""
        ...


@dataclass(frozen=True)
class Evidence:
    """What a scenario's rules judge from, besides the row's outcomes."""
    logged: Logged                       # what the workers logged while it ran
    records: Sequence[Strike | Move]     # the faults its driver injected
    limit: int                           # the cluster's prompt_tokens + max_tokens limit
    decode_workers: int


class Rule(Protocol):
    """One way a scenario is judged."""

    def judge(self, sc: Scenario, res: ScenarioResult, ev: Evidence) -> None:
        """Count faults injected and detected (or tolerated) into `res`, add its violations."""
        ...


@dataclass(frozen=True)
class Scenario:
    """One chaos scenario: its name on the command line and in the report, its group, a line
    about it, and its parts (module docstring).  A part it lacks does nothing."""
    name: str
    group: Group
    about: str
    workload: Workload
    faults: Armed | None = None
    driver: Driver | None = None
    attack: type[Attack] | None = None
    judged: tuple[Rule, ...] = ()        # besides an attack's own judgement and a phased workload's
    weight: float = 1.0                  # share of --requests, relative to the other scenarios
    least: int = 2                       # requests it needs at the least

    def sends(self, n: int) -> int:
        """The requests it sends when the run gives it `n`."""
        return self.workload.count(n)
