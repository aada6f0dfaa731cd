"""Starting and stopping a worker process's services, whatever its role: the engine core it
serves, the gRPC server, and the handle that stops them.  The roles assemble themselves in
`prefill_worker/server.py`, `decode_worker/server.py` and (colocated) `deploy/colocated.py`."""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable

import grpc
import torch

from engine.config import ModelConfig
from engine.core import EngineCore
from kv_transfer.auth import AuthInterceptor, Verifier
from kv_transfer.hooks import TransferHooks
from kv_transfer.receiver import TransferReceiver
from kv_transfer.tls import add_port
from worker.cache_events import CacheEventStreams
from worker.config import WorkerConfig
from worker.drain import DrainResult, drain
from worker.loop import WorkerLoop
from worker.role import RoleEngine
from worker.types import Role

log = logging.getLogger("tandem.worker")
RPC_THREADS = 512
LOOP_STOP_S = 120.0     # the longest a step may take to finish when the worker stops
SERVICE_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
]


@dataclass
class WorkerHandle:
    """A running worker: its service address, its engine core and lock, and how to stop it."""
    role: Role
    address: str                      # host:port of its gRPC service
    core: EngineCore
    lock: threading.RLock             # held for every page ownership change off the loop's thread
    server: grpc.Server
    loop: WorkerLoop
    roles: list[RoleEngine] = field(default_factory=list)
    closers: list[Callable[[], None]] = field(default_factory=list)
    # the decode side's transfer receiver (decode and colocated workers; None on a prefill
    # worker), for reading its refusal and failure logs and counters; its pages stay the core's
    receiver: TransferReceiver | None = None
    auth: Verifier | None = None      # checks every call's credentials (its RPC and transfer servers)
    transfer_endpoint: str | None = None   # where prefill pushes to it (decode, colocated); None on prefill
    cache_events: CacheEventStreams | None = None   # its CacheEvents subscribers (the servicer's)
    stopped: bool = False

    def counts(self) -> Counter[str]:
        """The roles' request counters (submitted, pushed, reserved, finished, failed) and the
        calls refused for their credentials (unauthenticated)."""
        total: Counter[str] = Counter()
        for role in self.roles:
            total.update(role.counts)
        if self.auth is not None:
            total["unauthenticated"] = self.auth.refused
        return total

    def install_transfer_hooks(self, hooks: TransferHooks) -> None:
        """Route the transfers this worker sends and receives through `hooks` from now on (a
        chaos run installs its fault injectors this way)."""
        for role in self.roles:
            role.install_hooks(hooks)

    def drain(self, grace_s: float, undo: bool = False) -> DrainResult:
        """Stop admitting (new requests are refused with DRAINING, Health says draining), let the
        live requests finish for up to `grace_s`, then end the rest with DRAINING and free their
        pages (the gateway migrates a decode worker's streams).  Returns when none is left.
        `undo`: admit again (an undrained worker serves as before; nothing waits)."""
        if undo:
            for role in self.roles:
                role.undrain()
            return DrainResult(finished=0, drained=0)
        return drain(self.roles, grace_s)

    @property
    def draining(self) -> bool:
        return any(role.draining for role in self.roles)

    def stop(self, grace_s: float = 2.0) -> None:
        """End every live request with an explicit error, release all pages, stop serving."""
        if self.stopped:
            return
        self.stopped = True
        for role in self.roles:         # new Generate/Prefill calls are refused from here on
            role.closing = True
        self.core.pool.events.close()   # CacheEvents streams end now
        if self.loop.stop(LOOP_STOP_S):   # from here on, only this thread changes page ownership
            for role in self.roles:
                role.shutdown()
        else:                             # a step still runs: freeing pages it may write breaks I5
            log.error("the worker loop did not stop within %.0f s; its requests' pages stay "
                      "allocated and their streams end with the server", LOOP_STOP_S)
        self.server.stop(grace_s).wait()
        self.core.guides.close()
        for close in self.closers:
            close()


def build_core(config: WorkerConfig, interleave: bool = False) -> EngineCore:
    """Load the engine (`interleave`: a worker that prefills and decodes alternates the two).
    Raises ValueError naming the setting to change when the KV pool cannot hold one request of
    the full context (ExpertCheckError from a failed independence check)."""
    tokens = kv_tokens_for_fraction(config) if config.mem_fraction is not None else None
    core = EngineCore(config.engine_config(tokens), interleave=interleave, stop_limits=config.stop_limits)
    if config.verify_experts:
        core.verify_experts()
    if core.pool.capacity_tokens < core.max_model_len:
        raise ValueError(f"kv_cache_tokens ({core.pool.capacity_tokens}) cannot hold one request of the "
                         f"maximum context ({core.max_model_len} tokens): raise --kv-cache-tokens to at "
                         f"least {core.max_model_len} or lower --max-model-len")
    return core


def kv_tokens_for_fraction(config: WorkerConfig) -> int:
    """KV tokens that fit in `mem_fraction` of the device's free memory (host RAM on CPU), at
    the model's KV bytes per token (its KV geometry: K and V per head, or one MLA latent row)."""
    assert config.mem_fraction is not None
    ec = config.engine_config()
    mc = ModelConfig.from_path(ec.model)
    per_token = mc.kv_bytes_per_token(torch.empty(0, dtype=ec.torch_dtype).element_size())
    if torch.device(ec.device).type == "cuda":
        free = torch.cuda.mem_get_info(torch.device(ec.device))[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    tokens = int(free * config.mem_fraction) // per_token
    return tokens // ec.page_size * ec.page_size


def grpc_server(config: WorkerConfig, auth: Verifier) -> tuple[grpc.Server, str]:
    """A gRPC server bound to the configured host and port (0: a free one), not yet started,
    and the address others reach it at.  `auth` refuses (UNAUTHENTICATED) every call without
    valid credentials before its handler runs (I9); with `config.tls` it serves mutual TLS only."""
    # every Generate/Prefill holds a thread for its whole life: leave room for Health/Stats,
    # and refuse (RESOURCE_EXHAUSTED) rather than queue calls beyond the pool
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=RPC_THREADS, thread_name_prefix="worker-rpc"),
                         options=SERVICE_OPTIONS, maximum_concurrent_rpcs=RPC_THREADS - 16,
                         interceptors=[AuthInterceptor(auth)])
    port = add_port(server, f"{config.host}:{config.port}", config.tls)
    if port == 0:
        raise OSError(f"cannot bind the worker's gRPC service to {config.host}:{config.port}")
    return server, f"{config.public_host}:{port}"
