"""Run one worker as a process (Ray actors call the same start function in-process).

    TANDEM_CLUSTER_SECRET=<hex> python -m deploy.worker --role decode --port 50051 [engine flags]

Prints `READY <role> <host:port>` once serving; SIGTERM or SIGINT ends every live request
with an explicit error, releases its pages and exits 0.  The cluster secret comes from the
environment (never from a flag, so it does not show in process listings or logs).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from worker.config import WorkerConfig
from worker.server import WorkerHandle
from worker.types import Role


def parser(prog: str = "python -m deploy.worker") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--role", required=True, choices=[r.value for r in Role])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv-cache-tokens", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--paged-experts-num-resident", type=int, default=None)
    ap.add_argument("--transfer", default="grpc", choices=["grpc", "shm"])
    return ap


def config_from(args: argparse.Namespace) -> WorkerConfig:
    secret = bytes.fromhex(os.environ.get("TANDEM_CLUSTER_SECRET", ""))
    return WorkerConfig(model=args.model, dtype=args.dtype, device=args.device,
                        kv_cache_tokens=args.kv_cache_tokens, max_model_len=args.max_model_len,
                        paged_experts_num_resident=args.paged_experts_num_resident, host=args.host,
                        port=args.port, transfer=args.transfer, secret=secret)


def serve_until_signalled(handle: WorkerHandle) -> int:
    """Print READY, serve until SIGTERM/SIGINT, then stop the worker."""
    print(f"READY {handle.role.value} {handle.address}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    handle.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return serve_until_signalled(start_worker(Role(args.role), config_from(args)))


def start_worker(role: Role, config: WorkerConfig) -> WorkerHandle:
    """Start a prefill, decode or colocated worker in this process (Ray actors call this too)."""
    if role == Role.PREFILL:
        from prefill_worker.server import start_prefill_worker
        return start_prefill_worker(config)
    if role == Role.DECODE:
        from decode_worker.server import start_decode_worker
        return start_decode_worker(config)
    from deploy.colocated import start_colocated_worker
    return start_colocated_worker(config)


if __name__ == "__main__":
    sys.exit(main())
