"""Starting a prefill worker: its engine core, the prefill role and its gRPC service."""

from __future__ import annotations

import threading
from collections.abc import Callable

from kv_transfer.auth import Verifier
from prefill_worker.engine import PrefillEngine
from prefill_worker.service import PrefillServicer, add_to_server
from worker.config import WorkerConfig
from worker.loop import WorkerLoop
from worker.peers import KnownPeers
from worker.server import WorkerHandle, build_core, grpc_server
from worker.stats import LoopWatch
from worker.types import Role


def start_prefill_worker(config: WorkerConfig, peers: Callable[[str], bool] | None = None) -> WorkerHandle:
    """`peers`: which decode endpoints it may push to (default: `config.decode_peers`)."""
    core = build_core(config)
    lock, wake = threading.RLock(), threading.Event()
    engine = PrefillEngine(core, config.secret, lock, wake, peers or KnownPeers(config.decode_peers),
                           config.layer_group, config.transport)
    auth = Verifier(config.secret)
    server, address = grpc_server(config, auth)
    watch = LoopWatch(config.step_deadline_s)
    servicer = PrefillServicer(engine, auth, watch)
    add_to_server(servicer, server)
    loop = WorkerLoop(core, [engine], lock, wake, watch=watch).start()
    server.start()
    return WorkerHandle(Role.PREFILL, address, core, lock, server, loop, [engine], auth=auth,
                        cache_events=servicer.cache_events)
