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
        self.loop.stop()                # from here on, only this thread changes page ownership
        for engine in self.engines:
            engine.shutdown()
        self.server.stop(grace_s).wait()
        for close in self.closers:
            close()


def build_llm(config: WorkerConfig) -> LLM:
    """Load the engine.  Raises ValueError naming the setting to change when the KV pool cannot
    hold one request of the full context (ExpertCheckError from a failed independence check)."""
    llm = LLM(**config.llm_kwargs())
    if llm.pool.capacity_tokens < llm.max_model_len:
        raise ValueError(f"kv_cache_tokens ({llm.pool.capacity_tokens}) cannot hold one request of the "
                         f"maximum context ({llm.max_model_len} tokens): raise --kv-cache-tokens to at "
                         f"least {llm.max_model_len} or lower --max-model-len")
    return llm


def grpc_server(config: WorkerConfig) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="worker-rpc"),
                         options=SERVICE_OPTIONS)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise OSError(f"cannot bind the worker's gRPC service to {config.host}:{config.port}")
    return server, f"{config.host}:{port}"


def start_decode_worker(config: WorkerConfig, llm: LLM | None = None) -> WorkerHandle:
    llm = llm or build_llm(config)
    engine = DecodeEngine(llm, config.secret, config.transfer_timeout_s, threading.RLock())
    if config.transfer == "shm":
        from kv_transfer.transport.shm_server import ShmTransferServer
        path = tempfile.mktemp(prefix="tandem-kv-", suffix=".sock")
        transfer = ShmTransferServer(engine.receiver, path)
    else:
        from kv_transfer.transport.grpc_server import GrpcTransferServer
        transfer = GrpcTransferServer(engine.receiver, config.host, config.transfer_port)
    server, address = grpc_server(config)
    add_to_server(DecodeServicer(engine, transfer.endpoint), server)
    loop = WorkerLoop([engine]).start()
    server.start()
    return WorkerHandle("decode", address, llm, server, loop, [engine], [transfer.stop])
