"""The Ray actors of a Tandem deployment: one per worker (prefill, decode or colocated) and
the gateway.  A worker actor registers its service address in the registry when it starts,
and again when Ray restarts it after a crash.

`WorkerActor` is a plain class: the launcher wraps it with `ray.remote` when it starts the
workers.  It is also the extension point for machinery that must live inside a worker
process (a chaos run's injectors): subclass it, override `started`, add the methods the
driver calls, and give the subclass to `Deployment(worker_class=..., worker_args=...)`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

import ray

from deploy.registry import NAMESPACE, ActorHandle, proof
from worker.peers import KnownPeers
from worker.types import Role

if TYPE_CHECKING:
    from worker.server import WorkerHandle

log = logging.getLogger("tandem.deploy")
HEARTBEAT_S = 2.0
RESTART_DELAY_S = 0.5          # drain(restart=True): the reply leaves before the actor is killed


class WorkerActor:
    """One worker process's actor: starts the worker in-process, then registers it.

    Ray constructs it again with the same arguments after a crash (`max_restarts`).  A subclass
    may take more constructor arguments after these (the launcher's `worker_args`)."""

    def __init__(self, worker_id: str, role: Role, index: int, config: dict[str, Any], secret: bytes,
                 registry: str, host: str | None, cores: list[int] | None = None) -> None:
        """`index`: the worker's place among the deployment's workers (0, 1, ...; the same after
        a restart); `config`: WorkerConfig fields except the secret and host (its engine an
        EngineConfig; its drain_grace_s is how long a SIGTERM lets live requests finish);
        `registry`: the registry actor's name, looked up here.  Every argument is a plain value
        (or a small frozen dataclass of them) Ray keeps in the actor's creation task: a restart
        cannot lose one (an actor handle or a value over Ray's inline limit would live in the
        object store, owned by the driver)."""
        from deploy.worker import start_worker
        from worker.config import WorkerConfig
        if cores:
            _pin(cores)
        ip = ray.util.get_node_ip_address()
        cfg = WorkerConfig(**config, secret=secret, host=host or ip)
        self.drain_grace_s = cfg.drain_grace_s     # on SIGTERM
        self.role, self.index, self.worker_id = role, index, worker_id
        self.registry = ray.get_actor(registry, namespace=NAMESPACE)
        self._secret = secret             # for `stats()` and the registry: both refuse callers without it
        self._tls = cfg.tls
        # a prefill worker pushes only to the decode workers the registry knows
        peers = KnownPeers(fetch=lambda: ray.get(self.registry.transfer_endpoints.remote(), timeout=10))
        self.handle: WorkerHandle = start_worker(role, cfg, peers)
        self.started()
        # what the registry serves; the rest (health, KV, experts) is read live from the worker
        self.info = {"role": role.value, "address": self.handle.address, "node_ip": ip,
                     "node_id": ray.get_runtime_context().get_node_id(),
                     "transfer_endpoint": self.handle.transfer_endpoint, "tls": cfg.tls is not None}
        ray.get(self._register())
        self._stopped = threading.Event()
        threading.Thread(target=self._heartbeat, name="registry-heartbeat", daemon=True).start()
        _drain_on_sigterm(self)

    def started(self) -> None:
        """Called once `self.handle` serves, before the worker registers (so no gateway routes
        a request to it before this returns).  The default does nothing; a subclass may install
        transfer hooks here (`self.handle.install_transfer_hooks`).  An exception fails the
        actor's start."""

    def _register(self) -> Any:
        """The registration call (an ObjectRef), with its proof of the cluster secret."""
        ts, mac = proof(self._secret, "register", self.worker_id, self.info)
        return self.registry.register.remote(self.worker_id, self.info, ts, mac)

    def _heartbeat(self) -> None:
        """Re-register every HEARTBEAT_S: a registry that was restarted learns of us again."""
        while not self._stopped.wait(HEARTBEAT_S):
            try:
                self._register()
            except Exception as e:  # the registry is restarting: next beat
                log.warning("registry heartbeat: %s", e)

    def address(self) -> str:
        return self.handle.address

    def stats(self) -> bytes:
        """The worker's `Stats` reply, serialized (for `tandem status`, which runs where the
        cluster secret is not: the actor makes the authenticated call on its behalf).  Raises
        grpc.RpcError when the worker does not answer."""
        from kv_transfer.auth import channel
        from proto import worker_pb2 as wpb
        from proto import worker_pb2_grpc as wpb_grpc
        with channel(self.handle.address, self._secret, tls=self._tls) as ch:
            stub = wpb_grpc.PrefillServiceStub(ch) if self.role == Role.PREFILL else wpb_grpc.DecodeServiceStub(ch)
            reply: wpb.StatsReply = stub.Stats(wpb.StatsRequest(), timeout=5)
            return reply.SerializeToString()

    def drain(self, grace_s: float, restart: bool = False, undo: bool = False) -> dict[str, Any]:
        """Drain the worker (`WorkerHandle.drain`): admit nothing new, let live requests finish
        for up to `grace_s`, end the rest with DRAINING.  Returns {"finished", "drained",
        "draining"}.  `restart`: then stop the worker, unregister it and have Ray restart this
        actor (a fresh worker registers; this uses one of its max_restarts; calls made while it
        restarts meet ActorUnavailableError).  `undo`: admit again."""
        result = self.handle.drain(grace_s, undo=undo)
        out = {"finished": result.finished, "drained": result.drained, "draining": self.handle.draining}
        if restart and not undo:
            self.stop()
            # the restart comes once this reply is on its way (a kill from inside the call could
            # reach the caller as RayActorError instead of the counts)
            me = ray.get_runtime_context().current_actor
            threading.Timer(RESTART_DELAY_S, ray.kill, args=(me,), kwargs={"no_restart": False}).start()
        return out

    def stop(self) -> None:
        """End every live request with an explicit error, release every page, stop serving."""
        self._stopped.set()
        self.handle.stop()
        ts, mac = proof(self._secret, "unregister", self.worker_id)
        ray.get(self.registry.unregister.remote(self.worker_id, ts, mac))


def _drain_on_sigterm(actor: WorkerActor) -> None:
    """SIGTERM to this actor's process drains the worker for `actor.drain_grace_s`, stops it,
    unregisters it and ends the process (Ray restarts the actor while it has restarts left).
    Ray's own handler would end the process at once, cutting every stream; Ray runs a sync
    actor's methods, its constructor included, on the process's main thread, the one place a
    handler can be installed (elsewhere nothing is installed and Ray's handler stays)."""
    if threading.current_thread() is not threading.main_thread():
        log.warning("%s: not on the main thread: SIGTERM ends this worker without a drain", actor.worker_id)
        return

    def drain_then_exit() -> None:
        try:
            result = actor.handle.drain(actor.drain_grace_s)
            log.warning("%s: SIGTERM: drained (%d finished, %d ended with DRAINING); stopping",
                        actor.worker_id, result.finished, result.drained)
            actor.stop()
        finally:
            os._exit(0)

    def on_sigterm(*_: Any) -> None:
        threading.Thread(target=drain_then_exit, name="sigterm-drain", daemon=True).start()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)       # once is enough

    signal.signal(signal.SIGTERM, on_sigterm)


def _pin(cores: list[int]) -> None:
    """Run this worker on `cores` only (its compute threads included)."""
    import os

    import torch
    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(len(cores))


@ray.remote(num_cpus=0)
class GatewayActor:
    def __init__(self, config: dict[str, Any], registry: ActorHandle) -> None:
        from gateway.config import GatewayConfig
        from gateway.server import GatewayServer
        self.registry = registry
        found = self._discover()
        self.server = GatewayServer(GatewayConfig(**config, decode_workers=tuple(found[Role.DECODE.value]),
                                                  prefill_workers=tuple(found[Role.PREFILL.value]),
                                                  colocated_workers=tuple(found[Role.COLOCATED.value])),
                                    discover=self._discover).start()

    def _discover(self) -> dict[str, list[str]]:
        return ray.get(self.registry.addresses.remote())

    def url(self) -> str:
        return self.server.url

    def drain(self, timeout_s: float) -> dict[str, int]:
        """Stop admitting (503 draining); wait up to `timeout_s` for the requests in flight.
        Returns {"finished": those that ended meanwhile, "left": those still running}: a
        stream that ends here ends before any worker drains, so only the gateway saw it finish."""
        gateway = self.server.app.state.gateway
        gateway.draining = True           # (server.drain sets it too) nothing is admitted after this count
        began = gateway.queue.total       # admitted and not ended: waiting for a slot or running
        left = self.server.drain(timeout_s)
        return {"finished": max(0, began - left), "left": left}

    def stop(self) -> None:
        self.server.stop()
