"""Attacks on the cluster's trust boundary (I9) that wrap a scenario's requests (each a
chaos.scenario.Attack): `begin` runs before they are sent, `end` after they all ended (always,
also when driving them failed).
Each one fills the scenario's row (faults injected and detected) and adds its violations.

    rogue_client     a process without the cluster secret calls every worker RPC and the KV
                     transfer service: each call must be refused with UNAUTHENTICATED, counted
                     once in the worker's `unauthenticated`, and change nothing else
    stalled_streams  a worker holding the secret, gone bad, holds max_push_streams + EXTRA
                     Push streams open on one decode worker's gRPC receiver while the requests
                     run: the surplus is refused with RESOURCE_EXHAUSTED, a Handshake still
                     answers, and every stream is gone once it lets go
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import ray

from chaos.client import Outcome
from chaos.cluster import ChaosCluster
from chaos.report import ScenarioResult
from proto import worker_pb2 as wpb
from worker.types import Role

if TYPE_CHECKING:
    from chaos.scenario import Stage

ROGUE_TIMEOUT_S = 120.0


class RogueClient:
    """Runs `chaos.rogue` in a process of its own against every worker, between two readings
    of every worker's ledger and pool (through the chaos actors: the authenticated path)."""

    def __init__(self, cluster: ChaosCluster, prompt: list[int], tenant: str) -> None:
        self.cluster, self.prompt, self.tenant = cluster, prompt, tenant

    @classmethod
    def build(cls, stage: Stage, outs: list[Outcome]) -> RogueClient:
        """The rogue client sends the first request's prompt, as its tenant."""
        return cls(stage.cluster, outs[0].job.ids, outs[0].job.tenant)

    def _plan(self) -> dict[str, Any]:
        plan: dict[str, Any] = {"decode": [], "prefill": [], "prompt": self.prompt, "tenant": self.tenant}
        for wid, actor in sorted(self.cluster.workers().items()):
            address = ray.get(actor.address.remote(), timeout=60)
            if self.cluster.deployment.roles[wid] == Role.PREFILL:
                plan["prefill"].append(address)
            else:
                transfer = self.cluster.call(wid, "push_streams")["endpoint"]
                plan["decode"].append({"address": address, "transfer": transfer, "wid": wid})
        return plan

    def _owner(self, plan: dict[str, Any]) -> dict[str, str]:
        """host:port -> the worker serving it (its RPC service, its gRPC transfer endpoint)."""
        out = {d["address"]: d["wid"] for d in plan["decode"]}
        out.update({d["transfer"].removeprefix("grpc://"): d["wid"] for d in plan["decode"]
                    if str(d["transfer"] or "").startswith("grpc://")})
        out.update(zip(plan["prefill"], sorted(self.cluster.workers(Role.PREFILL))))
        return out

    def _state(self) -> dict[str, dict[str, Any]]:
        """Per worker: its refused-call counters (the ledger's and its authenticated `Stats`
        reply's `rpc_unauthenticated`) apart from everything else a served call would move
        (request counters, receiver refusals and bytes, pool pages)."""
        out = {}
        for wid, actor in self.cluster.workers().items():
            ledger, pool = self.cluster.ledger(wid), self.cluster.call(wid, "idle_check")
            stats = wpb.StatsReply.FromString(ray.get(actor.stats.remote(), timeout=60))
            counts = dict(ledger.counts)
            out[wid] = {"refused": (counts.pop("unauthenticated", 0), stats.rpc_unauthenticated),
                        "counts": counts, "refusals": len(ledger.refusals),
                        "accepted_bytes": ledger.accepted_bytes, "pool": (pool["used"], pool["free"]),
                        "stats": (stats.kv_pages_free, stats.kv_pages_used, stats.requests_finished,
                                  stats.requests_failed, stats.transfers_accepted, dict(stats.transfers_refused))}
        return out

    def _quiet_state(self, wait_s: float = 10.0) -> dict[str, dict[str, Any]]:
        """A reading that a second one 0.3 s later repeats (the last scenario's tail is over),
        or the last one after `wait_s`."""
        end = time.monotonic() + wait_s
        state = self._state()
        while time.monotonic() < end:
            time.sleep(0.3)
            again = self._state()
            if again == state:
                break
            state = again
        return state

    def begin(self, res: ScenarioResult) -> None:
        plan = self._plan()
        skipped = [d["wid"] for d in plan["decode"] if not str(d["transfer"] or "").startswith("grpc://")]
        if skipped:
            res.notes.append(f"the transfer endpoints of {', '.join(skipped)} are not gRPC (shm: their socket "
                             f"admits only the worker's own uid): no Handshake or Push sent there")
        before = self._quiet_state()
        proc = subprocess.run([sys.executable, "-m", "chaos.rogue", json.dumps(plan)], capture_output=True,
                              text=True, timeout=ROGUE_TIMEOUT_S)
        after = self._state()
        if proc.returncode != 0:
            res.violations.append(f"the rogue client failed (exit {proc.returncode}): {proc.stderr[-300:]}")
            return
        calls: list[dict[str, str]] = json.loads(proc.stdout)
        res.faults_injected = len(calls)
        res.faults_detected = sum(c["code"] == "UNAUTHENTICATED" for c in calls)
        for c in calls:
            if c["code"] != "UNAUTHENTICATED":
                res.violations.append(f"rogue {c['call']} ({c['credentials']} credentials) on {c['target']} "
                                      f"ended {c['code']}, not UNAUTHENTICATED")
        owner = self._owner(plan)
        per_worker = Counter(owner[c["target"]] for c in calls)
        for wid in sorted(before):
            self._compare(res, wid, before[wid], after[wid], per_worker[wid])
        kinds = Counter(c["call"] for c in calls)
        res.notes.append(f"rogue calls: {len(calls)} ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}), "
                         f"{res.faults_detected} UNAUTHENTICATED; rpc_unauthenticated grew by "
                         + ", ".join(f"{wid} +{after[wid]['refused'][1] - before[wid]['refused'][1]} "
                                     f"(calls {per_worker[wid]})" for wid in sorted(before)))

    @staticmethod
    def _compare(res: ScenarioResult, wid: str, b: dict[str, Any], a: dict[str, Any], calls: int) -> None:
        grew = (a["refused"][0] - b["refused"][0], a["refused"][1] - b["refused"][1])
        if grew != (calls, calls):
            res.violations.append(f"{wid}: {calls} rogue calls refused; its unauthenticated counter grew "
                                  f"by {grew[0]}, its Stats' rpc_unauthenticated by {grew[1]}")
        for key, what in (("counts", "request counters"), ("refusals", "receiver refusals"),
                          ("accepted_bytes", "KV bytes accepted"), ("pool", "pool pages (used, free)"),
                          ("stats", "Stats (pages free, used, finished, failed, accepted, refused)")):
            if a[key] != b[key]:
                res.violations.append(f"{wid}: rogue calls changed its {what}: {b[key]} -> {a[key]}")

    def end(self, res: ScenarioResult) -> None:
        pass


class StalledStreams:
    """The first prefill worker (it holds the secret) stalls Push streams on the first decode
    worker's gRPC receiver for as long as the requests run, `hold_s` at most.  A request
    whose push meets the full receiver must fail explicitly for that reason (the gateway does
    not retry it); any other failure of `outs` is a violation."""

    EXTRA = 8           # streams over the receiver's cap

    def __init__(self, cluster: ChaosCluster, outs: list[Outcome], hold_s: float = 30.0) -> None:
        self.cluster, self.outs, self.hold_s = cluster, outs, hold_s
        self.bad = sorted(cluster.workers(Role.PREFILL))[0]
        self.victim = sorted(cluster.workers(Role.DECODE))[0]
        self._lock = threading.Lock()
        self._opened = 0
        self._closed: dict[str, Any] | None = None
        self._timer: threading.Timer | None = None
        self._start: dict[str, Any] = {}

    @classmethod
    def build(cls, stage: Stage, outs: list[Outcome]) -> StalledStreams:
        return cls(stage.cluster, outs)

    def begin(self, res: ScenarioResult) -> None:
        info = self._start = self.cluster.call(self.victim, "push_streams")
        if not str(info["endpoint"]).startswith("grpc://"):
            res.notes.append(f"skipped: {self.victim} receives over {info['endpoint']}, not gRPC; the shm "
                             f"socket admits only the worker's own uid (tests/test_shm_security.py)")
            return
        n = info["limit"] + self.EXTRA
        with self._lock:
            self._opened = self.cluster.call(self.bad, "stall_open", endpoint=info["endpoint"], n=n)
        self._timer = threading.Timer(self.hold_s, self._let_go)
        self._timer.start()
        now = self._settled(n)
        res.faults_injected = n - (info["limit"] - info["live"])       # more than the free slots
        shake = self.cluster.call(self.bad, "stall_handshake", endpoint=info["endpoint"])
        answered = f"version {shake['version']}" if "version" in shake else shake.get("error")
        res.notes.append(f"{n} stalled streams on {self.victim}: {now['live'] - info['live']} held, "
                         f"{now['refused'] - info['refused']} refused over the cap of {info['limit']}; "
                         f"a Handshake meanwhile answered {answered} in {shake['seconds'] * 1000:.0f} ms")
        if not shake.get("version"):           # 0: no common version; absent: no answer
            res.violations.append(f"a Handshake to {self.victim} with every Push slot stalled got {shake}")
        if now["live"] > info["limit"]:
            res.violations.append(f"{self.victim} serves {now['live']} Push streams, over its cap {info['limit']}")

    def _settled(self, n: int, wait_s: float = 60.0) -> dict[str, Any]:
        """The receiver's counts once every stalled stream was admitted or refused."""
        end = time.monotonic() + wait_s
        while True:
            now = self.cluster.call(self.victim, "push_streams")
            seen = now["live"] - self._start["live"] + now["refused"] - self._start["refused"]
            if seen >= n or time.monotonic() > end:
                return dict(now)
            time.sleep(0.1)

    def _let_go(self) -> None:
        with self._lock:
            if self._closed is None and self._opened:
                self._closed = self.cluster.call(self.bad, "stall_close")

    def end(self, res: ScenarioResult) -> None:
        """Close every stalled stream; count those refused with RESOURCE_EXHAUSTED as detected;
        any other end, or a stream the receiver still serves afterwards, is a violation."""
        if self._timer is not None:
            self._timer.cancel()
        self._let_go()
        if not self._opened:
            return
        assert self._closed is not None
        ended: dict[str, int] = self._closed["ended"]
        res.faults_detected = ended.get("RESOURCE_EXHAUSTED", 0)
        other = {k: v for k, v in ended.items() if k not in ("RESOURCE_EXHAUSTED", "reply STREAM_CLOSED")}
        if other:
            res.violations.append(f"stalled streams ended otherwise than refused or closed by us: {other}")
        live = self._drained()
        if live:
            res.violations.append(f"{self.victim} still serves {live} Push streams after they were closed")
        res.notes.append(f"stalled streams ended: {dict(sorted(ended.items()))}; {self.victim}'s live Push "
                         f"streams afterwards: {live}")
        for o in self.outs:
            if o.outcome == "error" and "RESOURCE_EXHAUSTED" not in o.error:
                res.violations.append(f"request {o.job.index} failed, not for the full receiver: {o.error[:160]}")

    def _drained(self, wait_s: float = 15.0) -> int:
        end = time.monotonic() + wait_s
        while True:
            live = int(self.cluster.call(self.victim, "push_streams")["live"])
            if live <= self._start["live"] or time.monotonic() > end:
                return live
            time.sleep(0.1)
