"""`tandem serve`'s settings: one frozen tree built from the flags and checked before anything
starts (a bad flag, a conflict or a missing model fails here, with a message).

    ServeSettings          the deployment: how many workers, where, Ray, TLS
    ├── worker: WorkerSettings     what every worker runs with (worker/config.py)
    │   └── engine: EngineConfig   the engine each worker runs (engine/config.py)
    └── gateway: GatewaySettings   what every gateway replica runs with (gateway/config.py)

Each setting is a field of one of them, its default and help written there once;
`options.build(ServeSettings, kv_cache_tokens=4096, port=0, ...)` takes any field by name."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.options import branch, fields_of, option
from gateway.config import GatewaySettings
from worker.config import WorkerSettings
from worker.types import Role

# Ray's placement group strategies (ray.util.placement_group): PACK and SPREAD are best effort,
# STRICT_PACK puts every worker on one node (what --transfer shm needs), STRICT_SPREAD one per node
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# mutual TLS between the processes: on whenever the workers and the gateway span more than one
# node (auto), always (on: also on one node), or never (off: a trusted network of its own)
TLS_MODES = ("auto", "on", "off")
LOG_LEVELS = ("debug", "info", "warning", "error")


def parse_resources(text: str | None) -> dict[str, dict[str, float]]:
    """--worker-resources '{"decode": {"gpu_node": 1}}'."""
    if not text:
        return {}
    value = json.loads(text)
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise ValueError("--worker-resources must be a JSON object of role -> {resource: amount}")
    return value


@dataclass(frozen=True)
class ServeSettings:
    """A deployment: its own fields, every worker's settings and every gateway's."""
    address: str | None = option(None, says_default=True,
                                 help="join this Ray cluster (auto, or HOST:PORT) instead of starting one; "
                                 "default: start one on 127.0.0.1, listening on loopback only. Joining needs "
                                 "RAY_AUTH_MODE=token here (Ray token authentication)")
    prefill_workers: int = option(1, help="prefill workers to start")
    decode_workers: int = option(1, help="decode workers to start")
    colocated: bool = option(False, action="store_true", help="workers that do both prefill and decode (no KV "
                             "transfer)")
    colocated_workers: int = option(1, help="how many with --colocated")
    worker_host: str | None = option(None, says_default=True, help="where the workers listen (default: 127.0.0.1 "
                                     "on a local Ray, the node's own IP when joining a cluster)")
    prefill_kv_cache_tokens: int | None = option(None, type=int, says_default=True, help="the prefill workers' KV "
                                                 "pool (their prefix cache), in tokens (default: as the others')")
    gpus_per_worker: float = option(0.0, help="each worker's share of a GPU (Ray's num_gpus)")
    placement_strategy: str = option("PACK", choices=PLACEMENT_STRATEGIES, help="Ray's placement of the workers "
                                     "(STRICT_PACK: one node, as --transfer shm needs; STRICT_SPREAD: one worker "
                                     "per node)")
    log_level: str = option("info", choices=LOG_LEVELS, help="the driver's and workers' log level")
    worker_resources: dict[str, dict[str, float]] = option(
        factory=dict, type=parse_resources, metavar="JSON", says_default=True,
        help='extra Ray resources per role, JSON: {"decode": {"gpu_node": 1}} (default: none)')
    worker_cores: int | None = option(None, type=int, says_default=True, help="pin each worker to this many CPU "
                                      "cores of its own, round robin (default: not pinned)")
    gateway_replicas: int = option(1, help="gateways on --port, --port+1, ...")
    max_restarts: int = option(3, help="how often Ray restarts a worker that died")
    tls: str = option("auto", choices=TLS_MODES, help="mutual TLS between workers and gateway with a new cluster "
                      "CA (auto: when they span more than one node)")
    worker: WorkerSettings = branch(WorkerSettings, help="every worker's settings, its engine's included")
    gateway: GatewaySettings = branch(GatewaySettings, help="every gateway replica's settings")

    def __post_init__(self) -> None:
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"--model {self.model}: no config.json there (a HF checkpoint directory is needed)")
        for name in ("prefill_workers", "decode_workers", "colocated_workers", "gateway_replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.prefill_kv_cache_tokens is not None and self.prefill_kv_cache_tokens < 1:
            raise ValueError(f"--prefill-kv-cache-tokens must be >= 1, got {self.prefill_kv_cache_tokens}")
        if self.prefill_kv_cache_tokens is not None and self.colocated:
            raise ValueError("--prefill-kv-cache-tokens sizes prefill workers: --colocated has none "
                             "(use --kv-cache-tokens)")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"--placement-strategy {self.placement_strategy}: choose one of "
                             f"{', '.join(PLACEMENT_STRATEGIES)}")
        if unknown := set(self.worker_resources) - {r.value for r in Role}:
            raise ValueError(f"--worker-resources: {', '.join(sorted(unknown))} is not a role "
                             f"({', '.join(r.value for r in Role)})")
        if self.gpus_per_worker < 0 or (self.engine.device.startswith("cuda") and self.gpus_per_worker == 0):
            raise ValueError("--device cuda needs --gpus-per-worker > 0 (each worker's share of a GPU)")
        if self.tls not in TLS_MODES:
            raise ValueError(f"--tls {self.tls}: choose one of {', '.join(TLS_MODES)}")
        if self.log_level.lower() not in (*LOG_LEVELS, "critical"):
            raise ValueError(f"--log-level {self.log_level}: choose debug, info, warning or error")

    @property
    def engine(self) -> EngineConfig:
        """Every worker's engine (`worker.engine`)."""
        return self.worker.engine

    @property
    def model(self) -> str:
        """The checkpoint every worker loads and every gateway tokenizes with."""
        return self.worker.engine.model

    @property
    def name(self) -> str:
        """The model's name to clients: --served-model-name, or the model directory's name
        (GatewaySettings.model_name, as each gateway names it)."""
        return self.gateway.model_name(self.model)

    def roles(self) -> list[Role]:
        """One entry per worker to start."""
        if self.colocated:
            return [Role.COLOCATED] * self.colocated_workers
        return [Role.PREFILL] * self.prefill_workers + [Role.DECODE] * self.decode_workers

    def worker_settings(self, role: Role) -> WorkerSettings:
        """What a worker of `role` runs with: `worker`, except that a prefill worker never
        compiles the decode step (it runs no decode batch) and, with --prefill-kv-cache-tokens,
        has a pool of that size rather than one sized by --mem-fraction."""
        if role != Role.PREFILL:
            return self.worker
        engine = replace(self.engine, compile=False)
        if self.prefill_kv_cache_tokens is None:
            return replace(self.worker, engine=engine)
        return replace(self.worker, engine=replace(engine, kv_cache_tokens=self.prefill_kv_cache_tokens),
                       mem_fraction=None)

    def gateway_fields(self, replica: int) -> dict[str, Any]:
        """GatewayConfig's fields for gateway `replica` but the wiring its launcher adds (the
        workers, the cluster secret, its certificate): the settings, on --port + replica (0:
        each a free one), the model and the name clients use."""
        port = self.gateway.port + replica if self.gateway.port else 0
        return {**fields_of(replace(self.gateway, port=port)), "model": self.model, "served_model_name": self.name}

    def use_tls(self, nodes: int) -> bool:
        """Whether the processes talk mutual TLS, the workers and gateway spanning `nodes` nodes."""
        return self.tls == "on" or (self.tls == "auto" and nodes > 1)


def check_ray_auth(address: str | None, ray_auth_mode: str | None, allow_insecure: bool) -> str | None:
    """Refuse a Ray cluster that may run without token authentication: anyone who reaches its
    ports (GCS, raylets, dashboard) runs code on it and reads the cluster secret the workers get.

    A Ray driver cannot ask a cluster whether it enforces tokens (a driver in token mode connects
    to a cluster without it as well), so the check is on this process's environment:
    `ray_auth_mode` is RAY_AUTH_MODE here.  Joining a cluster (`address`) passes only with
    "token"; the operator starts every node with it too (deploy/cluster/*.yaml do).  A local
    cluster (`address` None) passes unless RAY_AUTH_MODE says otherwise: Ray then turns token
    authentication on itself, and its ports listen on every interface.  `allow_insecure`
    (--allow-insecure-ray) turns the refusal into the returned warning; None: nothing to say.
    Raises ValueError saying why and what to change."""
    mode = (ray_auth_mode or "").strip().lower()
    if mode == "token" or (address is None and not mode):
        return None
    where = f"--address {address}" if address else "the local Ray cluster"
    why = (f"{where}: Ray token authentication is not known to be on (RAY_AUTH_MODE is {ray_auth_mode or 'unset'} "
           f"in this environment); a Ray cluster without it runs code for anyone who reaches its ports")
    if allow_insecure:
        return f"tandem: warning: {why}; going on because of --allow-insecure-ray"
    raise ValueError(f"{why}. Start every node with RAY_AUTH_MODE=token and the token (RAY_AUTH_TOKEN or "
                     f"RAY_AUTH_TOKEN_PATH), run tandem serve with the same, or pass --allow-insecure-ray")
