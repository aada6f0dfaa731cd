"""The gateway's settings: one frozen config, validated.

    GatewaySettings   what an operator chooses (`tandem serve` holds one for every replica)
    GatewayConfig     one running gateway: its settings, and the model, workers, cluster secret
                      and certificate its launcher wires in
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from engine.config import SHIPPED_MODEL
from engine.constraint import GRAMMAR_COMPILE_TIMEOUT_S
from engine.options import option
from engine.params import REQUEST_TIMEOUT_S
from gateway.compile_queue import DEFAULT_MAX_PENDING, DEFAULT_TENANT_MAX_PENDING
from gateway.reasoning import REASONING_PARSERS
from gateway.tools import TOOL_PARSERS
from kv_transfer.frame import check_secret
from kv_transfer.tls import TlsIdentity

ROUTING_MODES = ("prefix", "load")
PARSER_FLAGS = ("auto", "none")      # besides the parsers' names
REASONING_CHOICES = PARSER_FLAGS + REASONING_PARSERS
TOOL_CALL_CHOICES = PARSER_FLAGS + TOOL_PARSERS


# what a connection and a client address may hold at the front door (gateway/connections.py):
# GatewaySettings' fields, which `tandem serve` and `python -m gateway.server` both take as flags
FRONT_DOOR = ("max_header_bytes", "header_timeout_s", "body_timeout_s", "max_connections", "max_connections_per_client")


@dataclass(frozen=True)
class GatewaySettings:
    """What an operator chooses for a gateway (`tandem serve` holds one for every replica).
    Each field's help is what the command lines show for its flag."""
    served_model_name: str = option("", says_default=True,
                                    help="the model name clients use (default: the model directory's name)")
    host: str = option("127.0.0.1", help="the address the gateway listens on (0.0.0.0: every interface)")
    port: int = option(8000, help="the gateway's port (0: a free one)")
    api_keys: dict[str, str] = option(factory=dict, repr=False, says_default=True,
                                      help="API key -> tenant (default: none, every request is let in)")
    # empty: /metrics is open, /v1/server_info takes any API key (or none when no keys are configured)
    admin_keys: tuple[str, ...] = option((), repr=False, flag="--admin-key", action="append", says_default=True,
                                         help="a Bearer key for /metrics and /v1/server_info (repeatable; "
                                         "default: none, /metrics is open)")
    max_queue: int = option(256, help="requests admitted or waiting, in all")
    max_running: int = option(128, help="requests forwarded to workers at once")
    tenant_max_concurrency: int = option(64, help="requests of one tenant, running and waiting")
    queue_timeout_s: float = option(30.0, help="seconds a request may wait for admission")
    request_timeout_s: float = option(REQUEST_TIMEOUT_S, flag="--request-timeout", help="seconds a request may "
                                      "take once admitted (its one timeout)")
    max_n: int = option(8, help="choices one request may ask for (n)")
    max_body_bytes: int = option(4 << 20, help="the largest request body, in bytes")
    refresh_s: float = option(1.0, help="how often the workers' Health and Stats are read, seconds")
    max_attempts: int = option(3, help="tries before the first token (no capacity, a worker unreachable)")
    max_migrations: int = option(3, help="how many times one response may move to another decode worker (its worker "
                                 "died or drained after a token) before it ends with an error (0: never, "
                                 "MIGRATION_FAILED)")
    ssl_certfile: str | None = option(None, says_default=True,
                                      help="serve HTTPS with this certificate, PEM (default: plain HTTP)")
    ssl_keyfile: str | None = option(None, says_default=True, help="... and this private key, PEM (default: none)")
    # fair share (gateway/fairness.py): since pages are reserved up front, not the whole context
    default_max_tokens: int = option(1024, help="a chat request's max_tokens when it sets none (clipped to the "
                                     "context left)")
    tenant_max_kv_tokens: int | None = option(
        None, type=int, says_default=True,
        help="KV tokens (prompt + max_tokens of each running choice) one tenant may hold reserved at "
        "once (default: half the decode workers' KV; all of it when the API keys name one tenant; at least one "
        "request of the longest allowed length)")
    # what the front door reads and holds (gateway/limits.py, gateway/prompts.py)
    stream_idle_timeout_s: float = option(30.0, flag="--stream-idle-timeout", help="seconds a client may read "
                                          "nothing of its streamed response before it is reset")
    max_header_bytes: int = option(16 << 10, help="the longest request head (request line and headers) in bytes, "
                                   "however it arrives; longer: 431")
    max_connections: int = option(512, help="open connections (and requests in flight) in all; a new connection "
                                  "past it closes the one idle longest, or gets 503 when every one has a request "
                                  "in flight")
    max_connections_per_client: int = option(256, help="open connections from one client address (an IPv6 /64); "
                                             "more: 429")
    header_timeout_s: float = option(5.0, flag="--header-timeout", help="seconds a request head may take to arrive "
                                     "whole; slower: 408")
    body_timeout_s: float = option(10.0, flag="--body-timeout", help="seconds a request body may go without a "
                                   "byte; longer: 408")
    prepare_threads: int = option(4, help="threads for tokenising, templates and regex checks, off the event loop")
    max_messages: int = option(1024, help="messages in one chat request (checked before the template)")
    routing: str = option("prefix", choices=ROUTING_MODES, help="how the gateway picks a request's workers "
                          "(gateway/routing.py): prefix weighs the prompt's prefix each worker caches against its "
                          "load; load takes the least loaded")
    grammar_compile_timeout_s: float = option(GRAMMAR_COMPILE_TIMEOUT_S, help="seconds a structured-output "
                                              "constraint may take to compile before the request is refused (400)")
    # structured-output compilations waiting or running (gateway/compile_queue.py): in all, and per
    # tenant (the tenants' share key, as admission); past either a request is refused with 429
    grammar_max_pending: int = option(DEFAULT_MAX_PENDING, help="structured-output compilations waiting or "
                                      "running, in all")
    grammar_tenant_max_pending: int = option(DEFAULT_TENANT_MAX_PENDING, help="... and of one tenant")
    reasoning_parser: str = option("auto", choices=REASONING_CHOICES, help="how the gateway splits reasoning from "
                                   "the answer (reasoning_content); auto: from the chat template's markers, none: "
                                   "off")
    tool_call_parser: str = option("auto", choices=TOOL_CALL_CHOICES, help="the model's tool-call syntax, read into "
                                   "tool_calls; auto: from the chat template's markers, none: tool_choice auto is "
                                   "refused")
    prompt_special_tokens: bool = option(
        False, action="store_true", help="read control token text (<|im_end|>, ...) in a /v1/completions prompt "
        "string as the control token, as the tokenizer alone reads it (as before issue 41); token-id prompts are "
        "taken as they are, chat messages are always text")

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port} is not a TCP port")
        for name in ("max_queue", "max_running", "tenant_max_concurrency", "max_n", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations={self.max_migrations} must be >= 0")
        for name in ("queue_timeout_s", "request_timeout_s", "refresh_s", "grammar_compile_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("HTTPS needs both --ssl-certfile and --ssl-keyfile")
        for name in ("ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}={path}: no such file")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens={self.default_max_tokens} must be >= 1")
        if self.tenant_max_kv_tokens is not None and self.tenant_max_kv_tokens < 1:
            raise ValueError(f"tenant_max_kv_tokens={self.tenant_max_kv_tokens} must be >= 1 (or None: half the "
                             f"cluster's KV capacity)")
        if not all(k and t for k, t in self.api_keys.items()):
            raise ValueError("an empty API key or tenant would turn authentication off: refused")
        for name in ("max_header_bytes", "max_connections", "max_connections_per_client", "prepare_threads",
                     "max_messages", "grammar_max_pending", "grammar_tenant_max_pending"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.grammar_tenant_max_pending > self.grammar_max_pending:
            raise ValueError(f"grammar_tenant_max_pending={self.grammar_tenant_max_pending} must be <= "
                             f"grammar_max_pending={self.grammar_max_pending}")
        for name in ("stream_idle_timeout_s", "header_timeout_s", "body_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name}={getattr(self, name)} must be > 0 and finite")
        if not all(self.admin_keys):
            raise ValueError("an empty admin key would let anyone in: refused")
        if self.routing not in ROUTING_MODES:
            raise ValueError(f"routing={self.routing!r}: choose one of {', '.join(ROUTING_MODES)}")
        for name, known in (("reasoning_parser", REASONING_CHOICES), ("tool_call_parser", TOOL_CALL_CHOICES)):
            if getattr(self, name) not in known:
                raise ValueError(f"{name}={getattr(self, name)!r}: choose one of {', '.join(known)}")

    def model_name(self, model: str | None) -> str:
        """The name clients use for `model` (a checkpoint directory; None: the shipped model):
        served_model_name, or when it is empty the directory's name.  A gateway and `tandem
        serve` both name their model with it."""
        return self.served_model_name or Path(model or SHIPPED_MODEL).name


@dataclass(frozen=True)
class GatewayConfig(GatewaySettings):
    """One gateway: its settings, and what its launcher wires in (the model, the workers, the
    cluster secret, its certificate).  `served_model_name` left empty becomes the model
    directory's name."""
    model: str | None = option(None, says_default=True, help="checkpoint directory: tokenizer, chat template, "
                               "context (default: the shipped tiny-moe)")
    decode_workers: tuple[str, ...] = option((), flag="--decode", action="append", metavar="HOST:PORT",
                                             help="a decode worker's HOST:PORT (repeatable)")
    prefill_workers: tuple[str, ...] = option((), flag="--prefill", action="append", metavar="HOST:PORT",
                                              help="a prefill worker's HOST:PORT (repeatable)")
    colocated_workers: tuple[str, ...] = option((), flag="--colocated", action="append", metavar="HOST:PORT",
                                                help="a colocated worker's HOST:PORT (repeatable)")
    # the workers refuse every call without credentials made with it (kv_transfer/auth.py)
    cluster_secret: bytes = option(b"", repr=False, help="the cluster secret (never printed)")
    # worker channels run mutual TLS with it (the workers' is on across nodes)
    tls: TlsIdentity | None = option(None, repr=False, says_default=True,
                                     help="its cluster certificate (default: none, plaintext)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.decode_workers or self.colocated_workers):
            raise ValueError("the gateway needs at least one decode or colocated worker")
        if self.decode_workers and not self.prefill_workers:
            raise ValueError("decode workers need at least one prefill worker (or use colocated workers)")
        check_secret(self.cluster_secret)
        object.__setattr__(self, "served_model_name", self.model_name(self.model))


def load_api_keys(path: str | Path) -> dict[str, str]:
    """A keys file: JSON {"key": "tenant", ...}, or lines `KEY TENANT` (# comments).  Raises
    ValueError naming the file and line of a bad entry, never its text (it holds a key)."""
    text = Path(path).read_text()
    if text.lstrip().startswith("{"):
        keys = json.loads(text)
        if not isinstance(keys, dict):
            raise ValueError(f"{path}: expected a JSON object of key -> tenant")
    else:
        keys = {}
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}: line {n}: expected `KEY TENANT` (2 fields), found {len(parts)}")
            keys[parts[0]] = parts[1]
    if not all(isinstance(k, str) and isinstance(v, str) and k and v for k, v in keys.items()):
        raise ValueError(f"{path}: keys and tenants must be non-empty strings")
    return keys


def parse_key_spec(spec: str, source: str) -> tuple[str, str]:
    """`KEY` or `KEY:TENANT` -> (key, tenant) (tenant "default" when none is given).  An empty
    key (`""`, `:admin`) is refused: it would match a request that sends no key."""
    key, _, tenant = spec.strip().partition(":")
    if not key:
        raise ValueError(f"{source}: an empty API key is refused (give KEY or KEY:TENANT)")
    return key, tenant or "default"


def api_keys(path: str | Path | None, flags: list[str], env: str | None = None) -> dict[str, str]:
    """Key -> tenant from a keys file (if any), then `env` (the value of TANDEM_API_KEYS:
    comma-separated KEY[:TENANT]), then `--api-key KEY[:TENANT]` flags; a later source overrides
    an earlier one for the same key.  Raises ValueError on an empty key."""
    keys = load_api_keys(path) if path else {}
    if env is not None:
        for i, spec in enumerate(env.split(","), 1):
            if spec.strip():
                key, tenant = parse_key_spec(spec, f"TANDEM_API_KEYS entry {i}")
                keys[key] = tenant
    for i, spec in enumerate(flags, 1):
        key, tenant = parse_key_spec(spec, f"--api-key #{i}")
        keys[key] = tenant
    return keys


class KeyTable:
    """Looks up a presented API key in constant time: every configured key is compared (as a
    SHA-256 digest, so lengths do not show either) with `hmac.compare_digest`, none skipped."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        self._entries = [(_digest(k), t) for k, t in keys.items()]

    def __bool__(self) -> bool:
        return bool(self._entries)

    def tenant(self, key: str) -> str | None:
        """The key's tenant, or None for an unknown (or empty) key."""
        presented, found = _digest(key), None
        for digest, tenant in self._entries:
            if hmac.compare_digest(digest, presented):
                found = tenant
        return found if key else None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
