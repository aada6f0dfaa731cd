"""The cluster a chaos run attacks: a real Tandem deployment on Ray (registry, worker actors
with injectors, the gateway), plus the handles the run needs to arm faults, read ledgers,
kill workers and check pools.  The workers are `chaos.actor.ChaosWorkerActor`s, given to
deploy's launcher as its worker class; the deployment is otherwise `tandem serve`'s."""

from __future__ import annotations

import json
import logging
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from chaos.actor import ChaosWorkerActor
from chaos.ledger import Ledger
from deploy.launcher import Deployment
from deploy.registry import ActorHandle
from deploy.settings import ServeSettings
from engine.options import build
from worker.types import Role

log = logging.getLogger("tandem.chaos")


@dataclass(frozen=True)
class ClusterShape:
    prefill_workers: int = 1
    decode_workers: int = 2
    kv_cache_tokens: int = 8192
    max_model_len: int = 512
    paged_experts_num_resident: int = 32
    transfer: str = "grpc"
    verify_experts: bool = True       # the expert guard (off: see what corrupt_expert does without it)
    # the gateway resets a response its client has not read this long (slow_reader waits it out);
    # longer than the attacker's generation, so the slots come back before the reset
    stream_idle_timeout_s: float = 20.0


class ChaosCluster:
    def __init__(self, shape: ClusterShape, api_keys: dict[str, str], seed: int,
                 say: Callable[[str], object] = print) -> None:
        """`seed`: the run's; worker i's injectors are seeded with seed + i."""
        self.shape, self.say = shape, say
        self.settings = build(
            ServeSettings,
            prefill_workers=shape.prefill_workers, decode_workers=shape.decode_workers, port=0,
            api_keys=api_keys, kv_cache_tokens=shape.kv_cache_tokens, max_model_len=shape.max_model_len,
            paged_experts_num_resident=shape.paged_experts_num_resident, transfer=shape.transfer,
            verify_experts=shape.verify_experts, max_restarts=100, log_level="error", drain_grace_s=5.0,
            stream_idle_timeout_s=shape.stream_idle_timeout_s)
        self.deployment = Deployment(self.settings, say=lambda m: None, worker_class=ChaosWorkerActor,
                                     worker_args=(seed,))
        self.api_key = next(iter(api_keys))

    def start(self, timeout_s: float = 300.0) -> "ChaosCluster":
        self.deployment.start(timeout_s)
        return self

    @property
    def url(self) -> str:
        return self.deployment.url

    def stop(self) -> None:
        self.deployment.stop()

    def workers(self, role: Role | None = None) -> dict[str, ActorHandle]:
        """Worker id -> actor, of every worker or of one role's."""
        return {w: a for w, a in self.deployment.workers.items()
                if role is None or self.deployment.roles[w] == role}

    def call(self, wid: str, op: str, timeout_s: float = 60.0, **kw: Any) -> Any:
        """One chaos request to a worker (`ChaosWorkerActor.chaos_call`); retried while Ray
        restarts it."""
        end = time.monotonic() + timeout_s
        while True:
            try:
                return ray.get(self.deployment.workers[wid].chaos_call.remote(op, **kw), timeout=timeout_s)
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
                if time.monotonic() > end:
                    raise
                time.sleep(0.25)

    def arm(self, role: Role, point: str, **kw: Any) -> None:
        """Arm `point` on every worker of `role` (ChaosControl.arm's keywords)."""
        for wid in self.workers(role):
            self.call(wid, "arm", point=point, **kw)

    def disarm(self) -> None:
        for wid in self.workers():
            self.call(wid, "disarm")

    def ledger(self, wid: str) -> Ledger:
        """The worker's chaos ledger now."""
        return Ledger.read(self.call(wid, "ledger"))

    def ledgers(self) -> dict[str, Ledger]:
        """Every worker's chaos ledger now."""
        return {wid: self.ledger(wid) for wid in self.workers()}

    def kill(self, wid: str) -> None:
        """SIGKILL-like end of the worker's process; Ray restarts the actor."""
        ray.kill(self.deployment.workers[wid], no_restart=False)

    def drain(self, wid: str, grace_s: float, restart: bool = True, timeout_s: float = 120.0) -> Any:
        """Drain a worker (`WorkerActor.drain`): it admits nothing new, its requests may finish
        for `grace_s`, then the rest end with DRAINING (the gateway continues them elsewhere);
        `restart`: the worker then starts afresh.  Returns the actor's answer, None when the
        call ended with the actor's own restart."""
        try:
            return ray.get(self.deployment.workers[wid].drain.remote(grace_s, restart=restart), timeout=timeout_s)
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
            return None

    def wait_recovered(self, timeout_s: float = 120.0) -> float:
        """Block until every worker actor answers and the gateway sees all of them healthy.
        Returns the seconds it took; raises TimeoutError."""
        t0 = time.monotonic()
        want = self.shape.prefill_workers + self.shape.decode_workers
        for actor in self.deployment.workers.values():
            while True:                 # a call may meet the restart itself: ask again
                try:
                    ray.get(actor.address.remote(), timeout=timeout_s)
                    break
                except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
                    if time.monotonic() - t0 > timeout_s:
                        raise TimeoutError(f"a worker did not come back in {timeout_s}s") from None
                    time.sleep(0.25)
        while time.monotonic() - t0 < timeout_s:
            info = self.server_info()
            if sum(w["healthy"] for w in info.get("workers", [])) >= want:
                return time.monotonic() - t0
            time.sleep(0.25)
        raise TimeoutError(f"the cluster did not recover in {timeout_s}s")

    def server_info(self) -> dict[str, Any]:
        req = urllib.request.Request(self.url + "/v1/server_info",
                                     headers={"Authorization": f"Bearer {self.api_key}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                info: dict[str, Any] = json.loads(r.read())
                return info
        except OSError:
            return {}

    def limit(self) -> int:
        """prompt_tokens + max_tokens may not exceed this (the context; KV capacity is larger)."""
        return int(self.server_info()["context_length"])

    def wait_idle(self, timeout_s: float = 90.0) -> dict[str, dict[str, Any]]:
        """Poll every worker's pool until no request holds a page (or the time is up); returns
        the idle checks made then, which also re-hash every cached page (contents) and scan
        every expert slot."""
        end = time.monotonic() + timeout_s
        while True:
            checks = {wid: self.call(wid, "idle_check") for wid in self.workers()}
            if all(c["used"] == 0 for c in checks.values()) or time.monotonic() > end:
                return {wid: self.call(wid, "idle_check", contents=True) for wid in self.workers()}
            time.sleep(0.25)
