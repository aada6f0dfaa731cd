"""Run one worker as a process (Ray actors call the same start function in-process).

    TANDEM_CLUSTER_SECRET=<hex> python -m deploy.worker --role decode --port 50051 [engine flags]
    TANDEM_CLUSTER_SECRET=<hex> python -m deploy.worker --role prefill \
        --decode-peer grpc://10.0.0.7:50061 [--tls-dir certs/prefill-0]

Prints `READY <role> <host:port> [<transfer endpoint>]` once serving.  SIGTERM or SIGINT drains
it: new requests are refused with DRAINING (Health says draining, so the gateway routes
elsewhere), live ones may finish for --drain-grace-s (default 30), the rest end with DRAINING
(the gateway continues a decode worker's streams on another), then it stops and exits 0.  A
second signal ends what is left at once.  The cluster secret comes from the
environment (never from a flag, so it does not show in process listings or logs).

A prefill worker pushes KV only to the decode transfer endpoints given with --decode-peer (a
decode worker prints its own last on its READY line).  Across nodes, give every worker and the
gateway a certificate of one cluster CA (`tandem certs DIR NAME...` writes them) with --tls-dir:
its RPC and transfer servers then serve mutual TLS only, and its channels use it.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable

from deploy.flags import DTYPES, DefaultsShown, default_of
from deploy.settings import add_compile_flags
from kv_transfer.tls import TlsIdentity
from worker.config import WorkerConfig
from worker.drain import DrainResult
from worker.server import WorkerHandle
from worker.types import Role

DRAIN_GRACE_S = 30.0     # how long a signalled worker lets its live requests finish


def parser(prog: str = "python -m deploy.worker") -> argparse.ArgumentParser:
    """The worker's options, their defaults WorkerConfig's."""
    ap = argparse.ArgumentParser(prog=prog, formatter_class=DefaultsShown)
    ap.add_argument("--role", required=True, choices=[r.value for r in Role], help="what this worker does (required)")
    ap.add_argument("--host", default=_default("host"), help="the address its RPC and transfer servers listen on")
    ap.add_argument("--port", type=int, default=_default("port"), help="its RPC port (0: a free one)")
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: the shipped tiny-moe)")
    ap.add_argument("--dtype", default=_default("dtype"), choices=DTYPES,
                    help="the weights' and KV cache's floating point type")
    ap.add_argument("--device", default=_default("device"), help="cpu, cuda or cuda:N")
    ap.add_argument("--kv-cache-tokens", type=int, default=_default("kv_cache_tokens"), help="the KV pool, in tokens")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the longest prompt + output, in tokens (default: the model's max_position_embeddings)")
    ap.add_argument("--paged-experts-num-resident", type=int, default=None,
                    help="keep K experts of each MoE layer on the device (default: all)")
    add_compile_flags(ap)
    ap.add_argument("--transfer", default=_default("transfer"), choices=["grpc", "shm"],
                    help="how prefill reaches decode (shm: same node only)")
    ap.add_argument("--transfer-port", type=int, default=_default("transfer_port"),
                    help="the decode worker's KV transfer port (0: a free one)")
    ap.add_argument("--advertise-host", default=None, help="the address others reach this worker at (default: --host)")
    ap.add_argument("--decode-peer", action="append", default=[],
                    help="(prefill) a decode worker's transfer endpoint it may push to (repeatable; a prefill "
                    "worker needs one; default: none)")
    ap.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                    help="compute and transfer every prompt in full (no prefix cache)")
    ap.add_argument("--tls-dir", default=None, help="ca.pem, cert.pem, key.pem (0600) of the cluster CA: serve and "
                    "call over mutual TLS (default: plaintext)")
    ap.add_argument("--drain-grace-s", type=float, default=DRAIN_GRACE_S,
                    help="on SIGTERM/SIGINT: seconds the live requests may finish in before they are ended "
                    "with DRAINING (a second signal ends them at once)")
    return ap


def _default(name: str) -> object:
    return default_of(WorkerConfig, name)


def config_from(args: argparse.Namespace) -> WorkerConfig:
    secret = bytes.fromhex(os.environ.get("TANDEM_CLUSTER_SECRET", ""))
    if args.role == Role.PREFILL.value and not args.decode_peer:
        raise ValueError("a prefill worker needs the decode workers it may push to: --decode-peer ENDPOINT "
                         "(a decode worker prints it last on its READY line)")
    tls = TlsIdentity.load(args.tls_dir) if args.tls_dir else None
    return WorkerConfig(model=args.model, dtype=args.dtype, device=args.device,
                        kv_cache_tokens=args.kv_cache_tokens, max_model_len=args.max_model_len,
                        paged_experts_num_resident=args.paged_experts_num_resident,
                        # a prefill worker runs no decode batch: nothing to compile there
                        compile=args.compile and args.role != Role.PREFILL.value,
                        compile_buckets=args.compile_buckets, host=args.host,
                        port=args.port, transfer=args.transfer, transfer_port=args.transfer_port,
                        advertise_host=args.advertise_host, decode_peers=tuple(args.decode_peer),
                        prefix_cache=args.prefix_cache, secret=secret, tls=tls)


def serve_until_signalled(handle: WorkerHandle, drain_grace_s: float = DRAIN_GRACE_S) -> int:
    """Print READY, serve until SIGTERM/SIGINT, then drain: admit nothing new, let the live
    requests finish for up to `drain_grace_s`, end the rest with DRAINING (the gateway
    continues a decode worker's streams elsewhere), stop.  A second signal cuts the grace short."""
    endpoint = f" {handle.transfer_endpoint}" if handle.transfer_endpoint else ""
    print(f"READY {handle.role.value} {handle.address}{endpoint}", flush=True)
    signals = threading.Semaphore(0)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: signals.release())
    while not signals.acquire(timeout=0.5):   # a signal landing on another thread runs its handler here
        pass
    print(f"draining (grace {drain_grace_s:g} s)", file=sys.stderr, flush=True)
    result: list[DrainResult] = []
    drainer = threading.Thread(target=lambda: result.append(handle.drain(drain_grace_s)), name="drain", daemon=True)
    drainer.start()
    cut = False
    while drainer.is_alive() and not (cut := signals.acquire(timeout=0.1)):
        pass
    handle.stop()                 # what is still live (a second signal came) ends with an explicit error
    drainer.join(5.0)
    if cut:
        done = "a second signal cut the grace period short: the live requests were ended"
    elif not result:
        done = "the drain failed (above): the live requests were ended"
    else:
        done = f"drained: {result[0].finished} finished, {result[0].drained} drained"
    print(f"{done}; stopped", file=sys.stderr, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        config = config_from(args)
    except ValueError as e:
        print(f"deploy.worker: error: {e}", file=sys.stderr)
        return 2
    return serve_until_signalled(start_worker(Role(args.role), config), args.drain_grace_s)


def start_worker(role: Role, config: WorkerConfig, peers: Callable[[str], bool] | None = None) -> WorkerHandle:
    """Start a prefill, decode or colocated worker in this process (Ray actors call this too).
    `peers`: the decode endpoints a prefill worker may push to (default: config.decode_peers)."""
    if role == Role.PREFILL:
        from prefill_worker.server import start_prefill_worker
        return start_prefill_worker(config, peers)
    if role == Role.DECODE:
        from decode_worker.server import start_decode_worker
        return start_decode_worker(config)
    from deploy.colocated import start_colocated_worker
    return start_colocated_worker(config)


if __name__ == "__main__":
    sys.exit(main())
