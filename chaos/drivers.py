"""What a scenario does to the cluster while its requests run: kill a worker at the right
moment, corrupt expert slots now and then.  Each driver returns the faults it injected as
records {"point", "victim", ...} for the report."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import ParamSpec, TypeVar

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


async def kill_decode(cluster: ChaosCluster, live: list[Outcome], done: asyncio.Event, rng: random.Random,
                      wait_s: float = 60.0) -> list[dict]:
    """Wait until several streams are mid-way (tokens seen, no end yet), then kill a decode
    worker.  Its victims are the requests mid-stream at that moment."""
    loop = asyncio.get_running_loop()
    end = loop.time() + wait_s
    while loop.time() < end and not done.is_set():
        streaming = [o for o in live if o.token_ids and not o.ended]
        if len(streaming) >= 2:
            wid = rng.choice(sorted(cluster.workers(Role.DECODE)))
            await _call(cluster.kill, wid)
            victims = [o.job.index for o in streaming if not o.ended]
            await _call(cluster.wait_recovered)
            return [{"point": "kill_decode", "victim": victims, "worker": wid}]
        await asyncio.sleep(0.02)
    return []


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


DRIVERS = {"kill_prefill": kill_prefill, "kill_decode": kill_decode, "corrupt_expert": corrupt_expert}
