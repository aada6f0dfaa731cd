"""Running the gateway under uvicorn: in a thread of this process (tests, a Ray actor) or as
`python -m gateway.server --decode HOST:PORT --prefill HOST:PORT [...]`."""

from __future__ import annotations

import argparse
import gc
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from engine import env
from engine.options import add_flags, build, given
from gateway.app import create_app
from gateway.config import FRONT_DOOR, GatewayConfig, api_keys
from gateway.connection_table import ConnectionLimits
from gateway.connections import protocol_for
from kv_transfer.tls import TlsIdentity


class GatewayServer:
    """uvicorn serving the gateway on a thread; `url` once started."""

    def __init__(self, config: GatewayConfig, discover: Callable[[], dict[str, list[str]]] | None = None) -> None:
        self.config = config
        port = config.port or _free_port(config.host)
        self.app = create_app(config, discover)
        self._server = uvicorn.Server(uvicorn.Config(self.app, host=config.host, port=port,
                                                     log_level="warning", lifespan="on", **uvicorn_limits(config)))
        self.url = f"{'https' if config.ssl_certfile else 'http'}://{config.host}:{port}"
        self._thread = threading.Thread(target=self._server.run, name="gateway", daemon=True)

    def start(self, timeout_s: float = 30.0) -> "GatewayServer":
        self._thread.start()
        end = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > end or not self._thread.is_alive():
                raise RuntimeError(f"the gateway did not start on {self.url}")
            time.sleep(0.02)
        freeze_heap()
        return self

    def drain(self, timeout_s: float) -> int:
        """Refuse new requests (503 draining) and wait up to `timeout_s` for the admitted ones.
        Returns how many are still in flight."""
        gw = self.app.state.gateway
        gw.draining = True
        end = time.monotonic() + timeout_s
        while gw.queue.total and time.monotonic() < end:
            time.sleep(0.05)
        return gw.queue.total

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)
        gc.unfreeze()       # what start() froze is collectable again (a process that goes on: tests)


def freeze_heap() -> None:
    """Collect, then move every object alive now out of the garbage collector's generations
    (gc.freeze): the tokenizer, templates and app built at start-up are never scanned again.
    A flood of connections allocates fast enough to run full collections often, and each one
    scanned that whole heap with the event loop stopped: 10-30 ms stalls in front of every
    client (bench/front_door.py measured victims' p99 at 4-16x idle without this, 1.3-2.5x
    with it)."""
    gc.collect()
    gc.freeze()


def uvicorn_limits(config: GatewayConfig) -> dict[str, Any]:
    """uvicorn's settings from the gateway's: TLS, and the protocol that bounds what a
    connection and a client address may hold (gateway/connections.py: header and body timeouts,
    the header limit on the whole head, framing checks, connection caps; every refusal an OpenAI
    error body).  uvicorn's own limit_concurrency stays off: it counted half-open connections
    and answered plain text.  Each call binds a fresh connection table (one per server)."""
    return {"ssl_certfile": config.ssl_certfile, "ssl_keyfile": config.ssl_keyfile,
            "http": protocol_for(connection_limits(config)), "ws": "none", "limit_concurrency": None}


def connection_limits(config: GatewayConfig) -> ConnectionLimits:
    return ConnectionLimits(max_connections=config.max_connections,
                            max_connections_per_client=config.max_connections_per_client,
                            max_header_bytes=config.max_header_bytes, header_timeout_s=config.header_timeout_s,
                            body_timeout_s=config.body_timeout_s)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# GatewayConfig's fields `python -m gateway.server` takes as flags, in --help's order: each
# field's help, type and default are the field's (gateway/config.py)
FLAGS = ("host", "port", "model", "served_model_name", "decode_workers", "prefill_workers", "colocated_workers",
         "request_timeout_s", "ssl_certfile", "ssl_keyfile", "admin_keys", "stream_idle_timeout_s", "routing",
         "max_migrations", "reasoning_parser", "tool_call_parser", *FRONT_DOOR, "prompt_special_tokens")


def parser() -> argparse.ArgumentParser:
    """The gateway process's options: FLAGS, and the API keys and certificate it reads itself."""
    ap = argparse.ArgumentParser(prog="python -m gateway.server")
    add_flags(ap, GatewayConfig, FLAGS)
    ap.add_argument("--api-key", action="append", default=[], help="KEY or KEY:TENANT (repeatable; default: none)")
    ap.add_argument("--api-keys-file", default=None, help="JSON {key: tenant} or lines `KEY TENANT` (default: none)")
    ap.add_argument("--tls-dir", default=None, help="the gateway's cluster certificate (tandem certs): mutual TLS "
                    "to workers started with --tls-dir (default: plaintext)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # the workers' secret, hex, from the environment (as deploy/worker.py reads it): every worker
    # call is authenticated
    config = build(GatewayConfig, **given(args, FLAGS), api_keys=api_keys(args.api_keys_file, args.api_key),
                   cluster_secret=env.cluster_secret(), tls=TlsIdentity.load(args.tls_dir) if args.tls_dir else None)
    app = create_app(config)
    freeze_heap()
    uvicorn.run(app, host=config.host, port=config.port, log_level="info", **uvicorn_limits(config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
