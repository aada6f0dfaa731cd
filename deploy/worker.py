"""Run one worker as a process (Ray actors call the same start functions in-process).

    TANDEM_CLUSTER_SECRET=<hex> python -m deploy.worker --role decode --port 50051 [engine flags]

Prints `READY <role> <host:port>` once serving; SIGTERM or SIGINT ends every live request
with an explicit error, releases its pages and exits 0.  The cluster secret comes from the
environment (never from a flag, so it does not show in process listings or logs).
`--chaos-fault` (chaos runs only) arms a transfer fault point: POINT[:after=N][:seconds=S].
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


def parse_fault(spec: str) -> tuple[str, dict]:
    point, *opts = spec.split(":")
    kw = {}
    for opt in opts:
        key, _, value = opt.partition("=")
        if key not in ("after", "seconds", "times"):
            raise SystemExit(f"--chaos-fault {spec!r}: unknown option {key!r} (after, seconds, times)")
        kw[key] = float(value) if key == "seconds" else int(value)
    return point, kw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy.worker")
    ap.add_argument("--role", required=True, choices=["prefill", "decode", "colocated"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv-cache-tokens", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--paged-experts-num-resident", type=int, default=None)
    ap.add_argument("--transfer", default="grpc", choices=["grpc", "shm"])
    ap.add_argument("--chaos-fault", action="append", default=[])
    args = ap.parse_args(argv)
    secret = bytes.fromhex(os.environ.get("TANDEM_CLUSTER_SECRET", ""))
    from decode_worker.config import WorkerConfig
    config = WorkerConfig(model=args.model, dtype=args.dtype, device=args.device,
                          kv_cache_tokens=args.kv_cache_tokens, max_model_len=args.max_model_len,
                          paged_experts_num_resident=args.paged_experts_num_resident, host=args.host,
                          port=args.port, transfer=args.transfer, secret=secret)
    handle = start_worker(args.role, config, _injector(args.role, args.chaos_fault))
    print(f"READY {args.role} {handle.address}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    handle.stop()
    return 0


def _injector(role: str, specs: list[str]):
    """The sender's injector armed by --chaos-fault specs (None without any)."""
    if not specs:
        return None
    if role != "prefill":
        raise SystemExit("--chaos-fault arms the sending side: use it with --role prefill")
    from kv_transfer.faults import FaultInjector
    injector = FaultInjector()
    for spec in specs:
        point, kw = parse_fault(spec)
        injector.arm(point, **kw)
    return injector


def start_worker(role: str, config, faults=None):
    """Start a prefill, decode or colocated worker in this process (Ray actors call this too).
    `faults`: the sender's (prefill) or receiver's (decode) injector in chaos runs."""
    if role == "prefill":
        from prefill_worker.server import start_prefill_worker
        return start_prefill_worker(config, faults=faults)
    if role == "decode":
        from decode_worker.server import start_decode_worker
        return start_decode_worker(config, faults=faults)
    from decode_worker.colocated import start_colocated_worker
    return start_colocated_worker(config)


if __name__ == "__main__":
    sys.exit(main())
