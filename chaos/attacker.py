"""The hostile scenarios' attacker: a tenant whose requests are judged by what they must end in
(a refusal naming its limit, an explicit error), not by the reference; and the frame every
hostile attack shares: its coroutine runs on an event loop in a thread of its own from `begin`
until `end`, while the other tenants' requests run, and a `Sampler` watches the gateway."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from chaos.cluster import ChaosCluster
from chaos.gauges import Peaks, Sampler, check_ready
from chaos.prompts import ATTACKER
from chaos.report import ScenarioResult
from gateway.http_client import post_json

if TYPE_CHECKING:
    from chaos.client import Outcome
    from chaos.scenario import Stage


@dataclass
class Reply:
    """How one attacker request ended, as the attacker saw it."""
    what: str                   # the attack's name for it
    status: int = 0
    code: str = ""              # the error body's code (or a stream's error event's)
    message: str = ""
    finish: str | None = None   # the first choice's finish reason when it completed
    text: str = ""
    ended: str = "no end"       # answered | timeout | hung up | broken: ...
    seconds: float = 0.0

    @property
    def completed(self) -> bool:
        return self.ended == "answered" and self.status == 200 and not self.code and self.finish is not None

    def show(self) -> str:
        if self.completed:
            return f"{self.what}: completed ({self.finish})"
        if self.ended != "answered":
            return f"{self.what}: {self.ended} after {self.seconds:.1f}s"
        return f"{self.what}: HTTP {self.status} {self.code}: {self.message[:140]}"


async def request(url: str, api_key: str | None, path: str, body: dict[str, Any], out: Reply,
                  timeout_s: float) -> Reply:
    """POST `body` to `path`, filling `out`; read the whole answer (a stream to its end).  A
    cancelled call hangs up (`out` says so)."""
    t0 = time.monotonic()
    u = urlparse(url)
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(u.hostname, u.port)
            out.status, chunks = await post_json(reader, writer, f"{u.hostname}:{u.port}", path, body, api_key)
            raw = b"".join([c async for c in chunks])
        _parse(raw, out)
        out.ended = "answered"
    except TimeoutError:
        out.ended = "timeout"
    except asyncio.CancelledError:
        out.ended = "hung up"
        raise
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as e:
        out.ended = f"broken: {type(e).__name__}: {e}"
    finally:
        out.seconds = time.monotonic() - t0
        if writer is not None:
            writer.close()
    return out


def _parse(raw: bytes, out: Reply) -> None:
    text = raw.decode(errors="replace")
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.startswith("data: ")]
    for data in events or [text]:
        if data.strip() in ("", "[DONE]"):
            continue
        try:
            msg = json.loads(data)
        except ValueError:
            out.code, out.message = out.code or "unparsed", data[:200]
            return
        if "error" in msg:
            err = msg["error"] or {}
            out.code, out.message = str(err.get("code") or ""), str(err.get("message") or "")
            return
        for choice in msg.get("choices") or []:
            if choice.get("index", 0) == 0:
                out.text += choice.get("text") or (choice.get("message") or choice.get("delta") or {}).get(
                    "content") or ""
                out.finish = choice.get("finish_reason") or out.finish


class HostileAttack(ABC):
    """An attack that runs beside the other tenants' requests.  Subclasses write `attack` (a
    coroutine that runs until `self.halt` is set, then returns; it sets `self.launched` once it
    is under way) and `judge` (fills the scenario's row).  `begin` waits for `launched`."""

    name = "hostile"
    launch_wait_s = 60.0
    finish_wait_s = 120.0       # end() waits this long for `attack` to return after halt

    def __init__(self, cluster: ChaosCluster, key: str, model: str) -> None:
        self.cluster, self.key, self.model = cluster, key, model
        self.url = cluster.url
        self.sampler = Sampler(cluster, ATTACKER)
        self.launched = threading.Event()
        self.halt = asyncio.Event()
        self.failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name=f"chaos-{self.name}", daemon=True)

    @classmethod
    def build(cls, stage: Stage, outs: list[Outcome]) -> HostileAttack:
        """The attack by the hostile tenant (its own API key) beside `outs`, the victims' requests."""
        return cls(stage.cluster, stage.attacker_key, stage.model)

    def _main(self) -> None:
        async def go() -> None:
            self._loop = asyncio.get_running_loop()
            self.halt = asyncio.Event()
            await self.attack()
        try:
            asyncio.run(go())
        except BaseException as e:   # noqa: BLE001  (reported in the row, never lost in a thread)
            self.failure = e
        finally:
            self.launched.set()

    @abstractmethod
    async def attack(self) -> None:
        """The attacker's traffic (runs on the attack's own thread and event loop)."""

    @abstractmethod
    def judge(self, res: ScenarioResult, peaks: Peaks) -> None:
        """Detections and violations of the attack, into `res`."""

    def begin(self, res: ScenarioResult) -> None:
        self.sampler.start()
        self._thread.start()
        if not self.launched.wait(self.launch_wait_s):
            res.violations.append(f"{self.name}: the attack did not get under way in {self.launch_wait_s:.0f}s")

    def end(self, res: ScenarioResult) -> None:
        """Halt the attack (it hangs up what it still holds), wait for it, judge."""
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self.halt.set)
            except RuntimeError:     # the loop closed meanwhile: the attack is over
                pass
        self._thread.join(self.finish_wait_s)
        peaks = self.sampler.stop()
        if self._thread.is_alive():
            res.violations.append(f"{self.name}: the attack did not end {self.finish_wait_s:.0f}s after it "
                                  f"was halted")
            return
        if self.failure is not None:
            res.violations.append(f"{self.name}: the attack failed: {type(self.failure).__name__}: "
                                  f"{str(self.failure)[:200]}")
            return
        self.judge(res, peaks)
        res.notes.append(check_ready(res.violations, peaks, self.sampler.want))
