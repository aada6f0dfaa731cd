"""A colocated worker, assembled from both roles: one process, one `EngineCore` (model, KV
pool, one scheduler), prefill and decode.  The prompt's pages move into the decode reservation
through the in-process transport, verified exactly as across nodes.  Its `Generate` is the
decode worker's: it prefills itself.

Both roles share the pool's prefix cache.  The decode reservation (pool owner `<id>`) holds its
cached prefix and the prefill role's request (owner `<id>#prefill`) its own references to the
same cached pages; each role releases only its own table, and the pool counts a reference per
table.  Prefill sends only the pages after the decode reservation's cached prefix.  Stats count
cache lookups once per request: the decode role's."""

from __future__ import annotations

import threading
import uuid

from decode_worker.engine import DecodeEngine
from decode_worker.service import DecodeServicer, add_to_server
from kv_transfer.auth import Verifier
from kv_transfer.transport.local import LocalServer
from prefill_worker.engine import PrefillEngine
from worker.config import WorkerConfig
from worker.loop import WorkerLoop
from worker.peers import KnownPeers
from worker.server import WorkerHandle, build_core, grpc_server
from worker.stats import LoopWatch
from worker.types import Role


def start_colocated_worker(config: WorkerConfig) -> WorkerHandle:
    core = build_core(config, interleave=True)     # a prefill step, then a decode step
    lock, wake = threading.RLock(), threading.Event()
    decode = DecodeEngine(core, config.secret, config.transfer_timeout_s, lock, wake,
                          config.max_request_timeout_s)
    transfer = LocalServer(decode.receiver, f"colocated-{uuid.uuid4().hex[:8]}")
    prefill = PrefillEngine(core, config.secret, lock, wake, KnownPeers([transfer.endpoint]), config.layer_group,
                            owner_suffix="#prefill")     # pushes to its own decode side only
    auth = Verifier(config.secret)
    server, address = grpc_server(config, auth)
    watch = LoopWatch(config.step_deadline_s)
    servicer = DecodeServicer(decode, transfer.endpoint, role=Role.COLOCATED, prefill=prefill, auth=auth,
                              watch=watch)
    add_to_server(servicer, server)
    loop = WorkerLoop(core, [prefill, decode], lock, wake, watch=watch).start()
    server.start()
    return WorkerHandle(Role.COLOCATED, address, core, lock, server, loop, [prefill, decode], [transfer.stop],
                        receiver=decode.receiver, auth=auth, transfer_endpoint=transfer.endpoint,
                        cache_events=servicer.cache_events)
