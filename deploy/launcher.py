"""Starting and stopping a Tandem deployment on Ray: the registry, one actor per worker in a
placement group, and the gateway on the driver's node.

    d = Deployment(settings).start()     # returns once /health answers 200
    print(d.url)
    d.remove_worker("decode-1")          # scale down: drain one worker (its streams move on), end it
    d.stop()                             # drain within the grace period, free pages, shut down

Without an address the deployment runs on a Ray of its own, held in a session of its own
(deploy/local_ray.py), so a SIGTERM to the driver's process group leaves Ray up for the drain.

The worker actors are `deploy.actors.WorkerActor`s unless the caller gives a subclass
(`worker_class`, with `worker_args` appended to its constructor's arguments): the way a chaos
run puts its injectors into every worker without deploy knowing of them.
"""

from __future__ import annotations

import logging
import os
import ssl
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from deploy import registry as reg
from deploy.actors import GatewayActor, WorkerActor
from deploy.local_ray import LocalRay, keep_loopback
from deploy.settings import ServeSettings
from engine.options import fields_of
from kv_transfer.frame import new_cluster_secret
from kv_transfer.tls import ClusterCA, TlsIdentity
from worker.types import Role

log = logging.getLogger("tandem.deploy")


class Deployment:
    def __init__(self, settings: ServeSettings, say: Callable[[str], object] = print,
                 worker_class: type[WorkerActor] = WorkerActor, worker_args: tuple[Any, ...] = ()) -> None:
        """`worker_class`: the class each worker's Ray actor is made of (a WorkerActor subclass
        whose constructor takes WorkerActor's arguments followed by `worker_args`)."""
        self.s, self.say = settings, say
        self.worker_class, self.worker_args = worker_class, worker_args
        self.workers: dict[str, reg.ActorHandle] = {}
        self.roles: dict[str, Role] = {}   # worker id -> its role
        self.gateways: list[reg.ActorHandle] = []
        self.pg: PlacementGroup | None = None
        self.urls: list[str] = []          # one per gateway replica, once started
        self._local_ray: LocalRay | None = None   # the Ray this deployment started (no --address)
        self._undo_loopback: Callable[[], None] = lambda: None   # keep_loopback's, once joined
        self._secret = new_cluster_secret()  # handed to every worker and gateway through Ray, never logged
        self.ca: ClusterCA | None = None     # this start's cluster CA, when TLS is on (made in start)

    def start(self, timeout_s: float = 600.0, on_ray_started: Callable[[], object] | None = None) -> "Deployment":
        s = self.s
        self._init_ray()
        if on_ray_started is not None:
            on_ray_started()
        registry = self.registry = reg.get_or_create(self._secret)
        roles = s.roles()
        bundles = [self._bundle(role) for role in roles]
        pg = self.pg = placement_group(bundles, strategy=s.placement_strategy)
        if not pg.wait(timeout_seconds=int(timeout_s)):
            raise RuntimeError(f"Ray could not place {len(bundles)} workers ({bundles}) with strategy "
                               f"{s.placement_strategy}: not enough resources in the cluster")
        self._tls_for(pg)
        self._start_workers(pg, roles, bundles)
        self.say(f"tandem: loading {s.model} on {len(roles)} worker(s): {', '.join(self.workers)}")
        if s.engine.compile and any(r != Role.PREFILL for r in roles):
            self.say("tandem: the decode workers compile their decode step first (the first start on a node is "
                     "slow, later ones read the cache in $TANDEM_CACHE_DIR, default ~/.cache/tandem; progress in "
                     "each worker's log; --no-compile skips it)")
        for wid, actor in self.workers.items():
            address: str = ray.get(actor.address.remote(), timeout=timeout_s)
            self.say(f"tandem: {wid} ready at {address}")
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.gateways = [GatewayActor.options(scheduling_strategy=here)  # type: ignore[attr-defined]
                         .remote(self._gateway_config(i), registry) for i in range(s.gateway_replicas)]
        self.urls = ray.get([g.url.remote() for g in self.gateways], timeout=timeout_s)
        for url in self.urls:
            self._wait_healthy(url, timeout_s)
        return self

    def _tls_for(self, pg: PlacementGroup) -> None:
        """Decide on mutual TLS (--tls; auto: on when the placed workers and this node, where
        the gateway runs, are more than one node) and, if on, make this start's cluster CA."""
        placed = set(placement_group_table(pg).get("bundles_to_node_id", {}).values())
        nodes = len(placed | {ray.get_runtime_context().get_node_id()})
        self.ca = ClusterCA() if self.s.use_tls(nodes) else None
        self.say(f"tandem: {nodes} node(s); worker RPCs and KV transfers "
                 f"{'over mutual TLS (a new cluster CA)' if self.ca else 'in plaintext (--tls ' + self.s.tls + ')'}")

    def _identity(self, name: str, node_id: str | None) -> TlsIdentity | None:
        """`name`'s certificate from this start's CA (naming its node's IP), or None without TLS."""
        if self.ca is None:
            return None
        ips = [n["NodeManagerAddress"] for n in ray.nodes() if n.get("NodeID") == node_id]
        return self.ca.issue(name, hosts=["127.0.0.1", *ips])

    def _start_workers(self, pg: PlacementGroup, roles: list[Role], bundles: list[dict[str, float]]) -> None:
        """One actor of `worker_class` per role, in its bundle of `pg`.  Its arguments are plain
        values (the registry by name): a restart never depends on an object the driver owns."""
        s = self.s
        secret = self._secret
        host = s.worker_host or ("127.0.0.1" if s.address is None else None)   # None: the node's IP
        actor_class = ray.remote(self.worker_class)
        counts: dict[Role, int] = {}
        node_of = placement_group_table(pg).get("bundles_to_node_id", {})
        for i, role in enumerate(roles):
            wid = f"{role.value}-{counts.setdefault(role, 0)}"
            counts[role] += 1
            config = {**fields_of(s.worker_settings(role)), "tls": self._identity(wid, node_of.get(i))}
            self.workers[wid] = actor_class.options(
                name=f"tandem-{wid}", namespace=reg.NAMESPACE, max_restarts=s.max_restarts,
                num_cpus=bundles[i].get("CPU", 0), num_gpus=bundles[i].get("GPU", 0),
                resources={k: v for k, v in bundles[i].items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            ).remote(wid, role, i, config, secret, reg.NAME, host, self._cores(i), *self.worker_args)
            self.roles[wid] = role

    @property
    def url(self) -> str:
        """The first gateway's URL ("" before start)."""
        return self.urls[0] if self.urls else ""

    def _init_ray(self) -> None:
        s = self.s
        if ray.is_initialized():
            return
        address = s.address
        if address is None:
            # a Ray of our own, in a session of its own and on loopback only (deploy/local_ray.py
            # says why), with enough logical CPUs for every worker (they share the real cores)
            self._local_ray = LocalRay(num_cpus=max(os.cpu_count() or 1, len(s.roles()) + 1),
                                       object_store_memory=200 * 1024 * 1024).start()
            address = self._local_ray.address
        self._undo_loopback = keep_loopback(address)
        # logging_level: a level name, which ray accepts though its annotation says int
        ray.init(address=address, namespace=reg.NAMESPACE, logging_level=s.log_level.upper(),  # type: ignore[arg-type]
                 log_to_driver=s.log_level.lower() == "debug")

    def _cores(self, i: int) -> list[int] | None:
        """Worker i's own cores when --worker-cores is set (round robin over this machine's)."""
        n = self.s.worker_cores
        if not n:
            return None
        total = os.cpu_count() or 1
        return sorted({(i * n + k) % total for k in range(n)})

    def _bundle(self, role: Role) -> dict[str, float]:
        b = {"CPU": 1.0}
        if self.s.gpus_per_worker:
            b["GPU"] = self.s.gpus_per_worker
        b.update(self.s.worker_resources.get(role.value, {}))
        return b

    def _gateway_config(self, replica: int) -> dict[str, Any]:
        """GatewayConfig's fields for gateway `replica` but its workers (the actor finds them):
        the settings, on --port + replica, and what this deployment wires in."""
        return {**self.s.gateway_fields(replica), "cluster_secret": self._secret,
                "tls": self._identity(f"gateway-{replica}", ray.get_runtime_context().get_node_id())}

    def _wait_healthy(self, url: str, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        # a liveness probe of our own gateway on this node: with HTTPS its certificate may be one
        # no local trust store knows (self-signed); what is probed is whether it answers
        context = ssl._create_unverified_context() if url.startswith("https:") else None
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5, context=context) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"the gateway at {url} did not become healthy in {timeout_s}s")
            time.sleep(0.2)

    def remove_worker(self, wid: str, grace_s: float | None = None) -> dict[str, Any]:
        """Scale down by one worker: drain it (it admits nothing new, its live requests may finish
        for `grace_s`, default the deployment's drain grace, and the rest end with DRAINING, which
        the gateway continues on another worker), stop it, unregister it and end its actor for
        good.  Returns the drain's counts {"finished", "drained", "draining"}.  Its placement
        group bundle stays reserved.  Raises KeyError for an unknown worker."""
        actor = self.workers.pop(wid)
        role = self.roles.pop(wid)
        grace = self.s.worker.drain_grace_s if grace_s is None else grace_s
        try:
            counts: dict[str, Any] = ray.get(actor.drain.remote(grace), timeout=grace + 60)
            ray.get(actor.stop.remote(), timeout=60)
        except Exception:
            self.workers[wid], self.roles[wid] = actor, role
            raise
        ray.kill(actor, no_restart=True)
        self.say(f"tandem: removed {wid}: {counts['finished']} request(s) finished, {counts['drained']} moved on")
        return counts

    def stop(self) -> None:
        """Shut down within the drain grace (`worker.drain_grace_s`): the gateways stop admitting
        (503) and let in-flight requests finish, then every worker drains for what is left of
        the grace (what still runs ends with DRAINING), stops and unregisters; then the actors,
        the placement group, the registry and a Ray of our own end."""
        try:
            self._drain_and_stop()
        finally:
            if self._local_ray is not None:
                ray.shutdown()
                self._local_ray.stop()
            self._undo_loopback()

    def _drain_and_stop(self) -> None:
        end = time.monotonic() + self.s.worker.drain_grace_s
        # requests that end while the gateways wait are counted there: the workers' drain
        # that follows sees only what the grace period left running
        finished = left = drained = 0
        for counts in ray.get([g.drain.remote(self.s.worker.drain_grace_s) for g in self.gateways]):
            finished, left = finished + counts["finished"], left + counts["left"]
        if left:
            self.say(f"tandem: {left} request(s) still running after the grace period: ending them")
        drains = {wid: a.drain.remote(max(0.0, end - time.monotonic())) for wid, a in self.workers.items()}
        for wid, ref in drains.items():
            try:
                counts = ray.get(ref, timeout=self.s.worker.drain_grace_s + 60)
                finished, drained = finished + counts["finished"], drained + counts["drained"]
            except Exception as e:  # a worker that died is already gone
                log.warning("draining %s: %s", wid, e)
            try:
                ray.get(self.workers[wid].stop.remote(), timeout=60)
            except Exception as e:
                log.warning("stopping %s: %s", wid, e)
        self.say(f"tandem: drained: {finished} request(s) finished in the grace period, {drained} ended by the drain")
        for g in self.gateways:
            ray.get(g.stop.remote(), timeout=30)
            ray.kill(g)
        for actor in self.workers.values():
            ray.kill(actor, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)
        registry = getattr(self, "registry", None)
        if registry is None and ray.is_initialized():
            try:
                registry = reg.lookup()
            except ValueError:
                pass
        if registry is not None:
            ray.kill(registry)
