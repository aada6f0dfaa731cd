"""`tandem serve`'s settings: one frozen dataclass built from the flags and checked before
anything starts (a bad flag, a conflict or a missing model fails here, with a message)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.config import SHIPPED_MODEL, compile_default
from gateway.config import FRONT_DOOR_FLAGS, REASONING_CHOICES, ROUTING_MODES, TOOL_CALL_CHOICES, GatewayConfig
from worker.config import MAX_NUM_SEQS, check_compile_buckets, parse_compile_buckets
from worker.types import Role

# Ray's placement group strategies (ray.util.placement_group): PACK and SPREAD are best effort,
# STRICT_PACK puts every worker on one node (what --transfer shm needs), STRICT_SPREAD one per node
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# mutual TLS between the processes: on whenever the workers and the gateway span more than one
# node (auto), always (on: also on one node), or never (off: a trusted network of its own)
TLS_MODES = ("auto", "on", "off")
# what a connection and a client address may hold at the gateway (gateway/connections.py), and
# how a prompt string is read: GatewayConfig's fields, passed through as they are
FRONT_DOOR = (*FRONT_DOOR_FLAGS, "prompt_special_tokens")


def _gateway_default(name: str) -> Any:
    """GatewayConfig's default of `name` (written once, there)."""
    return next(f.default for f in fields(GatewayConfig) if f.name == name)


@dataclass(frozen=True)
class ServeSettings:
    address: str | None = None              # an existing Ray cluster ("auto"), or None: start one
    model: str = str(SHIPPED_MODEL)
    served_model_name: str | None = None
    prefill_workers: int = 1
    decode_workers: int = 1
    colocated: bool = False
    colocated_workers: int = 1
    host: str = "127.0.0.1"                 # the gateway's
    port: int = 8000
    worker_host: str | None = None          # workers listen here; None: 127.0.0.1 on a local Ray,
                                            # the node's own IP when joining a cluster
    api_keys: dict[str, str] = field(default_factory=dict, repr=False)   # key -> tenant
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None
    kv_cache_tokens: int | None = None
    prefill_kv_cache_tokens: int | None = None   # prefill workers' pool (their prefix cache); None: as the rest
    mem_fraction: float | None = None
    paged_experts_num_resident: int | None = None
    # decode workers' steps run compiled (False: --no-compile); read from TANDEM_COMPILE here, in
    # the driver, and handed to every worker, so a worker's own environment does not decide it
    compile: bool = field(default_factory=compile_default)
    compile_buckets: tuple[int, ...] | None = None   # --compile-buckets; None: 1, 2, 4, ... up to max_num_seqs
    gpus_per_worker: float = 0.0
    placement_strategy: str = "PACK"
    log_level: str = "info"
    transfer: str = "grpc"
    worker_resources: dict[str, dict[str, float]] = field(default_factory=dict)   # role -> extra Ray resources
    worker_cores: int | None = None         # pin each worker to this many cores of its own (CPU runs)
    gateway_replicas: int = 1               # gateways on ports port, port+1, ... (same registry)
    max_restarts: int = 3
    drain_timeout_s: float = 30.0           # --drain-grace-s: how long a shutdown, a scale-down or a SIGTERM'd
                                            # worker lets live requests finish before ending them (DRAINING)
    max_migrations: int = 3                 # how often one response may move to another decode worker
    verify_experts: bool = False            # guard mode: check expert slots before each use
    tls: str = "auto"                       # TLS_MODES
    ssl_certfile: str | None = None         # the gateway's HTTPS certificate and key (PEM files)
    ssl_keyfile: str | None = None
    default_max_tokens: int = 1024          # a chat request's max_tokens when it gives none
    tenant_max_kv_tokens: int | None = None  # KV a tenant may hold reserved; None: half the cluster's
    admin_keys: tuple[str, ...] = field(default=(), repr=False)   # /metrics and /v1/server_info need one
    stream_idle_timeout_s: float = 30.0     # a response its client does not read this long is reset
    prefix_cache: bool = True               # False (--no-prefix-cache): every worker computes and moves whole prompts
    routing: str = "prefix"                 # how the gateway picks workers (gateway/routing.py): ROUTING_MODES
    reasoning_parser: str = "auto"          # how the gateway reads the output (gateway/chat.py): REASONING_CHOICES
    tool_call_parser: str = "auto"          # ... and TOOL_CALL_CHOICES
    # the gateway's front door (FRONT_DOOR): its defaults are GatewayConfig's
    max_header_bytes: int = _gateway_default("max_header_bytes")
    header_timeout_s: float = _gateway_default("header_timeout_s")
    body_timeout_s: float = _gateway_default("body_timeout_s")
    max_connections: int = _gateway_default("max_connections")
    max_connections_per_client: int = _gateway_default("max_connections_per_client")
    prompt_special_tokens: bool = _gateway_default("prompt_special_tokens")

    def __post_init__(self) -> None:
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"--model {self.model}: no config.json there (a HF checkpoint directory is needed)")
        for name in ("prefill_workers", "decode_workers", "colocated_workers", "gateway_replicas"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_tokens is not None and self.mem_fraction is not None:
            raise ValueError("--kv-cache-tokens and --mem-fraction both size the KV cache: give one")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError(f"--kv-cache-tokens must be >= 1, got {self.kv_cache_tokens}")
        if self.prefill_kv_cache_tokens is not None and self.prefill_kv_cache_tokens < 1:
            raise ValueError(f"--prefill-kv-cache-tokens must be >= 1, got {self.prefill_kv_cache_tokens}")
        if self.prefill_kv_cache_tokens is not None and self.colocated:
            raise ValueError("--prefill-kv-cache-tokens sizes prefill workers: --colocated has none "
                             "(use --kv-cache-tokens)")
        if self.mem_fraction is not None and not 0 < self.mem_fraction < 1:
            raise ValueError(f"--mem-fraction must be in (0, 1), got {self.mem_fraction}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"--placement-strategy {self.placement_strategy}: choose one of "
                             f"{', '.join(PLACEMENT_STRATEGIES)}")
        if unknown := set(self.worker_resources) - {r.value for r in Role}:
            raise ValueError(f"--worker-resources: {', '.join(sorted(unknown))} is not a role "
                             f"({', '.join(r.value for r in Role)})")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port {self.port} is not a TCP port")
        if self.gpus_per_worker < 0 or (self.device.startswith("cuda") and self.gpus_per_worker == 0):
            raise ValueError("--device cuda needs --gpus-per-worker > 0 (each worker's share of a GPU)")
        if not 0 <= self.drain_timeout_s < float("inf"):
            raise ValueError(f"--drain-grace-s must be >= 0, got {self.drain_timeout_s}")
        if self.max_migrations < 0:
            raise ValueError(f"--max-migrations must be >= 0, got {self.max_migrations}")
        if self.default_max_tokens < 1:
            raise ValueError(f"--default-max-tokens must be >= 1, got {self.default_max_tokens}")
        if self.tenant_max_kv_tokens is not None and self.tenant_max_kv_tokens < 1:
            raise ValueError(f"--tenant-max-kv-tokens must be >= 1, got {self.tenant_max_kv_tokens}")
        if not all(self.admin_keys):
            raise ValueError("an empty admin key would let anyone in: refused")
        if not 0 < self.stream_idle_timeout_s < float("inf"):
            raise ValueError(f"--stream-idle-timeout must be > 0, got {self.stream_idle_timeout_s}")
        if self.routing not in ROUTING_MODES:
            raise ValueError(f"--routing {self.routing}: choose one of {', '.join(ROUTING_MODES)}")
        for name in FRONT_DOOR_FLAGS:
            if not 0 < getattr(self, name) < float("inf"):
                flag = name.removesuffix("_s").replace("_", "-")
                raise ValueError(f"--{flag} must be > 0, got {getattr(self, name)}")
        for flag, value, known in (("--reasoning-parser", self.reasoning_parser, REASONING_CHOICES),
                                   ("--tool-call-parser", self.tool_call_parser, TOOL_CALL_CHOICES)):
            if value not in known:
                raise ValueError(f"{flag} {value}: choose one of {', '.join(known)}")
        if self.tls not in TLS_MODES:
            raise ValueError(f"--tls {self.tls}: choose one of {', '.join(TLS_MODES)}")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("HTTPS needs both --ssl-certfile and --ssl-keyfile")
        for flag, path in (("--ssl-certfile", self.ssl_certfile), ("--ssl-keyfile", self.ssl_keyfile)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")
        if self.compile_buckets is not None:
            try:
                check_compile_buckets(self.compile_buckets)
            except ValueError as e:
                raise ValueError(f"--compile-buckets: {e}") from None
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError(f"--log-level {self.log_level}: choose debug, info, warning or error")

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def roles(self) -> list[Role]:
        """One entry per worker to start."""
        if self.colocated:
            return [Role.COLOCATED] * self.colocated_workers
        return [Role.PREFILL] * self.prefill_workers + [Role.DECODE] * self.decode_workers

    def worker_config(self, role: Role | None = None) -> dict:
        """What a worker of `role` gets (WorkerConfig fields; the secret travels separately):
        the same for every role but a prefill worker's KV pool with --prefill-kv-cache-tokens,
        and a prefill worker never compiles the decode step (it runs no decode batch)."""
        cfg: dict[str, str | int | float | bool | tuple[int, ...] | None] = dict(
            model=self.model, dtype=self.dtype, device=self.device, max_model_len=self.max_model_len,
            paged_experts_num_resident=self.paged_experts_num_resident, transfer=self.transfer,
            verify_experts=self.verify_experts, prefix_cache=self.prefix_cache,
            compile=self.compile and role != Role.PREFILL, compile_buckets=self.compile_buckets)
        if self.kv_cache_tokens is not None:
            cfg["kv_cache_tokens"] = self.kv_cache_tokens
        if self.mem_fraction is not None:
            cfg["mem_fraction"] = self.mem_fraction
        if role == Role.PREFILL and self.prefill_kv_cache_tokens is not None:
            cfg["kv_cache_tokens"] = self.prefill_kv_cache_tokens
            cfg.pop("mem_fraction", None)
        return cfg

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


def add_compile_flags(parser: argparse.ArgumentParser, max_num_seqs: int = MAX_NUM_SEQS) -> None:
    """--no-compile and --compile-buckets (dest `compile`, `compile_buckets`); a bad bucket list
    is an argparse error naming the entry and the limit `max_num_seqs`."""
    parser.add_argument("--no-compile", dest="compile", action="store_false", default=compile_default(),
                        help="decode steps run eager: no start-up compilation (debugging). Default: compiled, "
                        "unless TANDEM_COMPILE=0 is set")
    parser.add_argument("--compile-buckets", default=None, metavar="SIZES",
                        type=lambda text: _buckets_arg(text, max_num_seqs),
                        help=f"the decode batch sizes compiled at start-up, e.g. 1,2,4,8 (each 1..{max_num_seqs}; "
                        f"default 1,2,4,...,{max_num_seqs}); a batch is padded to the next size, a batch above the "
                        "largest runs eager")


def _buckets_arg(text: str, max_num_seqs: int) -> tuple[int, ...]:
    try:
        return parse_compile_buckets(text, max_num_seqs)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_resources(text: str | None) -> dict[str, dict[str, float]]:
    """--worker-resources '{"decode": {"gpu_node": 1}}'."""
    if not text:
        return {}
    value = json.loads(text)
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise ValueError("--worker-resources must be a JSON object of role -> {resource: amount}")
    return value
