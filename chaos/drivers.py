"""What a scenario does to the cluster while its requests run: kill or drain a worker at the
right moment, corrupt expert slots now and then.  Each driver returns the faults it injected as
records {"point", "victim", ...} for the report."""

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
                       wait_s: float = 60.0) -> list[dict]:
    """Wait until a prefill worker holds a transfer mid-push (its `delay` fault fired after some
    frames went out), then kill that worker.  The victim is that transfer."""
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


MIN_LEFT = 16          # a stream counts as mid-way while it may still generate this many tokens
DRAIN_GRACE_S = 0.5    # drain_decode's grace: short streams finish in it, the others migrate


async def kill_decode(cluster: ChaosCluster, live: list[Outcome], done: asyncio.Event, rng: random.Random,
                      wait_s: float = 60.0) -> list[dict]:
    """Wait until several streams are mid-way, then kill the decode worker holding the most
    work of them (Ray restarts it; the gateway continues its streams on the other worker).  The
    record's victims are the requests mid-stream at that moment, on either worker."""
    held = await _held(cluster, live, done, wait_s, streams=2)
    return [] if held is None else [await _kill(cluster, live, *held, point="kill_decode")]


async def kill_decode_twice(cluster: ChaosCluster, live: list[Outcome], done: asyncio.Event, rng: random.Random,
                            wait_s: float = 60.0) -> list[dict]:
    """`kill_decode`, then, once the killed worker is back, kill the worker the first kill's
    streams migrated to while it still holds one of them mid-way (a request that migrated
    there: the worker says it was resumed), so that request migrates a second time.  (The
    scenario's long streams outlive the restart in between.)"""
    held = await _held(cluster, live, done, wait_s, streams=2)
    if held is None:
        return []
    first = await _kill(cluster, live, *held, point="kill_decode")
    again = await _held(cluster, live, done, wait_s, migrated=True)
    if again is None:
        return [first]
    return [first, await _kill(cluster, live, *again, point="kill_migrated")]


async def drain_decode(cluster: ChaosCluster, live: list[Outcome], done: asyncio.Event, rng: random.Random,
                       wait_s: float = 60.0) -> list[dict]:
    """A rolling drain: each decode worker in turn, while it holds a stream mid-way, is drained
    with a short grace (`WorkerActor.drain(restart=True)`) and is back before the next one.
    The first is the one holding the most work (its long streams move on to the next)."""
    records: list[dict] = []
    left = sorted(cluster.workers(Role.DECODE))
    while left:
        held = await _held(cluster, live, done, wait_s, among=left, streams=0 if records else 2)
        if held is None:
            break
        wid = held[0]
        left.remove(wid)
        before = await _call(migrations.now, cluster.url)
        pid = (await _call(cluster.call, wid, "ledger"))["pid"]
        t0 = time.monotonic()
        reply = await _call(cluster.drain, wid, DRAIN_GRACE_S, restart=True)
        drained_s = time.monotonic() - t0
        recovered = await _back(cluster, wid, pid)
        moved = await _call(migrations.now, cluster.url) - before
        records.append({"point": "drain_decode", "worker": wid, "victim": held[2], "held": len(held[1]),
                        "held_resumed": sum(r["resumed"] > 0 for r in held[1]), "reply": _reply(reply),
                        "migrated": moved.by_cause, "drain_s": round(drained_s, 2), "recovered_s": round(recovered, 2)})
    return records


async def _held(cluster: ChaosCluster, live: list[Outcome], done: asyncio.Event, wait_s: float,
                among: list[str] | None = None, migrated: bool = False,
                streams: int = 0) -> tuple[str, list[dict], list[int]] | None:
    """Wait until a decode worker (of `among`, default all) holds a stream mid-way (tokens out,
    at least MIN_LEFT to go; `migrated`: one that migrated there) while the clients see at
    least `streams` streams mid-way.  Returns (the worker whose such streams have the most
    tokens left, those streams as `live_requests` lists them, the client's requests
    mid-stream then), None when the time is up or the requests are done."""
    loop = asyncio.get_running_loop()
    end = loop.time() + wait_s
    while loop.time() < end and not done.is_set():
        streaming = [o.job.index for o in live if o.token_ids and not o.ended]
        if len(streaming) >= streams:
            best: tuple[str, list[dict]] | None = None
            for wid in sorted(among or cluster.workers(Role.DECODE)):
                mid = [r for r in await _call(cluster.call, wid, "live_requests")
                       if r["generated"] > 0 and r["left"] >= MIN_LEFT and (r["resumed"] > 0 or not migrated)]
                if mid and (best is None or _work(mid) > _work(best[1])):
                    best = (wid, mid)
            if best is not None:
                return best[0], best[1], streaming
        await asyncio.sleep(0.05)
    return None


def _work(streams: list[dict]) -> int:
    return sum(r["left"] for r in streams)


async def _kill(cluster: ChaosCluster, live: list[Outcome], wid: str, held: list[dict], streaming: list[int],
                point: str) -> dict:
    """Kill `wid`, wait until the cluster recovered, and say what the gateway migrated meanwhile."""
    before = await _call(migrations.now, cluster.url)
    pid = (await _call(cluster.call, wid, "ledger"))["pid"]
    await _call(cluster.kill, wid)
    ended = {o.job.index for o in live if o.ended}
    victims = [i for i in streaming if i not in ended]
    recovered = await _back(cluster, wid, pid)
    moved = await _call(migrations.now, cluster.url) - before
    return {"point": point, "worker": wid, "victim": victims, "held": len(held),
            "held_resumed": sum(r["resumed"] > 0 for r in held), "migrated": moved.by_cause,
            "recovered_s": round(recovered, 2)}


async def _back(cluster: ChaosCluster, wid: str, pid: int, wait_s: float = 120.0) -> float:
    """Wait until `wid` runs in a new process (not `pid`: Ray restarted it) and the gateway sees
    every worker healthy; returns the seconds it took (raises TimeoutError)."""
    t0 = time.monotonic()
    while (await _call(cluster.call, wid, "ledger"))["pid"] == pid:
        if time.monotonic() - t0 > wait_s:
            raise TimeoutError(f"{wid} still runs in process {pid} after {wait_s:.0f}s: it was not restarted")
        await asyncio.sleep(0.1)
    await _call(cluster.wait_recovered)
    return time.monotonic() - t0


def _reply(reply: Any) -> dict[str, Any] | None:
    """A drain's answer as plain data ({"finished", "drained", ...}; None when there was none)."""
    if reply is None:
        return None
    if isinstance(reply, dict):
        return {str(k): v for k, v in reply.items()}
    fields = {k: getattr(reply, k) for k in ("finished", "drained", "draining") if hasattr(reply, k)}
    return fields or {"answer": repr(reply)[:200]}


async def corrupt_expert(cluster: ChaosCluster, live: list[Outcome], done: asyncio.Event, rng: random.Random,
                         every_s: float = 0.2) -> list[dict]:
    """Flip a bit in a resident expert slot of a random decode worker every `every_s`."""
    records: list[dict] = []
    while not done.is_set():
        wid = rng.choice(sorted(cluster.workers(Role.DECODE)))
        if await _call(cluster.call, wid, "arm", point="corrupt_expert", times=1):
            records.append({"point": "corrupt_expert", "victim": wid, "worker": wid})
        await asyncio.sleep(every_s)
    return records


DRIVERS = {"kill_prefill": kill_prefill, "kill_decode": kill_decode, "kill_decode_twice": kill_decode_twice,
           "drain_decode": drain_decode, "corrupt_expert": corrupt_expert}
