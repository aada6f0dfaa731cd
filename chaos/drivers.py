"""What a scenario does to the cluster while its requests run: kill or drain a worker at the
right moment, corrupt expert slots now and then.  Each driver returns the faults it injected as
records {"point", "victim", ...} for the report, and opens the scenario's waves of requests
(`Waves`): the first when it is ready to watch them.

The moving drivers (kill_decode, kill_decode_twice, drain_decode) act while streams are
mid-way, and what they exercise must not depend on the machine's speed or load:

- streams last: every decode worker is paced (`_pace`) before the first request goes out, so a
  stream stays mid-way long enough for the driver to see it over Ray, even on a loaded machine,
  and long enough to outlive a drain's grace;
- load lasts: when every request sent so far ended before the driver found what it waits for,
  it sends the next wave (`_held`; a scenario has a wave to spare), to idle workers, which the
  gateway's least-loaded routing shares out: the worker a rolling drain needs next gets streams.

A driver that still could not make its moves says so in the report (chaos.moves): a violation."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from chaos import migrations
from chaos.client import Outcome
from chaos.cluster import ChaosCluster
from worker.types import Role

P = ParamSpec("P")
T = TypeVar("T")


async def _call(fn: Callable[P, T], *args: P.args, **kw: P.kwargs) -> T:
    return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kw))


async def kill_prefill(cluster: ChaosCluster, live: list[Outcome], done: asyncio.Event, rng: random.Random,
                       waves: Waves, wait_s: float = 60.0) -> list[dict]:
    """Wait until a prefill worker holds a transfer mid-push (its `delay` fault fired after some
    frames went out), then kill that worker.  The victim is that transfer."""
    waves.open(0)
    loop = asyncio.get_running_loop()
    end = loop.time() + wait_s
    while loop.time() < end and not done.is_set():
        for wid in cluster.workers(Role.PREFILL):
            held = await _call(cluster.call, wid, "injected", point="delay")
            if held:
                await _call(cluster.kill, wid)
                await _call(cluster.wait_recovered)
                return [{"point": "kill_prefill", "victim": held[-1], "worker": wid}]
        await asyncio.sleep(0.1)
    return []


PACE_S = 0.08          # the moving drivers pace every decode worker at this or slower per decode step
MIN_LEFT = 16          # a stream counts as mid-way while it may still generate this many tokens
DRAIN_GRACE_S = 0.5    # drain_decode's grace: short streams finish in it, the others migrate
SETTLE_S = 0.5         # from the last request's end to the next wave: the gateway counts it off its worker
# paced, a stream mid-way runs MIN_LEFT * PACE_S = 1.3 s or more: longer than a drain's grace and the
# driver's calls before it, so a drain finds it and migrates it


async def kill_decode(cluster: ChaosCluster, live: list[Outcome], done: asyncio.Event, rng: random.Random,
                      waves: Waves, wait_s: float = 60.0) -> list[dict]:
    """Wait until several streams are mid-way, then kill the decode worker holding the most
    work of them (Ray restarts it; the gateway continues its streams on the other worker).  The
    record's victims are the requests mid-stream at that moment, on either worker.  (The
    moving drivers pace the decode workers and feed them waves: see `_pace` and `_held`.)"""
    await _pace(cluster, waves)
    held = await _held(cluster, live, done, waves, wait_s, streams=2)
    if held is None:
        return []
    record, pid, before = await _strike(cluster, live, *held, point="kill_decode")
    await _back(cluster, record, pid)
    record["migrated"] = (await _moved(cluster, before)).by_cause
    return [record]


async def kill_decode_twice(cluster: ChaosCluster, live: list[Outcome], done: asyncio.Event, rng: random.Random,
                            waves: Waves, wait_s: float = 60.0) -> list[dict]:
    """`kill_decode`, then, while the killed worker restarts, kill the worker its streams
    migrated to as soon as one of them streams there again (the worker says it was resumed):
    that request migrates a second time, with no decode worker up for a while (the gateway
    waits for one to come back).  The first kill catches its streams early (they are paced),
    so they migrate with most of their tokens still to come, slowly again on the paced worker."""
    await _pace(cluster, waves)
    held = await _held(cluster, live, done, waves, wait_s, streams=2)
    if held is None:
        return []
    first, pid, before = await _strike(cluster, live, *held, point="kill_decode")
    others = [w for w in sorted(cluster.workers(Role.DECODE)) if w != first["worker"]]
    again = await _held(cluster, live, done, waves, wait_s, among=others, migrated=True, feed=False)
    records, pids, mid = [first], [pid], before
    if again is not None:
        second, pid2, mid = await _strike(cluster, live, *again, point="kill_migrated")
        records, pids = [first, second], [pid, pid2]
    for r, p in zip(records, pids):
        await _back(cluster, r, p)
    first["migrated"] = (await _moved(cluster, before) if len(records) == 1 else mid - before).by_cause
    if len(records) == 2:
        records[1]["migrated"] = (await _moved(cluster, mid)).by_cause
    return records


async def drain_decode(cluster: ChaosCluster, live: list[Outcome], done: asyncio.Event, rng: random.Random,
                       waves: Waves, wait_s: float = 60.0) -> list[dict]:
    """A rolling drain: each decode worker in turn, while it holds a stream mid-way, is drained
    with a short grace (`WorkerActor.drain(restart=True)`) and is back before the next one.
    The first is the worker holding the most work.  The next one may still hold streams the
    first one's drain migrated to it; when every request sent so far ended before it held one
    mid-way, the next wave goes out, to idle workers (the gateway routes to the least loaded),
    so it gets its share of them, paced to last."""
    await _pace(cluster, waves)
    records: list[dict] = []
    left = sorted(cluster.workers(Role.DECODE))
    pids = {w: (await _call(cluster.call, w, "ledger"))["pid"] for w in left}   # read before: less delay
    while left:
        held = await _held(cluster, live, done, waves, wait_s, among=left, streams=0 if records else 2)
        if held is None:
            break
        wid, streams, streaming = held
        left.remove(wid)
        before = await _call(migrations.now, cluster.url)
        pid = pids[wid]
        t0 = time.monotonic()
        reply = await _call(cluster.drain, wid, DRAIN_GRACE_S, restart=True)
        record = {"point": "drain_decode", "worker": wid, "victim": streaming, "held": len(streams),
                  "held_resumed": sum(r["resumed"] > 0 for r in streams), "reply": _reply(reply),
                  "drain_s": round(time.monotonic() - t0, 2), "t0": t0}
        await _back(cluster, record, pid)
        record["migrated"] = (await _moved(cluster, before)).by_cause
        records.append(record)
    return records


class Waves:
    """When a scenario's requests are sent: wave k once its driver opened it (a driver opens
    wave 0 when it is ready to watch the requests), every wave once the driver is done (nothing
    waits for a driver that gave up).  A scenario without a driver opens them all at once."""

    def __init__(self, count: int = 1) -> None:
        self.count = count
        self.opened = -1              # the last wave opened (-1: none yet)
        self._all = False
        self._changed = asyncio.Event()

    @property
    def more(self) -> bool:
        """Whether a wave is left to open."""
        return not self._all and self.opened < self.count - 1

    def open(self, wave: int) -> None:
        """Send the waves up to `wave`."""
        self.opened = max(self.opened, wave)
        self._changed.set()

    def open_all(self) -> None:
        self._all = True
        self.opened = max(self.opened, self.count - 1)
        self._changed.set()

    async def reach(self, wave: int) -> None:
        while not self._all and wave > self.opened:
            self._changed.clear()
            await self._changed.wait()


async def _pace(cluster: ChaosCluster, waves: Waves) -> None:
    """Pace every decode worker at PACE_S a step (the `pace` point, chaos.injectors.Pacer:
    until the scenario disarms it, or the worker restarts), then send the first wave.  Unpaced,
    a 48-token stream lasts well under a second on a fast machine, while the driver's view of
    the workers (Ray calls) is slow on a loaded one: whether it saw a stream mid-way was a
    race.  Paced, a stream stays mid-way for MIN_LEFT * PACE_S or more, however fast the
    machine; a kill or drain still cuts real streams, and what it proves is unchanged."""
    await _call(cluster.arm, Role.DECODE, "pace", seconds=PACE_S)
    waves.open(0)


async def _held(cluster: ChaosCluster, live: list[Outcome], done: asyncio.Event, waves: Waves, wait_s: float,
                among: list[str] | None = None, migrated: bool = False, streams: int = 0,
                feed: bool = True) -> tuple[str, list[dict], list[int]] | None:
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
            best: tuple[str, list[dict]] | None = None
            for wid in sorted(among or cluster.workers(Role.DECODE)):
                mid = [r for r in await _call(cluster.call, wid, "live_requests")
                       if r["generated"] > r["resumed"] and r["left"] >= MIN_LEFT and (r["resumed"] or not migrated)]
                if mid and (best is None or _work(mid) > _work(best[1])):
                    best = (wid, mid)
            if best is not None:
                return best[0], best[1], streaming
        if all(o.ended for o in sent):
            if not (feed and waves.more):
                return None
            await asyncio.sleep(SETTLE_S)
            waves.open(waves.opened + 1)
        await asyncio.sleep(0.05)
    return None


def _work(streams: list[dict]) -> int:
    return sum(r["left"] for r in streams)


async def _strike(cluster: ChaosCluster, live: list[Outcome], wid: str, held: list[dict], streaming: list[int],
                  point: str) -> tuple[dict, int, migrations.MigrationCounts]:
    """Kill `wid` now.  Returns its record, the pid it had, and the migration counters just
    before."""
    before = await _call(migrations.now, cluster.url)
    pid = (await _call(cluster.call, wid, "ledger"))["pid"]
    t0 = time.monotonic()
    await _call(cluster.kill, wid)
    ended = {o.job.index for o in live if o.ended}
    return ({"point": point, "worker": wid, "victim": [i for i in streaming if i not in ended], "held": len(held),
             "held_resumed": sum(r["resumed"] > 0 for r in held), "t0": t0}, pid, before)


async def _back(cluster: ChaosCluster, record: dict, pid: int, wait_s: float = 120.0) -> None:
    """Wait until the record's worker runs in a new process (not `pid`: Ray restarted it) and
    the gateway sees every worker healthy; notes the seconds since the kill or drain began
    (raises TimeoutError)."""
    wid, t0 = record["worker"], record.pop("t0")
    while (await _call(cluster.call, wid, "ledger"))["pid"] == pid:
        if time.monotonic() - t0 > wait_s:
            raise TimeoutError(f"{wid} still runs in process {pid} after {wait_s:.0f}s: it was not restarted")
        await asyncio.sleep(0.1)
    await _call(cluster.wait_recovered)
    record["recovered_s"] = round(time.monotonic() - t0, 2)


async def _moved(cluster: ChaosCluster, before: migrations.MigrationCounts,
                 wait_s: float = 10.0) -> migrations.MigrationCounts:
    """The migrations the gateway counted since `before`, waiting up to `wait_s` for a first
    one (a stream that waited for a worker to come back may be counted late)."""
    end = time.monotonic() + wait_s
    while True:
        moved = await _call(migrations.now, cluster.url) - before
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


async def corrupt_expert(cluster: ChaosCluster, live: list[Outcome], done: asyncio.Event, rng: random.Random,
                         waves: Waves, every_s: float = 0.2) -> list[dict]:
    """Flip a bit in a resident expert slot of a random decode worker every `every_s`."""
    waves.open(0)
    records: list[dict] = []
    while not done.is_set():
        wid = rng.choice(sorted(cluster.workers(Role.DECODE)))
        if await _call(cluster.call, wid, "arm", point="corrupt_expert", times=1):
            records.append({"point": "corrupt_expert", "victim": wid, "worker": wid})
        await asyncio.sleep(every_s)
    return records


DRIVERS = {"kill_prefill": kill_prefill, "kill_decode": kill_decode, "kill_decode_twice": kill_decode_twice,
           "drain_decode": drain_decode, "corrupt_expert": corrupt_expert}
