"""The moving drivers (chaos.scenario.Driver): kill a decode worker (`KillDecode`), kill it and
then the worker its streams migrated to (`KillDecodeTwice`), or drain every decode worker in
turn (`DrainDecode`), while streams are mid-way.  Each returns a `Move` per kill or drain,
with what the gateway's migration counters did across it (judged by chaos.judges.Moves).

What they exercise must not depend on the machine's speed or load:

- streams last: every decode worker is paced (`_pace`) before the first request goes out, so a
  stream stays mid-way long enough for the driver to see it over Ray, even on a loaded machine,
  and long enough to outlive a drain's grace;
- load lasts: when every request sent so far ended before the driver found what it waits for,
  it sends the next wave (`_held`; a scenario has a wave to spare), to idle workers, which the
  gateway's least-loaded routing shares out: the worker a rolling drain needs next gets streams.

A driver that still could not make its moves says so in the report (chaos.judges.Moves): a
violation."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from chaos import migrations
from chaos.client import Outcome
from chaos.cluster import ChaosCluster
from chaos.drivers import Waves
from worker.types import Role

PACE_S = 0.08          # the moving drivers pace every decode worker at this or slower per decode step
MIN_LEFT = 16          # a stream counts as mid-way while it may still generate this many tokens
DRAIN_GRACE_S = 0.5    # drain_decode's grace: short streams finish in it, the others migrate
SETTLE_S = 0.5         # from the last request's end to the next wave: the gateway counts it off its worker
# paced, a stream mid-way runs MIN_LEFT * PACE_S = 1.3 s or more: longer than a drain's grace and the
# driver's calls before it, so a drain finds it and migrates it

Held = tuple[str, list[dict[str, int]], list[int]]     # worker, its streams mid-way, the client's then


class MoveKind(StrEnum):
    """What a moving driver did to a decode worker."""
    KILL = "kill_decode"                 # killed it (Ray restarts it)
    KILL_MIGRATED = "kill_migrated"      # killed the worker a first kill's streams migrated to
    DRAIN = "drain_decode"               # drained it, then restarted it

    @property
    def drains(self) -> bool:
        return self is MoveKind.DRAIN


@dataclass
class Move:
    """One kill or drain of a decode worker while streams were mid-way."""
    kind: MoveKind
    worker: str
    victims: list[int]          # the requests (job index) mid-stream at that moment, on any worker
    held: int                   # streams mid-way on the worker
    held_resumed: int           # of them, streams that had migrated there
    t0: float = 0.0             # when the kill or drain began (time.monotonic)
    reply: dict[str, Any] | None = None       # a drain's answer (None: none, the actor restarted first)
    recovered_s: float | None = None          # from t0 until the cluster was whole again
    migrated: dict[str, float] = field(default_factory=dict)   # the gateway's migrations across it, by cause


@dataclass(frozen=True)
class KillDecode:
    """Wait until several streams are mid-way, then kill the decode worker holding the most
    work of them (Ray restarts it; the gateway continues its streams on the other worker).  The
    move's victims are the requests mid-stream at that moment, on either worker."""
    wait_s: float = 60.0

    async def drive(self, cluster: ChaosCluster, live: list[Outcome], done: asyncio.Event, rng: random.Random,
                    waves: Waves) -> list[Move]:
        struck = await _first_kill(cluster, live, done, waves, self.wait_s)
        if struck is None:
            return []
        move, pid, before = struck
        await _settle(cluster, move, pid, before)
        return [move]


@dataclass(frozen=True)
class KillDecodeTwice:
    """`KillDecode`, then, while the killed worker restarts, kill the worker its streams
    migrated to as soon as one of them streams there again (the worker says it was resumed):
    that request migrates a second time, with no decode worker up for a while (the gateway
    waits for one to come back).  The first kill catches its streams early (they are paced),
    so they migrate with most of their tokens still to come, slowly again on the paced worker."""
    wait_s: float = 60.0

    async def drive(self, cluster: ChaosCluster, live: list[Outcome], done: asyncio.Event, rng: random.Random,
                    waves: Waves) -> list[Move]:
        struck = await _first_kill(cluster, live, done, waves, self.wait_s)
        if struck is None:
            return []
        first, pid, before = struck
        others = [w for w in sorted(cluster.workers(Role.DECODE)) if w != first.worker]
        again = await _held(cluster, live, done, waves, self.wait_s, among=others, migrated=True, feed=False)
        if again is None:
            await _settle(cluster, first, pid, before)
            return [first]
        second, pid2, mid = await _strike(cluster, live, *again, kind=MoveKind.KILL_MIGRATED)
        await _back(cluster, first, pid)
        await _back(cluster, second, pid2)
        first.migrated = (mid - before).by_cause
        second.migrated = (await _moved(cluster, mid)).by_cause
        return [first, second]


@dataclass(frozen=True)
class DrainDecode:
    """A rolling drain: each decode worker in turn, while it holds a stream mid-way, is drained
    with a short grace (`WorkerActor.drain(restart=True)`) and is back before the next one.
    The first is the worker holding the most work.  The next one may still hold streams the
    first one's drain migrated to it; when every request sent so far ended before it held one
    mid-way, the next wave goes out, to idle workers (the gateway routes to the least loaded),
    so it gets its share of them, paced to last."""
    wait_s: float = 60.0

    async def drive(self, cluster: ChaosCluster, live: list[Outcome], done: asyncio.Event, rng: random.Random,
                    waves: Waves) -> list[Move]:
        await _pace(cluster, waves)
        moves: list[Move] = []
        left = sorted(cluster.workers(Role.DECODE))
        pids = {w: (await asyncio.to_thread(cluster.ledger, w)).pid for w in left}   # read before: less delay
        while left:
            held = await _held(cluster, live, done, waves, self.wait_s, among=left, streams=0 if moves else 2)
            if held is None:
                break
            left.remove(held[0])
            moves.append(await _drain(cluster, held, pids[held[0]]))
        return moves


async def _first_kill(cluster: ChaosCluster, live: list[Outcome], done: asyncio.Event, waves: Waves,
                      wait_s: float) -> tuple[Move, int, migrations.MigrationCounts] | None:
    """Pace the decode workers, wait until one holds two streams mid-way and kill it: its
    `Move`, its pid and the migration counters before (`_strike`); None when none held them."""
    await _pace(cluster, waves)
    held = await _held(cluster, live, done, waves, wait_s, streams=2)
    if held is None:
        return None
    return await _strike(cluster, live, *held, kind=MoveKind.KILL)


async def _drain(cluster: ChaosCluster, held: Held, pid: int) -> Move:
    """Drain the held worker with DRAIN_GRACE_S and a restart; wait until it is back."""
    wid, streams, streaming = held
    before = await asyncio.to_thread(migrations.now, cluster.url)
    t0 = time.monotonic()
    reply = await asyncio.to_thread(cluster.drain, wid, DRAIN_GRACE_S, restart=True)
    move = Move(MoveKind.DRAIN, wid, streaming, len(streams), sum(r["resumed"] > 0 for r in streams), t0,
                reply=_reply(reply))
    await _settle(cluster, move, pid, before)
    return move


async def _settle(cluster: ChaosCluster, move: Move, pid: int, before: migrations.MigrationCounts) -> None:
    """Wait until the moved worker is back (`_back`), then record the gateway's migrations
    since `before` in the move, by cause."""
    await _back(cluster, move, pid)
    move.migrated = (await _moved(cluster, before)).by_cause


async def _pace(cluster: ChaosCluster, waves: Waves) -> None:
    """Pace every decode worker at PACE_S a step (the `pace` point, chaos.injectors.Pacer:
    until the scenario disarms it, or the worker restarts), then send the first wave.  Unpaced,
    a 48-token stream lasts well under a second on a fast machine, while the driver's view of
    the workers (Ray calls) is slow on a loaded one: whether it saw a stream mid-way was a
    race.  Paced, a stream stays mid-way for MIN_LEFT * PACE_S or more, however fast the
    machine; a kill or drain still cuts real streams, and what it proves is unchanged."""
    await asyncio.to_thread(cluster.arm, Role.DECODE, "pace", seconds=PACE_S)
    waves.open(0)


async def _held(cluster: ChaosCluster, live: list[Outcome], done: asyncio.Event, waves: Waves, wait_s: float,
                among: list[str] | None = None, migrated: bool = False, streams: int = 0,
                feed: bool = True) -> Held | None:
    """Wait until a decode worker (of `among`, default all) holds a stream mid-way (it generated
    tokens here and may generate MIN_LEFT more; `migrated`: one that migrated there) while the
    clients see at least `streams` streams mid-way (fewer when fewer of the requests sent and not
    ended are streamed).  `feed`: when every request sent so far has ended first, send the next
    wave, so the load lasts until the driver acts or the waves run out.  Returns (the worker
    whose such streams have the most tokens left, those streams as `live_requests` lists them,
    the client's requests mid-stream then); None when the time is up, the requests are done, or
    every request sent ended and no wave is left to send (or `feed` is False)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + wait_s
    while loop.time() < end and not done.is_set():
        sent = [o for o in live if o.job.wave <= waves.opened]
        streaming = [o.job.index for o in sent if o.token_ids and not o.ended]
        if len(streaming) >= min(streams, sum(o.job.stream and not o.ended for o in sent)):
            best = await _busiest(cluster, among, migrated)
            if best is not None:
                return best[0], best[1], streaming
        if all(o.ended for o in sent):
            if not (feed and waves.more):
                return None
            await asyncio.sleep(SETTLE_S)
            waves.open(waves.opened + 1)
        await asyncio.sleep(0.05)
    return None


async def _busiest(cluster: ChaosCluster, among: list[str] | None,
                   migrated: bool) -> tuple[str, list[dict[str, int]]] | None:
    """The decode worker (of `among`, default all) whose streams mid-way (`migrated`: only
    those that migrated there) have the most tokens left, and those streams; None: none has any."""
    best: tuple[str, list[dict[str, int]]] | None = None
    for wid in sorted(among or cluster.workers(Role.DECODE)):
        mid = [r for r in await asyncio.to_thread(cluster.call, wid, "live_requests")
               if r["generated"] > r["resumed"] and r["left"] >= MIN_LEFT and (r["resumed"] or not migrated)]
        if mid and (best is None or _work(mid) > _work(best[1])):
            best = (wid, mid)
    return best


def _work(streams: list[dict[str, int]]) -> int:
    return sum(r["left"] for r in streams)


async def _strike(cluster: ChaosCluster, live: list[Outcome], wid: str, held: list[dict[str, int]],
                  streaming: list[int], kind: MoveKind) -> tuple[Move, int, migrations.MigrationCounts]:
    """Kill `wid` now.  Returns its move, the pid it had, and the migration counters just
    before."""
    before = await asyncio.to_thread(migrations.now, cluster.url)
    pid = (await asyncio.to_thread(cluster.ledger, wid)).pid
    t0 = time.monotonic()
    await asyncio.to_thread(cluster.kill, wid)
    ended = {o.job.index for o in live if o.ended}
    return (Move(kind, wid, [i for i in streaming if i not in ended], len(held),
                 sum(r["resumed"] > 0 for r in held), t0), pid, before)


async def _back(cluster: ChaosCluster, move: Move, pid: int, wait_s: float = 120.0) -> None:
    """Wait until the move's worker runs in a new process (not `pid`: Ray restarted it) and
    the gateway sees every worker healthy; notes the seconds since the kill or drain began
    (raises TimeoutError)."""
    while (await asyncio.to_thread(cluster.ledger, move.worker)).pid == pid:
        if time.monotonic() - move.t0 > wait_s:
            raise TimeoutError(f"{move.worker} still runs in process {pid} after {wait_s:.0f}s: it was not restarted")
        await asyncio.sleep(0.1)
    await asyncio.to_thread(cluster.wait_recovered)
    move.recovered_s = round(time.monotonic() - move.t0, 2)


async def _moved(cluster: ChaosCluster, before: migrations.MigrationCounts,
                 wait_s: float = 10.0) -> migrations.MigrationCounts:
    """The migrations the gateway counted since `before`, waiting up to `wait_s` for a first
    one (a stream that waited for a worker to come back may be counted late)."""
    end = time.monotonic() + wait_s
    while True:
        moved = await asyncio.to_thread(migrations.now, cluster.url) - before
        if moved.total or time.monotonic() > end:
            return moved
        await asyncio.sleep(0.2)


def _reply(reply: Any) -> dict[str, Any] | None:
    """A drain's answer as plain data ({"finished", "drained", ...}; None when there was none)."""
    if reply is None:
        return None
    if isinstance(reply, dict):
        return {str(k): v for k, v in reply.items()}
    fields = {k: getattr(reply, k) for k in ("finished", "drained", "draining") if hasattr(reply, k)}
    return fields or {"answer": repr(reply)[:200]}
