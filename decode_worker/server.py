"""Starting and stopping worker processes' services: the decode worker here, the prefill
worker in prefill_worker/server.py, the colocated worker in decode_worker/colocated.py."""

from __future__ import annotations

import tempfile
import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from decode_worker.config import WorkerConfig
from decode_worker.engine import DecodeEngine
from decode_worker.loop import WorkerLoop
from decode_worker.service import DecodeServicer, add_to_server
from engine import LLM

RPC_THREADS = 512
SERVICE_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
]


@dataclass
class WorkerHandle:
    """A running worker: its service address and how to stop it."""
    role: str
    address: str                      # host:port of its gRPC service
    llm: LLM
    server: grpc.Server
    loop: WorkerLoop
    engines: list = field(default_factory=list)
    closers: list = field(default_factory=list)
    stopped: bool = False

    def stop(self, grace_s: float = 2.0) -> None:
        """End every live request with an explicit error, release all pages, stop serving."""
        if self.stopped:
            return
        self.stopped = True
        for engine in self.engines:     # new Generate/Prefill calls are refused from here on
            engine.closing = True
        self.loop.stop()                # from here on, only this thread changes page ownership
        for engine in self.engines:
            engine.shutdown()
        self.server.stop(grace_s).wait()
        for close in self.closers:
            close()


def build_llm(config: WorkerConfig) -> LLM:
    """Load the engine.  Raises ValueError naming the setting to change when the KV pool cannot
    hold one request of the full context (ExpertCheckError from a failed independence check)."""
    kwargs = config.llm_kwargs()
    if config.mem_fraction is not None:
        kwargs["kv_cache_tokens"] = kv_tokens_for_fraction(config)
    llm = LLM(**kwargs)
    if config.verify_experts:
        llm.verify_experts()
    if llm.pool.capacity_tokens < llm.max_model_len:
        raise ValueError(f"kv_cache_tokens ({llm.pool.capacity_tokens}) cannot hold one request of the "
                         f"maximum context ({llm.max_model_len} tokens): raise --kv-cache-tokens to at "
                         f"least {llm.max_model_len} or lower --max-model-len")
    return llm


def kv_tokens_for_fraction(config: WorkerConfig) -> int:
    """KV tokens that fit in `mem_fraction` of the device's free memory (host RAM on CPU)."""
    import os

    import torch

    from engine.config import SHIPPED_MODEL, ModelConfig, parse_dtype
    mc = ModelConfig.from_path(config.model or SHIPPED_MODEL)
    per_token = mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * \
        torch.empty(0, dtype=parse_dtype(config.dtype)).element_size()
    if torch.device(config.device).type == "cuda":
        free = torch.cuda.mem_get_info(torch.device(config.device))[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    tokens = int(free * config.mem_fraction) // per_token
    return tokens // config.page_size * config.page_size


def grpc_server(config: WorkerConfig) -> tuple[grpc.Server, str]:
    # every Generate/Prefill holds a thread for its whole life: leave room for Health/Stats,
    # and refuse (RESOURCE_EXHAUSTED) rather than queue calls beyond the pool
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=RPC_THREADS, thread_name_prefix="worker-rpc"),
                         options=SERVICE_OPTIONS, maximum_concurrent_rpcs=RPC_THREADS - 16)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise OSError(f"cannot bind the worker's gRPC service to {config.host}:{config.port}")
    return server, f"{config.public_host}:{port}"


def start_decode_worker(config: WorkerConfig, llm: LLM | None = None, faults=None) -> WorkerHandle:
    """`faults` (chaos runs only): the receiver's stall / skipped-write injector."""
    llm = llm or build_llm(config)
    engine = DecodeEngine(llm, config.secret, config.transfer_timeout_s, threading.RLock(), faults=faults)
    if config.transfer == "shm":
        from kv_transfer.transport.shm_server import ShmTransferServer
        path = tempfile.mktemp(prefix="tandem-kv-", suffix=".sock")
        transfer = ShmTransferServer(engine.receiver, path)
    else:
        from kv_transfer.transport.grpc_server import GrpcTransferServer
        transfer = GrpcTransferServer(engine.receiver, config.host, config.transfer_port,
                                      advertise_host=config.public_host)
    server, address = grpc_server(config)
    add_to_server(DecodeServicer(engine, transfer.endpoint), server)
    loop = WorkerLoop([engine]).start()
    server.start()
    return WorkerHandle("decode", address, llm, server, loop, [engine], [transfer.stop])
