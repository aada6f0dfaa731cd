"""Starting a prefill worker's service."""

from __future__ import annotations

import threading

from decode_worker.config import WorkerConfig
from decode_worker.loop import WorkerLoop
from decode_worker.server import WorkerHandle, build_llm, grpc_server
from engine import LLM
from prefill_worker.engine import PrefillEngine
from prefill_worker.service import PrefillServicer, add_to_server


def start_prefill_worker(config: WorkerConfig, llm: LLM | None = None, faults=None) -> WorkerHandle:
    llm = llm or build_llm(config)
    engine = PrefillEngine(llm, config.secret, threading.RLock(), config.layer_group, faults=faults)
    server, address = grpc_server(config)
    add_to_server(PrefillServicer(engine), server)
    loop = WorkerLoop([engine]).start()
    server.start()
    return WorkerHandle("prefill", address, llm, server, loop, [engine])
