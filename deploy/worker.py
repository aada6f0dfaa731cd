"""Run one worker as a process (Ray actors call the same start function in-process).

    TANDEM_CLUSTER_SECRET=<hex> python -m deploy.worker --role decode --port 50051 [engine flags]
    TANDEM_CLUSTER_SECRET=<hex> python -m deploy.worker --role prefill \
        --decode-peer grpc://10.0.0.7:50061 [--tls-dir certs/prefill-0]

Prints `READY <role> <host:port> [<transfer endpoint>]` once serving.  SIGTERM or SIGINT drains
it: new requests are refused with DRAINING (Health says draining, so the gateway routes
elsewhere), live ones may finish for --drain-grace-s, the rest end with DRAINING
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
import signal
import sys
import threading
from collections.abc import Callable

from deploy.flags import ENGINE_FLAGS, DefaultsShown
from engine import env
from engine.options import add_flags, build, default_of, given
from kv_transfer.tls import TlsIdentity
from worker.config import WorkerConfig
from worker.drain import DrainResult
from worker.server import WorkerHandle
from worker.types import Role

# WorkerConfig's fields the process takes as flags, in --help's order (help, type and default:
# the field's, worker/config.py and engine/config.py)
FLAGS = ("host", "port", *ENGINE_FLAGS, "transfer", "transfer_port", "advertise_host", "decode_peers", "drain_grace_s")


def parser(prog: str = "python -m deploy.worker") -> argparse.ArgumentParser:
    """The worker's options: --role, FLAGS, and --tls-dir (its certificate, read from files)."""
    ap = argparse.ArgumentParser(prog=prog, formatter_class=DefaultsShown)
    ap.add_argument("--role", required=True, choices=[r.value for r in Role], help="what this worker does (required)")
    add_flags(ap, WorkerConfig, FLAGS)
    ap.add_argument("--tls-dir", default=None, help="ca.pem, cert.pem, key.pem (0600) of the cluster CA: serve and "
                    "call over mutual TLS (default: plaintext)")
    return ap


def config_from(args: argparse.Namespace) -> WorkerConfig:
    """The parsed flags as a WorkerConfig, the cluster secret from the environment.  A prefill
    worker compiles nothing (it runs no decode batch).  Raises ValueError for a prefill worker
    with no --decode-peer, or a bad setting."""
    values = given(args, FLAGS)
    if args.role == Role.PREFILL.value:
        if not values.get("decode_peers"):
            raise ValueError("a prefill worker needs the decode workers it may push to: --decode-peer ENDPOINT "
                             "(a decode worker prints it last on its READY line)")
        values["compile"] = False
    tls = TlsIdentity.load(args.tls_dir) if args.tls_dir else None
    return build(WorkerConfig, **values, secret=env.cluster_secret(), tls=tls)


def serve_until_signalled(handle: WorkerHandle,
                          drain_grace_s: float = default_of(WorkerConfig, "drain_grace_s")) -> int:
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
    return serve_until_signalled(start_worker(Role(args.role), config), config.drain_grace_s)


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
