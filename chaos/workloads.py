"""What a scenario sends: a `Plan` of requests in phases, made by the scenario's workload.

The workloads here send one phase of `n` requests; each request draws its max_tokens (4 to 16)
and prompt length (12 to 96 tokens) first, then what the workload does with them (the order of
the draws is what a seed replays).  The prefix scenarios' workloads run several phases with
actions between them (chaos.prefix)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from chaos.client import Outcome
from chaos.prompts import APIS, VICTIMS, Job, PromptMaker

if TYPE_CHECKING:
    from chaos.ledger import Logged
    from chaos.report import ScenarioResult
    from chaos.scenario import Stage


@dataclass
class Phase:
    """Requests sent together; the next phase waits until the cluster is idle again."""
    name: str
    outs: list[Outcome]
    probe: bool = False     # cross_tenant_probe: its requests' prompts are cached by another cohort only
    waves: int = 1          # sent in this many waves, each when the scenario's driver opens it


class Plan:
    """A scenario's requests for one run, in phases, and what its workload does around them.
    `baseline`: the same requests as the phases', sent alone before them (a hostile
    scenario's victims without the attack: its TTFT baseline); judged like the others."""

    def __init__(self, phases: list[Phase], baseline: list[Outcome] | None = None) -> None:
        self.phases = phases
        self.baseline = baseline or []

    @property
    def outcomes(self) -> list[Outcome]:
        """Every phase's requests, in order (not the baseline)."""
        return [o for p in self.phases for o in p.outs]

    def before(self, index: int, res: ScenarioResult) -> None:
        """Before phase `index` runs (the cluster is idle)."""

    def end(self, res: ScenarioResult) -> None:
        """After the last phase, also when driving failed: undo what `before` left."""

    def judge(self, res: ScenarioResult, logged: Logged) -> None:
        """The workload's own judgement, after the scenario's rules (the cluster is idle)."""


class OnePhase(ABC):
    """`n` requests in one phase."""

    waves = 1

    def count(self, n: int) -> int:
        return n

    def plan(self, stage: Stage, scenario: str, n: int) -> Plan:
        outs = [Outcome(j) for j in self.jobs(stage.maker, scenario, n, stage.limit)]
        return Plan([Phase("requests", outs, waves=self.waves)])

    def jobs(self, maker: PromptMaker, scenario: str, n: int, limit: int) -> list[Job]:
        """The `n` requests; `limit`: the cluster's prompt_tokens + max_tokens limit."""
        out = []
        for i in range(n):
            max_tokens = maker.rng.randint(4, 16)
            length = maker.rng.randint(12, 96)
            out.append(self.job(maker, scenario, length, max_tokens, limit, wave=i * self.waves // n))
        return out

    @abstractmethod
    def job(self, maker: PromptMaker, scenario: str, length: int, max_tokens: int, limit: int, wave: int) -> Job:
        """One request, from its drawn prompt length and max_tokens."""


@dataclass(frozen=True)
class Mixed(OnePhase):
    """Ordinary requests, half of them streamed, a quarter echoing their prompt (its logprobs
    computed on the prefill side and awaited by the gateway before the first token)."""

    def job(self, maker: PromptMaker, scenario: str, length: int, max_tokens: int, limit: int, wave: int) -> Job:
        job = maker.job(scenario, length, max_tokens, stream=maker.rng.random() < 0.5)
        return maker.for_api(job, "echo") if maker.rng.random() < 0.25 else job


@dataclass(frozen=True)
class Streams(OnePhase):
    """Requests of `max_tokens` each (long enough for a driver to act mid-way), three quarters
    streamed (the rest migrate unseen), sent in `waves` waves; a quarter echo their prompt and a
    quarter come through chat completions (both keep token ids, so migrations' near-ties are
    told apart)."""
    max_tokens: int
    waves: int = 1

    def job(self, maker: PromptMaker, scenario: str, length: int, max_tokens: int, limit: int, wave: int) -> Job:
        job = maker.job(scenario, length, self.max_tokens, stream=maker.rng.random() < 0.75, wave=wave)
        # a migrated echo keeps the prompt logprobs its first attempt brought; a chat one is re-templated
        return maker.for_api(job, maker.rng.choice(("completions", "completions", "echo", "chat")))


@dataclass(frozen=True)
class Victims(OnePhase):
    """The other tenants' streamed requests (for their TTFT), through each API in turn
    (chaos/prompts.py APIS), sent twice: alone first (the baseline), then beside the scenario's
    hostile tenant."""

    def count(self, n: int) -> int:
        return 2 * n

    def plan(self, stage: Stage, scenario: str, n: int) -> Plan:
        plan = super().plan(stage, scenario, n)
        plan.baseline = [Outcome(stage.maker.again(o.job)) for o in plan.outcomes]
        return plan

    def job(self, maker: PromptMaker, scenario: str, length: int, max_tokens: int, limit: int, wave: int) -> Job:
        job = maker.job(scenario, length, max_tokens)
        # through every API in turn, so each meets the hostile tenant
        return maker.for_api(replace(job, tenant=VICTIMS[job.index % len(VICTIMS)]), APIS[job.index % len(APIS)])


@dataclass(frozen=True)
class Disconnects(OnePhase):
    """Streamed requests whose clients hang up 0.05 to 0.6 s after sending."""

    def job(self, maker: PromptMaker, scenario: str, length: int, max_tokens: int, limit: int, wave: int) -> Job:
        return maker.job(scenario, length, max_tokens, disconnect_s=maker.rng.uniform(0.05, 0.6))


@dataclass(frozen=True)
class Storm(OnePhase):
    """Requests of 24 tokens whose clients hang up at random points: after some stream chunks,
    after some time, both, or never."""

    def job(self, maker: PromptMaker, scenario: str, length: int, max_tokens: int, limit: int, wave: int) -> Job:
        rng = maker.rng
        stream = rng.random() < 0.7
        return maker.job(scenario, length, 24, stream=stream,
                         disconnect_after=rng.randint(0, 12) if stream and rng.random() < 0.5 else None,
                         disconnect_s=rng.uniform(0.0, 0.8) if rng.random() < 0.7 else None)


@dataclass(frozen=True)
class OverByOne(OnePhase):
    """Prompts whose prompt_tokens + max_tokens is one over the limit: each must be refused."""

    def job(self, maker: PromptMaker, scenario: str, length: int, max_tokens: int, limit: int, wave: int) -> Job:
        return maker.job(scenario, limit - max_tokens + 1, max_tokens, expect_reject=True)


@dataclass(frozen=True)
class FarOver(OnePhase):
    """Prompts 2 to 8 times the limit: each must be refused."""

    def job(self, maker: PromptMaker, scenario: str, length: int, max_tokens: int, limit: int, wave: int) -> Job:
        return maker.job(scenario, limit * maker.rng.randint(2, 8), max_tokens, expect_reject=True)


@dataclass(frozen=True)
class AtLimit(OnePhase):
    """Prompts whose prompt_tokens + max_tokens is exactly the limit, half of them streamed."""

    def job(self, maker: PromptMaker, scenario: str, length: int, max_tokens: int, limit: int, wave: int) -> Job:
        return maker.job(scenario, limit - max_tokens, max_tokens, stream=maker.rng.random() < 0.5)
