"""A chaos run's results: one row per scenario, the totals, the table and the JSON."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chaos.client import Outcome


@dataclass
class ScenarioResult:
    name: str
    group: str
    about: str
    requests: int = 0
    completed: int = 0
    failed_explicitly: int = 0
    aborted: int = 0
    silent: int = 0                  # ended with neither a completion nor an explicit error
    faults_injected: int = 0
    faults_detected: int = 0
    tolerated: bool = False          # every fault is one a healthy cluster absorbs (stalls, hang-ups)
    faults_tolerated: int = 0        # of a row not wholly tolerated: the faults its rule lets pass
    near_ties: int = 0               # tokens that differ from the reference where its top two tie (1e-5)
    leaks: int = 0                   # responses carrying another request's canary
    corrupted: int = 0               # responses whose tokens differ from the reference run
    pages_leaked: int = 0
    seconds: float = 0.0
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    figures: dict[str, float | None] = field(default_factory=dict)   # measurements (hostile: TTFT, RSS)
    outcomes: list[Outcome] = field(default_factory=list, repr=False)
    other_texts: list[str] = field(default_factory=list, repr=False)  # what an attacker was sent: no canary

    def tally(self, outs: list[Outcome]) -> None:
        self.requests = len(outs)
        errors = [o.error for o in outs if o.outcome == "error"]
        codes = Counter(e.split(":")[0] for e in errors)
        if codes:
            self.notes.append("explicit errors: " + ", ".join(f"{n} {c}" for c, n in codes.most_common())
                              + f" (e.g. {errors[0][:160]!r})")
        for o in outs:
            if o.outcome == "ok":
                self.completed += 1
            elif o.outcome == "error":
                self.failed_explicitly += 1
            elif o.outcome == "aborted":
                self.aborted += 1
            else:
                self.silent += 1
                if len(self.violations) < 20:
                    self.violations.append(f"request {o.job.index} ended without a completion or an "
                                           f"explicit error (I8): {o.error or 'no end'}")
            if o.job.expect_reject and o.outcome == "ok":
                self.violations.append(f"request {o.job.index}: an oversized prompt of {len(o.job.ids)} "
                                       f"tokens completed (I1)")

    def check_pools(self, checks: dict[str, dict]) -> None:
        """I6 at idle: no page held by a request (private, or cached and still referenced); the
        other pages are free or cached and evictable, and the pool's integrity holds."""
        for wid, c in checks.items():
            self.pages_leaked += c["used"]
            if c["used"]:
                private = c.get("private", c["used"])
                self.violations.append(f"{wid}: {c['used']} KV pages still held at idle (I6): {private} private, "
                                       f"{c['used'] - private} cached and still referenced")
            if c["integrity"]:
                self.violations.append(f"{wid}: pool integrity: {c['integrity']}")

    @property
    def tolerated_count(self) -> int:
        """The faults counted as tolerated: all of a tolerated row's, else `faults_tolerated`."""
        return self.faults_injected if self.tolerated else self.faults_tolerated

    @property
    def unaccounted(self) -> int:
        """Injected faults neither detected nor tolerated (each must be one or the other)."""
        detected = 0 if self.tolerated else self.faults_detected
        return max(0, self.faults_injected - detected - self.tolerated_count)

    def account(self) -> None:
        """The accounting rule: every injected fault is detected, or tolerated where the
        scenario says so; one that is neither is a violation."""
        if self.unaccounted:
            self.violations.append(f"{self.unaccounted} of {self.faults_injected} injected faults were neither "
                                   f"detected ({0 if self.tolerated else self.faults_detected}) nor tolerated "
                                   f"({self.tolerated_count})")

    @property
    def ok(self) -> bool:
        return not (self.violations or self.leaks or self.corrupted or self.pages_leaked or self.unaccounted)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("outcomes", "other_texts")}
        d["faults_detected"] = None if self.tolerated else self.faults_detected
        d["faults_tolerated"] = self.tolerated_count
        d["faults_unaccounted"] = self.unaccounted
        d["ok"] = self.ok
        return d


def totals(results: list[ScenarioResult], seed: int, seconds: float) -> dict:
    transfer = [r for r in results if r.group == "transfer"]
    return {
        "requests": sum(r.requests for r in results),
        "completed": sum(r.completed for r in results),
        "failed_explicitly": sum(r.failed_explicitly for r in results),
        "aborted": sum(r.aborted for r in results),
        "silent": sum(r.silent for r in results),
        "faults_injected": sum(r.faults_injected for r in results),
        "faults_detected": sum(r.faults_detected for r in results if not r.tolerated),
        "faults_tolerated": sum(r.tolerated_count for r in results),
        "faults_unaccounted": sum(r.unaccounted for r in results),
        "transfer_faults_injected": sum(r.faults_injected for r in transfer),
        "transfer_faults_detected": sum(r.faults_detected for r in transfer),
        "leaks": sum(r.leaks for r in results),
        "corrupted_completions": sum(r.corrupted for r in results),
        "near_ties": sum(r.near_ties for r in results),
        "pages_leaked": sum(r.pages_leaked for r in results),
        "violations": sum(len(r.violations) for r in results),
        "ok": all(r.ok for r in results),
        "seed": seed,
        "seconds": round(seconds, 1),
        "hostile_ttft": {r.name: {k: v for k, v in r.figures.items() if k.startswith("ttft")}
                         for r in results if r.group == "hostile"},
        "migrations": {r.name: {k: v for k, v in r.figures.items() if k.startswith("migration")}
                       for r in results if any(k.startswith("migration") for k in r.figures)},
        "scenarios": [r.as_dict() for r in results],
    }


COLUMNS = [("scenario", 18), ("injected", 8), ("detected", 8), ("tolerated", 9), ("completed", 9), ("failed", 6),
           ("aborted", 7), ("leaks", 5), ("corrupt", 7), ("ties", 4), ("pages", 5), ("migrated", 8),
           ("gap p50/p99", 15), ("ok", 3)]


def table(results: list[ScenarioResult]) -> str:
    head = "  ".join(f"{n:>{w}}" if i else f"{n:<{w}}" for i, (n, w) in enumerate(COLUMNS))
    lines = [head, "-" * len(head)]
    for r in results:
        f = r.figures
        cells = [r.name, r.faults_injected, "-" if r.tolerated else r.faults_detected, r.tolerated_count,
                 r.completed, r.failed_explicitly, r.aborted, r.leaks, r.corrupted, r.near_ties, r.pages_leaked,
                 _int(f.get("migrations")), _gap(f), "yes" if r.ok else "NO"]
        lines.append("  ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS))))
    for r in results:
        for v in r.violations[:10]:
            lines.append(f"VIOLATION {r.name}: {v}")
        for note in r.notes:
            lines.append(f"note {r.name}: {note}")
    return "\n".join(lines)


def _int(x: float | None) -> str:
    return "" if x is None else str(int(x))


def _gap(f: dict[str, float | None]) -> str:
    """The migration gap's p50/p99 in ms (interpolated within the gateway histogram's buckets)."""
    if "migration_gap_p50_s" not in f:
        return ""
    p50, p99 = f["migration_gap_p50_s"], f.get("migration_gap_p99_s")
    return "-" if p50 is None or p99 is None else f"{p50 * 1000:.0f}/{p99 * 1000:.0f} ms"
