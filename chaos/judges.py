"""How scenarios are judged: the rules a scenario's row lists (chaos.scenario.Rule).  Each fills
the row's fault counts (injected, detected or tolerated) from the `Evidence` the run gathered
(what the workers logged, what the driver did) and adds its violations; the report's
accounting rule then turns a fault neither detected nor tolerated into a violation."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chaos.drivers import Strike
from chaos.moving import Move, MoveKind
from chaos.report import ScenarioResult
from chaos.scenario import Evidence, Scenario

if TYPE_CHECKING:
    from chaos.client import Outcome

LATE = ("EXPIRED", "AFTER_FAILURE", "UNKNOWN_TRANSFER")       # a write after the decode side gave up
PROCESS_DETECT = ("STREAM_CLOSED", "TRANSPORT", "CANCELLED", "EXPIRED")   # a transfer whose sender died


@dataclass(frozen=True, init=False)
class Refusals:
    """Each injection of the scenario's armed point is detected by one refusal of its transfer
    with one of `codes` (matched by transfer id in the decode workers' refusal logs)."""
    codes: tuple[str, ...]

    def __init__(self, *codes: str) -> None:
        object.__setattr__(self, "codes", codes)

    def judge(self, sc: Scenario, res: ScenarioResult, ev: Evidence) -> None:
        assert sc.faults is not None   # refusals answer for the injections of an armed point
        match(res, sc.faults.point, ev.logged.victims(sc.faults.point), ev.logged.refusals, self.codes)


@dataclass(frozen=True)
class KilledTransfers:
    """Each transfer a driver's kill cut is detected by the decode side failing it."""

    def judge(self, sc: Scenario, res: ScenarioResult, ev: Evidence) -> None:
        kills = [r for r in ev.records if isinstance(r, Strike)]
        match(res, sc.name, [k.victim for k in kills], ev.logged.failures, PROCESS_DETECT)


@dataclass(frozen=True)
class SlotsRepaired:
    """Each expert slot a driver flipped is found by the workers' slot checks."""

    def judge(self, sc: Scenario, res: ScenarioResult, ev: Evidence) -> None:
        res.faults_injected = len(ev.records)
        res.faults_detected = ev.logged.corrupt_slots
        if res.faults_detected != res.faults_injected:
            res.violations.append(f"{res.faults_injected} expert slots corrupted, "
                                  f"{res.faults_detected} found by the slot checks")


@dataclass(frozen=True)
class RefusedAtDoor:
    """Every request is an oversized prompt: refused with HTTP 400 naming the limit, and none
    reached a worker (no reservation, prefill submission or KV byte while they ran: I1)."""

    def judge(self, sc: Scenario, res: ScenarioResult, ev: Evidence) -> None:
        res.faults_injected = res.requests
        res.faults_detected = sum(o.outcome == "error" and o.status == 400 and str(ev.limit) in o.error
                                  for o in res.outcomes)
        if res.faults_detected != res.requests:
            res.violations.append(f"{res.requests - res.faults_detected} oversized prompts were not "
                                  f"refused with HTTP 400 naming the limit {ev.limit}")
        new = ev.logged
        leaked = {k: v for k, v in (("reservations", new.reserved), ("prefill submissions", new.submitted),
                                    ("KV bytes accepted", new.accepted_bytes)) if v}
        if leaked:
            res.violations.append(f"oversized prompts reached workers (I1): {leaked}")
        res.notes.append(f"reservations {new.reserved}, prefill submissions {new.submitted}, "
                         f"KV bytes accepted {new.accepted_bytes} while they ran")


@dataclass(frozen=True)
class AtLimitCompletes:
    """Every prompt exactly at the limit completes."""

    def judge(self, sc: Scenario, res: ScenarioResult, ev: Evidence) -> None:
        if res.completed != res.requests:
            res.violations.append(f"{res.requests - res.completed} prompts exactly at the limit "
                                  f"({ev.limit} tokens with max_tokens) did not complete")


@dataclass(frozen=True)
class Lossless:
    """Every request completes: none may fail, go silent or be cut (migration continues them)."""

    def judge(self, sc: Scenario, res: ScenarioResult, ev: Evidence) -> None:
        lost = res.failed_explicitly + res.silent + res.aborted
        if lost:
            res.violations.append(f"{lost} of {res.requests} requests did not complete ({res.failed_explicitly} "
                                  f"failed, {res.silent} silent, {res.aborted} aborted): none may, their streams "
                                  f"migrate")


@dataclass(frozen=True)
class ToleratedInjections:
    """Every injection of the armed point is one a healthy cluster absorbs (a stalled receiver)."""

    def judge(self, sc: Scenario, res: ScenarioResult, ev: Evidence) -> None:
        assert sc.faults is not None   # the injections of an armed point
        res.faults_injected = len(ev.logged.victims(sc.faults.point))
        res.tolerated = True


@dataclass(frozen=True)
class ToleratedHangUps:
    """Every client hang-up is a fault a healthy cluster absorbs (its pages must come back)."""

    def judge(self, sc: Scenario, res: ScenarioResult, ev: Evidence) -> None:
        res.faults_injected = res.aborted
        res.tolerated = True


@dataclass(frozen=True)
class Moves:
    """The kills or drains of a moving driver (chaos.moving), `count` of them when it does its
    whole job (None: one per decode worker).  Each is one injected fault:

    - detected: the gateway continued the worker's streams elsewhere (its migrations grew, by
      any cause for a kill, by cause "drain" for a drain);
    - tolerated: a drain whose every stream finished within the grace (nothing to migrate);
    - otherwise neither, which the report's accounting rule turns into a violation.

    A drain that made the gateway see broken streams (cause "lost") cut them instead of
    draining them: a violation; so is a second kill that hit a worker holding no migrated
    stream, and a driver that made fewer moves than `count`."""
    count: int | None

    def judge(self, sc: Scenario, res: ScenarioResult, ev: Evidence) -> None:
        moves = [r for r in ev.records if isinstance(r, Move)]
        res.faults_injected = len(moves)
        by_index = {o.job.index: o for o in res.outcomes}
        for m in moves:
            _judge_move(res, m, [by_index[i] for i in m.victims if i in by_index])
        want = self.count or ev.decode_workers
        if len(moves) < want:
            res.violations.append(f"the driver made {len(moves)} of its {want} kills or drains: the requests "
                                  f"ended (or no worker held a stream mid-way) first")
        for m in moves:
            if m.kind is MoveKind.KILL_MIGRATED and not m.held_resumed:
                res.violations.append(f"the second kill hit {m.worker} holding no migrated stream")


def _judge_move(res: ScenarioResult, m: Move, victims: list[Outcome]) -> None:
    """One kill or drain: its note, whether it was detected or tolerated, a drain that cut streams."""
    ends = Counter(o.outcome for o in victims)
    moved = {c: int(n) for c, n in m.migrated.items() if n}
    drain = m.kind.drains
    reply = m.reply or {}
    res.notes.append(
        f"{'drained' if drain else 'killed'} {m.worker} holding {m.held} streams mid-way "
        f"({m.held_resumed} of them migrated there)"
        + ((f", drain answer {reply}" if reply else ", no drain answer (the actor restarted first)") if drain
           else "")
        + f"; the gateway migrated {sum(moved.values())} ({_causes(moved)}); the cluster was back after "
          f"{m.recovered_s} s; the {len(victims)} streams mid-way then ended: "
        + (", ".join(f"{n} {k}" for k, n in sorted(ends.items())) or "-"))
    if drain and moved.get("lost"):
        res.violations.append(f"draining {m.worker} cut {moved['lost']} streams (the gateway saw them "
                              f"lost, not drained)")
    if moved.get("drain", 0) if drain else sum(moved.values()):
        res.faults_detected += 1
    elif drain and reply.get("drained") == 0:
        res.faults_tolerated += 1
        res.notes.append(f"every stream on {m.worker} finished within the grace: nothing to migrate")


def _causes(moved: dict[str, int]) -> str:
    return ", ".join(f"{n} {c}" for c, n in sorted(moved.items())) or "none"


def match(res: ScenarioResult, point: str, victims: list[str], seen: list[tuple[str, str]],
          expect: tuple[str, ...]) -> None:
    """Each injection is detected by one refusal (or failure) of its transfer with an expected
    code; each refusal answers for one injection only."""
    pool: dict[str, list[str]] = defaultdict(list)
    for tid, reason in seen:
        pool[tid].append(reason)
    res.faults_injected = len(victims)
    for tid in victims:
        hit = next((r for r in pool[tid] if r in expect), None)
        if hit is None:
            res.violations.append(f"{point} on transfer {tid[:16]} was not detected "
                                  f"(its refusals: {pool[tid] or 'none'}; expected one of {list(expect)})")
            continue
        pool[tid].remove(hit)
        res.faults_detected += 1
