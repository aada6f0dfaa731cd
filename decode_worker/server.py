"""Starting a decode worker: its engine core, the decode role, its transfer server (gRPC or
shared memory) and its gRPC service."""

from __future__ import annotations

import threading
from typing import Protocol

from decode_worker.engine import DecodeEngine
from decode_worker.service import DecodeServicer, add_to_server
from kv_transfer.auth import Verifier
from worker.config import WorkerConfig
from worker.loop import WorkerLoop
from worker.server import WorkerHandle, build_core, grpc_server
from worker.stats import LoopWatch
from worker.types import Role


class TransferServer(Protocol):
    """What this worker needs of a transport's server: where senders reach it, how to stop it."""

    @property
    def endpoint(self) -> str: ...

    def stop(self) -> None: ...


def start_decode_worker(config: WorkerConfig) -> WorkerHandle:
    core = build_core(config)
    lock, wake = threading.RLock(), threading.Event()
    engine = DecodeEngine(core, config.secret, config.transfer_timeout_s, lock, wake, config.max_request_timeout_s)
    auth = Verifier(config.secret)      # one per worker: its RPC and its transfer server
    transfer = transfer_server(config, engine, auth)
    server, address = grpc_server(config, auth)
    watch = LoopWatch(config.step_deadline_s)
    servicer = DecodeServicer(engine, transfer.endpoint, auth=auth, watch=watch)
    add_to_server(servicer, server)
    loop = WorkerLoop(core, [engine], lock, wake, watch=watch).start()
    server.start()
    return WorkerHandle(Role.DECODE, address, core, lock, server, loop, [engine], [transfer.stop],
                        receiver=engine.receiver, auth=auth, transfer_endpoint=transfer.endpoint,
                        cache_events=servicer.cache_events)


def transfer_server(config: WorkerConfig, engine: DecodeEngine, auth: Verifier) -> TransferServer:
    """The server prefill workers push this worker's KV pages to (config.transfer).  The
    gRPC one checks every call's credentials with `auth` (over mutual TLS with `config.tls`);
    the shared-memory one is reached
    over a Unix socket in a private (0700) directory on the same node and accepts only peers
    running as this worker's uid; `stop()` removes the directory.  The NIXL one is reached the
    same way, frames written one-sided into a staging ring of its own and copied into the
    pages once verified (kv_transfer/transport/nixl_server.py)."""
    if config.transfer == "nixl":
        from kv_transfer.transport.nixl_server import NixlTransferServer
        return NixlTransferServer(engine.receiver, on_refused=auth.count_refusal)
    if config.transfer == "shm":
        from kv_transfer.transport.shm_server import ShmTransferServer
        return ShmTransferServer(engine.receiver, on_refused=auth.count_refusal)
    from kv_transfer.transport.grpc_server import GrpcTransferServer
    return GrpcTransferServer(engine.receiver, config.host, config.transfer_port, config=config.transport,
                              advertise_host=config.public_host, auth=auth)
