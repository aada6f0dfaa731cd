"""The prefix-cache scenarios (issue 18): workloads whose requests run in phases, one phase after
another (each phase's requests concurrently, the cluster idle in between), with actions of
their own between the phases and a judgement of their own after the common oracles.

    cross_tenant_probe  acme sends prompts with long prefixes; then globex sends the same
                        prompts, then again with new suffixes; then acme under two cache_salt
                        values.  A request may be served cached tokens only from its own
                        cohort (tenant and salt): no probe gets any, and every probe's tokens
                        equal acme's for the same prompt
    cache_poison        prefixes cached by a warm-up; then, armed, the prefill worker adds to
                        every delta transfer a frame of other bytes for the last cached page
                        (`poison_cached`, refused CACHED_PAGE); the cached pages' bytes are
                        hashed before and after; then requests hit the prefixes again
    evict_under_load    every decode pool squeezed to SQUEEZE_KEEP allocatable pages while
                        requests over 3 shared prefixes run: cached pages are evicted while
                        others are referenced, and the pool must have evicted
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chaos.client import Outcome
from chaos.cluster import ChaosCluster
from chaos.prefix_checks import digests_changed, own_bound
from chaos.prompts import VICTIMS, Job, PromptMaker
from chaos.report import ScenarioResult
from chaos.workloads import Phase, Plan
from worker.types import Role

if TYPE_CHECKING:
    from chaos.ledger import Logged
    from chaos.scenario import Stage

SUFFIX_TOKENS = (12, 40)
MAX_TOKENS = (8, 16)
SQUEEZE_KEEP = 32           # pages each decode pool keeps allocatable under evict_under_load


class PrefixWorkload(Plan, ABC):
    """A prefix scenario's requests in phases, its actions around them and its judgement."""

    def __init__(self, cluster: ChaosCluster, maker: PromptMaker, scenario: str, n: int) -> None:
        self.cluster, self.maker, self.scenario = cluster, maker, scenario
        super().__init__(self.phases_for(n))

    @staticmethod
    @abstractmethod
    def count(n: int) -> int:
        """How many requests the workload sends when the run gives it `n`."""

    @abstractmethod
    def phases_for(self, n: int) -> list[Phase]:
        """The phases and their requests."""

    @abstractmethod
    def judge(self, res: ScenarioResult, logged: Logged) -> None:
        """Fill the row (faults, figures, violations) once every phase ran and the cluster is idle;
        `logged`: what the workers logged meanwhile."""

    def request(self, tenant: str, ids: list[int], canary: str, max_tokens: int, salt: str | None = None,
                stream: bool = True) -> Outcome:
        self.maker.n += 1
        return Outcome(Job(self.maker.n, self.scenario, tenant, canary, ids, max_tokens, stream=stream,
                           cache_salt=salt, usage=True))

    def prefix(self, length: int) -> tuple[list[int], str]:
        """A prompt head of `length` ids opened by a fresh canary, and the canary."""
        job = self.maker.job(self.scenario, length, 1)
        return job.ids, job.canary

    def suffix(self) -> list[int]:
        return self.maker.text(self.maker.rng.randint(*SUFFIX_TOKENS))

    def max_tokens(self) -> int:
        return self.maker.rng.randint(*MAX_TOKENS)

    def decode_workers(self) -> list[str]:
        return sorted(self.cluster.workers(Role.DECODE))


class CrossTenant(PrefixWorkload):
    PREFIX_TOKENS = 160      # 10 pages of 16
    # (tenant, cache_salt, which suffix, probe): probes send prompts only another cohort cached
    PHASES = (("acme", None, 0, False), ("globex", None, 0, True), ("globex", None, 1, False),
              ("acme", "probe-1", 0, True), ("acme", "probe-2", 0, True))

    @staticmethod
    def count(n: int) -> int:
        return len(CrossTenant.PHASES) * max(1, round(n / len(CrossTenant.PHASES)))

    def phases_for(self, n: int) -> list[Phase]:
        prompts = []
        for _ in range(self.count(n) // len(self.PHASES)):       # one distinct prefix per prompt
            head, canary = self.prefix(self.PREFIX_TOKENS)
            prompts.append((head, canary, (self.suffix(), self.suffix()), self.max_tokens()))
        return [Phase(f"{tenant}" + (f" cache_salt {salt}" if salt else ""),
                      [self.request(tenant, head + tails[which], canary, mt, salt, stream=i % 2 == 0)
                       for i, (head, canary, tails, mt) in enumerate(prompts)], probe)
                for tenant, salt, which, probe in self.PHASES]

    def judge(self, res: ScenarioResult, logged: Logged) -> None:
        size = self.cluster.ledger(self.decode_workers()[0]).page_size
        outs = [(i, o) for i, p in enumerate(self.phases) for o in p.outs]
        usage = [(i, o) for i, o in outs if o.cached_tokens is not None]
        done = [o for _, o in outs if o.outcome == "ok"]
        missing = [o for o in done if o.cached_tokens is None]
        if missing:
            res.violations.append(f"{len(missing)} of {len(done)} completed responses carry no "
                                  f"usage.prompt_tokens_details.cached_tokens")
        for i, o in usage:
            allowed = own_bound(o, [p for j, p in outs if j <= i], size)
            assert o.cached_tokens is not None
            if o.cached_tokens > allowed:
                res.violations.append(f"request {o.job.index} ({o.job.tenant}, cache_salt {o.job.cache_salt}, "
                                      f"phase {self.phases[i].name!r}) was served {o.cached_tokens} cached tokens; "
                                      f"its own cohort's requests share at most {allowed} with it (I10)")
        probes = [o for i, o in usage if self.phases[i].probe]
        res.faults_injected = len(probes)
        res.faults_detected = sum(o.cached_tokens == 0 for o in probes)
        self._same_tokens(res)
        own = [o for o in self.phases[2].outs if o.cached_tokens]
        res.figures.update(probe_requests=len(probes), probe_cached_tokens=sum(o.cached_tokens or 0 for o in probes),
                           own_hit_requests=len(own), own_hit_tokens=sum(o.cached_tokens or 0 for o in own))
        res.notes.append(f"{len(probes)} probe requests (globex, then acme under cache_salt probe-1 and probe-2, "
                         f"on prompts acme cached) served {res.figures['probe_cached_tokens']} cached tokens; "
                         f"globex's own repeat: {len(own)} of {len(self.phases[2].outs)} requests served "
                         f"{res.figures['own_hit_tokens']} cached tokens")
        if not own and self.phases[2].outs:
            res.violations.append("globex's repeat of its own prefixes was served no cached token: the cache "
                                  "never hit, so the probe shows nothing")

    def _same_tokens(self, res: ScenarioResult) -> None:
        """Every probe's tokens equal acme's first tokens for the same prompt (greedy)."""
        first = self.phases[0].outs
        for p in self.phases:
            if not p.probe:
                continue
            for a, b in zip(first, p.outs):
                if a.outcome == b.outcome == "ok" and a.token_ids != b.token_ids:
                    res.violations.append(f"request {b.job.index} ({p.name}) got tokens {b.token_ids[:12]}, acme's "
                                          f"request {a.job.index} for the same prompt {a.token_ids[:12]}")


class CachePoison(PrefixWorkload):
    PREFIX_TOKENS = 128      # 8 pages

    MIN_POISONED = 4         # requests in the poisoned phase at least (a delta transfer to aim at)

    @staticmethod
    def count(n: int) -> int:
        return 2 * max(1, n // 4) + max(n, CachePoison.MIN_POISONED)

    def phases_for(self, n: int) -> list[Phase]:
        self.snapshot: dict[str, dict[int, tuple[int, str]]] = {}
        k = max(1, n // 4)
        heads = [self.prefix(self.PREFIX_TOKENS) for _ in range(k)]

        def round_(count: int) -> list[Outcome]:
            return [self.request(VICTIMS[j % k % len(VICTIMS)], heads[j % k][0] + self.suffix(), heads[j % k][1],
                                 self.max_tokens(), stream=j % 2 == 0) for j in range(count)]
        return [Phase("warm-up", round_(k)), Phase("poisoned", round_(max(n, self.MIN_POISONED))),
                Phase("after", round_(k))]

    def before(self, index: int, res: ScenarioResult) -> None:
        """Before the poisoned phase (its scenario arms `poison_cached` for it): hash every cached page."""
        if index == 1:
            self.snapshot = {w: self.cluster.call(w, "cache_pages") for w in self.decode_workers()}

    def judge(self, res: ScenarioResult, logged: Logged) -> None:
        checked = changed = 0
        for w in self.decode_workers():
            c, bad = digests_changed(self.snapshot.get(w, {}), self.cluster.call(w, "cache_pages"))
            checked, changed = checked + c, changed + len(bad)
            for page in bad[:5]:
                res.violations.append(f"{w}: cached page {page} changed while the poisoned frames were refused")
        after = [o for o in self.phases[2].outs if o.cached_tokens]
        res.figures.update(cached_pages_checked=checked, cached_pages_changed=changed,
                           after_hit_requests=len(after), after_hit_tokens=sum(o.cached_tokens or 0 for o in after))
        res.notes.append(f"{checked} cached pages hashed before and after the poisoned frames: {changed} changed; "
                         f"afterwards {len(after)} of {len(self.phases[2].outs)} requests were served "
                         f"{res.figures['after_hit_tokens']} cached tokens of the prefixes")


class EvictUnderLoad(PrefixWorkload):
    PREFIX_TOKENS = 96       # 6 pages
    PREFIXES = 3

    @staticmethod
    def count(n: int) -> int:
        return max(n, 16)

    def phases_for(self, n: int) -> list[Phase]:
        self.squeezed: dict[str, dict[str, int]] = {}
        self.watch: PoolWatch | None = None
        self.base: dict[str, int] = {}
        self.squeeze_evictions = 0
        heads = [self.prefix(self.PREFIX_TOKENS) for _ in range(self.PREFIXES)]
        return [Phase("squeezed", [self.request(VICTIMS[j % len(heads) % len(VICTIMS)], heads[j % len(heads)][0]
                                                + self.suffix(), heads[j % len(heads)][1], self.max_tokens(),
                                                stream=j % 2 == 0) for j in range(self.count(n))])]

    def before(self, index: int, res: ScenarioResult) -> None:
        workers = self.decode_workers()
        pre = {w: self.cluster.call(w, "pool_state")["evictions"] for w in workers}
        self.squeezed = {w: self.cluster.call(w, "squeeze", keep_pages=SQUEEZE_KEEP) for w in workers}
        self.base = {w: self.cluster.call(w, "pool_state")["evictions"] for w in workers}
        self.squeeze_evictions = sum(self.base[w] - pre[w] for w in workers)
        self.watch = PoolWatch(self.cluster, self.decode_workers()).start()

    def end(self, res: ScenarioResult) -> None:
        if self.watch is not None:
            self.watch.stop()
        for w in self.squeezed:
            self.cluster.call(w, "unsqueeze")

    def judge(self, res: ScenarioResult, logged: Logged) -> None:
        """Injected: the cached pages the requests' allocations evicted (not those the squeeze
        itself evicted); tolerated, as long as every response is exact and the pools idle clean."""
        res.tolerated = True
        evicted = sum(self.cluster.call(w, "pool_state")["evictions"] - base for w, base in self.base.items())
        res.faults_injected = evicted
        hits = [o for o in self.outcomes if o.cached_tokens]
        res.figures.update(evictions=evicted, squeeze_evictions=self.squeeze_evictions, hit_requests=len(hits),
                           hit_tokens=sum(o.cached_tokens or 0 for o in hits),
                           squeezed_pages=sum(s["held"] for s in self.squeezed.values()))
        if self.watch is not None:
            res.figures.update(peak_referenced_cached=self.watch.peak, evictions_while_referenced=self.watch.evicted,
                               pool_readings=self.watch.readings)
        res.notes.append(f"decode pools squeezed to {SQUEEZE_KEEP} allocatable pages ("
                         + ", ".join(f"{w} held {s['held']}" for w, s in sorted(self.squeezed.items()))
                         + f", evicting {res.figures['squeeze_evictions']} cached pages); the requests then evicted "
                         f"{evicted}; {len(hits)} of {len(self.outcomes)} requests were served "
                         f"{res.figures['hit_tokens']} cached tokens; {res.figures.get('evictions_while_referenced')} "
                         f"evictions seen between two readings of a pool in which requests held cached pages (at "
                         f"most {res.figures.get('peak_referenced_cached')} at once, "
                         f"{res.figures.get('pool_readings')} readings)")
        if not evicted:
            res.violations.append("the requests evicted no cached page: the scenario did not run under eviction")


class PoolWatch:
    """Reads the decode workers' pools (`pool_state`) every `every_s` in a thread of its own, from
    `start` to `stop`: the most cached pages requests held at once, and the evictions that
    happened between two readings of a pool in which requests held cached pages."""

    def __init__(self, cluster: ChaosCluster, workers: list[str], every_s: float = 0.05) -> None:
        self.cluster, self.workers, self.every_s = cluster, workers, every_s
        self.peak = self.evicted = self.readings = 0
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-pool-watch", daemon=True)

    def start(self) -> PoolWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._halt.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        last: dict[str, tuple[int, int]] = {}          # worker -> (evictions, cached pages held)
        while not self._halt.wait(self.every_s):
            for w in self.workers:
                s = self.cluster.call(w, "pool_state")
                held = s["used"] - s["private"]
                self.peak, self.readings = max(self.peak, held), self.readings + 1
                if w in last and s["evictions"] > last[w][0] and (held or last[w][1]):
                    self.evicted += s["evictions"] - last[w][0]
                last[w] = (s["evictions"], held)


@dataclass(frozen=True)
class Phased:
    """A prefix workload as a scenario's workload (chaos.scenario.Workload): `kind` plans the
    phases of each run."""
    kind: type[PrefixWorkload]

    def count(self, n: int) -> int:
        return self.kind.count(n)

    def plan(self, stage: Stage, scenario: str, n: int) -> Plan:
        return self.kind(stage.cluster, stage.maker, scenario, n)
