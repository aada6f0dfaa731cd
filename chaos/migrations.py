"""What the gateway says about migrations, read from its Prometheus `/metrics` as an operator
would: migrations by cause, failed ones by reason, the prefill tokens they cost, and the gap
they add to a stream (the `tandem_migration_gap_seconds` histogram: from the last token before
the break to the first after it, measured in the gateway).  A scenario reads it before and
after and keeps the difference; the gap's percentiles are interpolated linearly within the
histogram's buckets (Prometheus' `histogram_quantile`), so they are estimates at the buckets'
resolution, never finer."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from chaos.gauges import Metrics, scrape

MIGRATIONS = "tandem_migrations_total"
FAILED = "tandem_migrations_failed_total"
PREFILL_TOKENS = "tandem_migration_prefill_tokens_total"
GAP = "tandem_migration_gap_seconds"
CAUSES = ("lost", "drain", "error")


@dataclass
class MigrationCounts:
    """The gateway's migration counters at one moment (or the difference of two readings)."""
    by_cause: dict[str, float] = field(default_factory=dict)
    failed: dict[str, float] = field(default_factory=dict)
    prefill_tokens: float = 0.0
    gap_buckets: dict[float, float] = field(default_factory=dict)    # upper bound -> cumulative count

    @property
    def total(self) -> int:
        return int(sum(self.by_cause.values()))

    def __sub__(self, before: MigrationCounts) -> MigrationCounts:
        """What grew from `before` to this reading (a counter that went down — a gateway
        restarted — counts from zero)."""
        def grew(now: dict, then: dict) -> dict:
            return {k: v - then.get(k, 0.0) if v >= then.get(k, 0.0) else v for k, v in now.items()}
        tokens = self.prefill_tokens - before.prefill_tokens
        return MigrationCounts(grew(self.by_cause, before.by_cause), grew(self.failed, before.failed),
                               tokens if tokens >= 0 else self.prefill_tokens,
                               grew(self.gap_buckets, before.gap_buckets))

    def gap(self, q: float) -> float | None:
        """The gap's `q` quantile (0 < q < 1) in seconds, None without an observation."""
        return bucket_quantile(self.gap_buckets, q)

    def figures(self) -> dict[str, float | None]:
        """The row's figures: migrations (all, and by cause), failed ones, the prefill tokens
        they cost, and the gap's count, p50 and p99 (interpolated within buckets)."""
        out: dict[str, float | None] = {"migrations": float(self.total)}
        for cause in sorted(set(CAUSES) | set(self.by_cause)):
            out[f"migrations_{cause}"] = self.by_cause.get(cause, 0.0)
        out["migrations_failed"] = float(sum(self.failed.values()))
        out["migration_prefill_tokens"] = self.prefill_tokens
        out["migration_gap_count"] = self.gap_buckets.get(math.inf, 0.0)
        for name, q in (("p50", 0.5), ("p99", 0.99)):
            g = self.gap(q)
            out[f"migration_gap_{name}_s"] = None if g is None else round(g, 4)
        return out

    def summary(self) -> str:
        """One line for the row's notes."""
        causes = ", ".join(f"{n:.0f} {c}" for c, n in sorted(self.by_cause.items()) if n) or "none"
        failed = ", ".join(f"{n:.0f} {r}" for r, n in sorted(self.failed.items()) if n) or "none"
        p50, p99 = self.gap(0.5), self.gap(0.99)
        gap = "no gap observed" if p50 is None or p99 is None else \
            f"gap p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms over {self.gap_buckets.get(math.inf, 0):.0f} " \
            f"(interpolated within the gateway histogram's buckets)"
        return (f"gateway migrations: {causes}; failed: {failed}; re-prefill computed "
                f"{self.prefill_tokens:.0f} tokens; {gap}")


def read(samples: Metrics) -> MigrationCounts:
    """The migration counters in one scrape of the gateway's /metrics (zeros when absent)."""
    out = MigrationCounts()
    for (name, labels), value in samples.items():
        lab = dict(labels)
        if name == MIGRATIONS:
            cause = lab.get("cause", "")
            out.by_cause[cause] = out.by_cause.get(cause, 0.0) + value
        elif name == FAILED:
            reason = lab.get("reason", "")
            out.failed[reason] = out.failed.get(reason, 0.0) + value
        elif name == PREFILL_TOKENS:
            out.prefill_tokens += value
        elif name == GAP + "_bucket" and "le" in lab:
            le = math.inf if lab["le"] in ("+Inf", "Inf", "inf") else float(lab["le"])
            out.gap_buckets[le] = out.gap_buckets.get(le, 0.0) + value
    return out


def bucket_quantile(buckets: dict[float, float], q: float) -> float | None:
    """The `q` quantile of a histogram given as upper bound -> cumulative count (+Inf the
    total), interpolated linearly within the bucket it falls in, from the bucket below's upper
    bound (0 for the first); in the +Inf bucket it is the highest finite bound.  None when the
    histogram holds nothing."""
    bounds = sorted(buckets)
    total = buckets.get(math.inf, max(buckets.values(), default=0.0))
    if total <= 0 or not bounds:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank and count > below:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def now(url: str) -> MigrationCounts:
    """The gateway's migration counters now (zeros when it does not answer)."""
    return read(scrape(url))
