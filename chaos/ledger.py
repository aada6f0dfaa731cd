"""The workers' chaos ledgers, typed: one worker's reading (`Ledger`, from
`ChaosControl.ledger` through the chaos actor) and what every worker logged between two
readings (`Logged`), which a scenario's rules judge from."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Entry = tuple[str, str]


def _entries(raw: Iterable[Any]) -> tuple[Entry, ...]:
    return tuple((str(a), str(b)) for a, b in raw)


@dataclass(frozen=True)
class Ledger:
    """One worker's ledger at one moment."""
    pid: int                             # its process: another one after Ray restarted it
    page_size: int = 0                   # tokens per KV page of its pool
    injected: tuple[Entry, ...] = ()     # (point, victim): a transfer id, or where an expert slot was flipped
    refusals: tuple[Entry, ...] = ()     # (transfer id, refusal code): a receiver's, in order
    failures: tuple[Entry, ...] = ()     # (transfer id, why it failed): a receiver's, in order
    corrupt_slots: int = 0               # expert slots the guard found corrupted
    accepted_bytes: int = 0              # KV bytes its receiver accepted
    counts: Mapping[str, int] = field(default_factory=dict)   # request counters: reserved, submitted, ...

    @classmethod
    def read(cls, raw: Mapping[str, Any]) -> Ledger:
        """From `ChaosControl.ledger`'s dict (a prefill worker has no receiver: no refusals,
        failures or accepted bytes)."""
        return cls(int(raw["pid"]), int(raw["page_size"]), _entries(raw.get("injected", ())),
                   _entries(raw.get("refusals", ())), _entries(raw.get("failures", ())), int(raw["corrupt_slots"]),
                   int(raw.get("accepted_bytes", 0)), {str(k): int(v) for k, v in raw["counts"].items()})


NOTHING = Ledger(pid=-1)


@dataclass
class Logged:
    """What every worker logged between two readings of their ledgers."""
    injected: list[Entry] = field(default_factory=list)
    refusals: list[Entry] = field(default_factory=list)
    failures: list[Entry] = field(default_factory=list)
    corrupt_slots: int = 0
    reserved: int = 0                    # reservations made
    submitted: int = 0                   # prefill submissions
    accepted_bytes: int = 0

    @classmethod
    def between(cls, before: Mapping[str, Ledger], after: Mapping[str, Ledger]) -> Logged:
        """Summed over the workers of `after`; a worker missing from `before`, or running in
        another process since (Ray restarted it), counts from zero."""
        out = cls()
        for wid, a in after.items():
            b = before.get(wid, NOTHING)
            if b.pid != a.pid:
                b = NOTHING
            out.injected += a.injected[len(b.injected):]
            out.refusals += a.refusals[len(b.refusals):]
            out.failures += a.failures[len(b.failures):]
            out.corrupt_slots += a.corrupt_slots - b.corrupt_slots
            out.accepted_bytes += a.accepted_bytes - b.accepted_bytes
            out.reserved += a.counts.get("reserved", 0) - b.counts.get("reserved", 0)
            out.submitted += a.counts.get("submitted", 0) - b.counts.get("submitted", 0)
        return out

    def victims(self, point: str) -> list[str]:
        """The victims of `point`'s injections, in order."""
        return [victim for p, victim in self.injected if p == point]
