"""Running the gateway under uvicorn: in a thread of this process (tests, a Ray actor) or as
`python -m gateway.server --decode HOST:PORT --prefill HOST:PORT [...]`."""

from __future__ import annotations

import argparse
import gc
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import uvicorn

from gateway.app import create_app
from gateway.config import (
    FRONT_DOOR_FLAGS,
    REASONING_CHOICES,
    ROUTING_MODES,
    TOOL_CALL_CHOICES,
    GatewayConfig,
    api_keys,
)
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


def _front_door_flags(ap: argparse.ArgumentParser) -> None:
    """The flags of FRONT_DOOR_FLAGS, typed and defaulted from GatewayConfig's fields."""
    defaults = {f.name: f.default for f in fields(GatewayConfig)}
    for name, (flag, text) in FRONT_DOOR_FLAGS.items():
        default = defaults[name]
        ap.add_argument(flag, dest=name, type=type(default), default=default, help=f"{text} (default {default})")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gateway.server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default=None)
    ap.add_argument("--served-model-name", default="tiny-moe")
    ap.add_argument("--decode", action="append", default=[])
    ap.add_argument("--prefill", action="append", default=[])
    ap.add_argument("--colocated", action="append", default=[])
    ap.add_argument("--api-key", action="append", default=[], help="KEY or KEY:TENANT")
    ap.add_argument("--api-keys-file", default=None)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--tls-dir", default=None, help="the gateway's cluster certificate (tandem certs): mutual TLS "
                    "to workers started with --tls-dir")
    ap.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM)")
    ap.add_argument("--ssl-keyfile", default=None, help="... and this key (PEM)")
    ap.add_argument("--admin-key", action="append", default=[], help="a Bearer key for /metrics and "
                    "/v1/server_info (repeatable; none: /metrics is open)")
    ap.add_argument("--stream-idle-timeout", type=float, default=30.0,
                    help="close a response the client has not read for this many seconds")
    ap.add_argument("--routing", default="prefix", choices=ROUTING_MODES,
                    help="prefix: weigh each worker's cached prefix of the prompt against its load; load: least loaded")
    ap.add_argument("--max-migrations", type=int, default=3,
                    help="how many times a stream whose decode worker fails after a token may continue on "
                    "another worker (0: never)")
    ap.add_argument("--reasoning-parser", default="auto", choices=REASONING_CHOICES,
                    help="how reasoning is split from the answer (reasoning_content); auto: from the chat template")
    ap.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_CHOICES,
                    help="the model's tool-call syntax, read into tool_calls; auto: from the chat template")
    _front_door_flags(ap)
    ap.add_argument("--prompt-special-tokens", action="store_true",
                    help="read control token text in a /v1/completions prompt string as the control token "
                    "(chat messages are always text; default: off, a prompt string is text)")
    args = ap.parse_args(argv)
    keys = api_keys(args.api_keys_file, args.api_key)
    # the workers' secret, hex (as deploy/worker.py reads it): every worker call is authenticated
    secret = bytes.fromhex(os.environ.get("TANDEM_CLUSTER_SECRET", ""))
    config = GatewayConfig(model=args.model, served_model_name=args.served_model_name, host=args.host,
                           port=args.port, decode_workers=tuple(args.decode), prefill_workers=tuple(args.prefill),
                           colocated_workers=tuple(args.colocated), api_keys=keys,
                           request_timeout_s=args.request_timeout, cluster_secret=secret,
                           tls=TlsIdentity.load(args.tls_dir) if args.tls_dir else None,
                           ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                           admin_keys=tuple(args.admin_key), stream_idle_timeout_s=args.stream_idle_timeout,
                           routing=args.routing, max_migrations=args.max_migrations,
                           reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                           prompt_special_tokens=args.prompt_special_tokens,
                           **{name: getattr(args, name) for name in FRONT_DOOR_FLAGS})
    app = create_app(config)
    freeze_heap()
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", **uvicorn_limits(config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
