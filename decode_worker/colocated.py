"""A colocated worker: one process, one engine (model and KV pool), doing both prefill and
decode; the prompt's pages move into the decode reservation through the in-process transport,
verified exactly as across nodes.  Its `Generate` is the decode worker's: it prefills itself."""

from __future__ import annotations

import threading
import uuid

from decode_worker.config import WorkerConfig
from decode_worker.engine import DecodeEngine
from decode_worker.loop import WorkerLoop
from decode_worker.server import WorkerHandle, build_llm, grpc_server
from decode_worker.service import DecodeServicer, add_to_server
from engine import LLM
from kv_transfer.transport.local import LocalServer
from prefill_worker.engine import PrefillEngine


def start_colocated_worker(config: WorkerConfig, llm: LLM | None = None) -> WorkerHandle:
    llm = llm or build_llm(config)
    lock = threading.RLock()
    decode = DecodeEngine(llm, config.secret, config.transfer_timeout_s, lock)
    prefill = PrefillEngine(llm, config.secret, lock, config.layer_group, owner_suffix="#prefill")
    transfer = LocalServer(decode.receiver, f"colocated-{uuid.uuid4().hex[:8]}")
    server, address = grpc_server(config)
    add_to_server(DecodeServicer(decode, transfer.endpoint, role="colocated", prefill=prefill), server)
    loop = WorkerLoop([prefill, decode]).start()
    server.start()
    return WorkerHandle("colocated", address, llm, server, loop, [prefill, decode], [transfer.stop])
