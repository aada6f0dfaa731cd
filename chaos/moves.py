"""Judging the scenarios whose streams move: a decode worker killed (once, or twice with the
second kill aimed at a worker serving a migrated stream) or drained while streams are mid-way.
Each kill or drain is one injected fault, recorded by its driver (chaos.drivers) with what the
gateway's migration counters did across it:

- detected: the gateway continued the worker's streams elsewhere (its migrations grew, by any
  cause for a kill, by cause "drain" for a drain);
- tolerated: a drain whose every stream finished within the grace (nothing left to migrate);
- otherwise neither, which the report's accounting rule turns into a violation.

A drain that made the gateway see broken streams (cause "lost") cut them instead of draining
them: a violation.  Whether every request completed, and with the reference's tokens, is judged
by the scenario's `lossless` rule and the oracles."""

from __future__ import annotations

from collections import Counter

from chaos.report import ScenarioResult

# driver -> the faults it injects when it does its whole job (None: one per decode worker)
MOVING: dict[str, int | None] = {"kill_decode": 1, "kill_decode_twice": 2, "drain_decode": None}


def moved_streams(res: ScenarioResult, records: list[dict], want: int) -> None:
    """Account for a moving scenario's kills or drains (`records`, from its driver) in `res`,
    whose outcomes are the scenario's requests; `want`: the faults the driver should inject."""
    res.faults_injected = len(records)
    by_index = {o.job.index: o for o in res.outcomes}
    for r in records:
        victims = [by_index[i] for i in r.get("victim", []) if i in by_index]
        ends = Counter(o.outcome for o in victims)
        moved = {c: int(n) for c, n in r.get("migrated", {}).items() if n}
        drain = r["point"] == "drain_decode"
        reply = r.get("reply") or {}
        res.notes.append(
            f"{'drained' if drain else 'killed'} {r['worker']} holding {r['held']} streams mid-way "
            f"({r['held_resumed']} of them migrated there)"
            + ((f", drain answer {reply}" if reply else ", no drain answer (the actor restarted first)") if drain
               else "")
            + f"; the gateway migrated {sum(moved.values())} ({_causes(moved)}); the cluster was back after "
              f"{r.get('recovered_s')} s; the {len(victims)} streams mid-way then ended: "
            + (", ".join(f"{n} {k}" for k, n in sorted(ends.items())) or "-"))
        if drain and moved.get("lost"):
            res.violations.append(f"draining {r['worker']} cut {moved['lost']} streams (the gateway saw them "
                                  f"lost, not drained)")
        if moved.get("drain", 0) if drain else sum(moved.values()):
            res.faults_detected += 1
        elif drain and reply.get("drained") == 0:
            res.faults_tolerated += 1
            res.notes.append(f"every stream on {r['worker']} finished within the grace: nothing to migrate")
    if len(records) < want:
        res.violations.append(f"the driver made {len(records)} of its {want} kills or drains: the requests "
                              f"ended (or no worker held a stream mid-way) first")
    for r in records:
        if r["point"] == "kill_migrated" and not r["held_resumed"]:
            res.violations.append(f"the second kill hit {r['worker']} holding no migrated stream")


def _causes(moved: dict[str, int]) -> str:
    return ", ".join(f"{n} {c}" for c, n in sorted(moved.items())) or "none"
