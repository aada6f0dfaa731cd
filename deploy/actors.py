"""The Ray actors of a Tandem deployment: one per worker (prefill, decode or colocated) and
the gateway.  A worker actor registers its service address in the registry when it starts,
and again when Ray restarts it after a crash."""

from __future__ import annotations

import logging
import threading

import ray

log = logging.getLogger("tandem.deploy")
HEARTBEAT_S = 2.0


@ray.remote
class WorkerActor:
    def __init__(self, worker_id: str, role: str, config: dict, secret: bytes, registry, host: str | None,
                 cores: list[int] | None = None, chaos_seed: int | None = None):
        from worker.config import WorkerConfig
        from worker.types import Role
        if cores:
            _pin(cores)
        ip = ray.util.get_node_ip_address()
        cfg = WorkerConfig(**config, secret=secret, host=host or ip)
        self.role, self.worker_id, self.registry = role, worker_id, registry
        self.chaos = None
        if chaos_seed is not None:                 # a chaos run: this worker's injectors
            from chaos.control import ChaosControl
            self.chaos = ChaosControl(role, chaos_seed)
        from deploy.worker import start_worker
        self.handle = start_worker(Role(role), cfg)
        if self.chaos is not None:
            self.chaos.attach(self.handle)
        # what the registry serves; the rest (health, KV, experts) is read live from the worker
        self.info = {"role": role, "address": self.handle.address, "node_ip": ip,
                     "node_id": ray.get_runtime_context().get_node_id()}
        ray.get(registry.register.remote(worker_id, self.info))
        self._stopped = threading.Event()
        threading.Thread(target=self._heartbeat, name="registry-heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        """Re-register every HEARTBEAT_S: a registry that was restarted learns of us again."""
        while not self._stopped.wait(HEARTBEAT_S):
            try:
                self.registry.register.remote(self.worker_id, self.info)
            except Exception as e:  # the registry is restarting: next beat
                log.warning("registry heartbeat: %s", e)

    def address(self) -> str:
        return self.handle.address

    def chaos_call(self, op: str, **kw):
        """A chaos run's request to this worker (arm, disarm, ledger, idle_check)."""
        if self.chaos is None:
            raise RuntimeError("this deployment was not started for a chaos run")
        return getattr(self.chaos, op)(**kw)

    def stop(self) -> None:
        """End every live request with an explicit error, release every page, stop serving."""
        self._stopped.set()
        self.handle.stop()
        ray.get(self.registry.unregister.remote(self.worker_id))


def _pin(cores: list[int]) -> None:
    """Run this worker on `cores` only (its compute threads included)."""
    import os

    import torch
    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))


@ray.remote(num_cpus=0)
class GatewayActor:
    def __init__(self, config: dict, registry):
        from gateway.config import GatewayConfig
        from gateway.server import GatewayServer
        self.registry = registry
        found = self._discover()
        self.server = GatewayServer(GatewayConfig(**config, decode_workers=tuple(found["decode"]),
                                                  prefill_workers=tuple(found["prefill"]),
                                                  colocated_workers=tuple(found["colocated"])),
                                    discover=self._discover).start()

    def _discover(self) -> dict[str, list[str]]:
        return ray.get(self.registry.addresses.remote())

    def url(self) -> str:
        return self.server.url

    def drain(self, timeout_s: float) -> int:
        """Stop admitting; wait up to `timeout_s` for in-flight requests.  Returns how many are left."""
        return self.server.drain(timeout_s)

    def stop(self) -> None:
        self.server.stop()
