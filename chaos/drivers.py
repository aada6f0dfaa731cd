"""What a scenario does to the cluster while its requests run (a `chaos.scenario.Driver`): kill
the prefill worker mid-push, corrupt expert slots now and then; the moving drivers, which kill
or drain decode workers while streams are mid-way, are in chaos.moving.  Each driver returns a
record of every fault it injected, for the scenario's rules (chaos.judges), and opens the
scenario's waves of requests (`Waves`): the first when it is ready to watch them."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from chaos.client import Outcome
from chaos.cluster import ChaosCluster
from worker.types import Role


@dataclass(frozen=True)
class Strike:
    """One fault a driver injected on one worker."""
    point: str           # kill_prefill | corrupt_expert
    worker: str
    victim: str          # the transfer the kill cut, or the worker whose slot was flipped


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


@dataclass(frozen=True)
class KillPrefill:
    """Wait until a prefill worker holds a transfer mid-push (the scenario's armed point
    `holding` fired after some frames went out), then kill that worker.  The victim is that
    transfer."""
    holding: str                 # the fault point that holds a push mid-way (the scenario's Armed.point)
    wait_s: float = 60.0

    async def drive(self, cluster: ChaosCluster, live: list[Outcome], done: asyncio.Event, rng: random.Random,
                    waves: Waves) -> list[Strike]:
        waves.open(0)
        loop = asyncio.get_running_loop()
        end = loop.time() + self.wait_s
        while loop.time() < end and not done.is_set():
            for wid in cluster.workers(Role.PREFILL):
                held = await asyncio.to_thread(cluster.call, wid, "injected", point=self.holding)
                if held:
                    await asyncio.to_thread(cluster.kill, wid)
                    await asyncio.to_thread(cluster.wait_recovered)
                    return [Strike("kill_prefill", wid, held[-1])]
            await asyncio.sleep(0.1)
        return []


@dataclass(frozen=True)
class CorruptExpert:
    """Flip a bit in a resident expert slot of a random decode worker every `every_s`."""
    every_s: float = 0.2

    async def drive(self, cluster: ChaosCluster, live: list[Outcome], done: asyncio.Event, rng: random.Random,
                    waves: Waves) -> list[Strike]:
        waves.open(0)
        records: list[Strike] = []
        while not done.is_set():
            wid = rng.choice(sorted(cluster.workers(Role.DECODE)))
            if await asyncio.to_thread(cluster.call, wid, "arm", point="corrupt_expert", times=1):
                records.append(Strike("corrupt_expert", wid, wid))
            await asyncio.sleep(self.every_s)
        return records
