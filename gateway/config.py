"""The gateway's settings: one frozen config, validated."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gateway.compile_queue import DEFAULT_MAX_PENDING, DEFAULT_TENANT_MAX_PENDING
from gateway.reasoning import REASONING_PARSERS
from gateway.tools import TOOL_PARSERS
from kv_transfer.frame import check_secret
from kv_transfer.tls import TlsIdentity

ROUTING_MODES = ("prefix", "load")
PARSER_FLAGS = ("auto", "none")      # besides the parsers' names
REASONING_CHOICES = PARSER_FLAGS + REASONING_PARSERS
TOOL_CALL_CHOICES = PARSER_FLAGS + TOOL_PARSERS


# GatewayConfig field -> (flag, help): what a connection and a client address may hold
FRONT_DOOR_FLAGS = {
    "max_header_bytes": ("--max-header-bytes", "the longest request head (request line and headers) in bytes, "
                         "however it arrives; longer: 431"),
    "header_timeout_s": ("--header-timeout", "seconds a request head may take to arrive whole; slower: 408"),
    "body_timeout_s": ("--body-timeout", "seconds a request body may go without a byte; longer: 408"),
    "max_connections": ("--max-connections", "open connections (and requests in flight) in all; a new connection "
                        "past it closes the one idle longest, or gets 503 when every one has a request in flight"),
    "max_connections_per_client": ("--max-connections-per-client", "open connections from one client address (an "
                                   "IPv6 /64); more: 429"),
}


@dataclass(frozen=True)
class GatewayConfig:
    model: str | None = None                 # checkpoint dir (tokenizer, chat template, context)
    served_model_name: str = "tiny-moe"
    host: str = "127.0.0.1"
    port: int = 8000
    decode_workers: tuple[str, ...] = ()     # host:port of decode (or colocated) workers
    prefill_workers: tuple[str, ...] = ()
    colocated_workers: tuple[str, ...] = ()
    api_keys: dict[str, str] = field(default_factory=dict, repr=False)   # key -> tenant; empty: no auth
    max_queue: int = 256                     # requests admitted or waiting, in all
    max_running: int = 128                   # requests forwarded to workers at once
    tenant_max_concurrency: int = 64         # per tenant, running + waiting
    queue_timeout_s: float = 30.0
    request_timeout_s: float = 600.0         # the one timeout of a request once admitted
    max_n: int = 8
    max_body_bytes: int = 4 << 20
    refresh_s: float = 1.0                   # how often workers' Health/Stats are read
    max_attempts: int = 3                    # tries before the first token (capacity, unreachable)
    # a choice whose decode stream breaks after a token continues on another worker pair at most
    # this many times (gateway/migration.py); 0: never (the stream ends with MIGRATION_FAILED)
    max_migrations: int = 3
    # the workers refuse every call without credentials made with it (kv_transfer/auth.py)
    cluster_secret: bytes = field(default=b"", repr=False)
    # its cluster certificate: worker channels run mutual TLS (the workers' is on across nodes)
    tls: TlsIdentity | None = field(default=None, repr=False)
    ssl_certfile: str | None = None          # HTTPS on the front door (uvicorn's TLS), with ssl_keyfile
    ssl_keyfile: str | None = None
    # fair share (gateway/fairness.py): chat requests without max_tokens get this many (clipped to
    # the context left), not the whole context, since their pages are reserved up front
    default_max_tokens: int = 1024
    # KV tokens (prompt + max_tokens of each running choice) one tenant may hold at once; None: half
    # the decode workers' total capacity (all of it when the API keys name one tenant), at least one
    # request of the longest allowed length
    tenant_max_kv_tokens: int | None = None
    # what the front door reads and holds (gateway/limits.py, gateway/prompts.py)
    stream_idle_timeout_s: float = 30.0      # a client that reads nothing of its response this long is cut off
    max_header_bytes: int = 16 << 10         # request line + headers, however they arrive (else 431)
    # open connections, and requests in flight (gateway/connections.py): a new connection past it takes
    # the slot of the one idle longest (no request in flight); when none is idle it is answered 503
    max_connections: int = 512
    max_connections_per_client: int = 256    # open connections from one address (an IPv6 /64); more: 429
    header_timeout_s: float = 5.0            # a request head must arrive whole within this (else 408)
    body_timeout_s: float = 10.0             # a request body may go this long without a byte (else 408)
    prepare_threads: int = 4                 # tokenising, templates, regex checks: off the event loop
    # Bearer keys for /metrics and /v1/server_info; empty: /metrics is open, /v1/server_info
    # takes any API key (or none when no keys are configured)
    admin_keys: tuple[str, ...] = field(default=(), repr=False)
    max_messages: int = 1024                 # messages in one chat request (checked before the template)
    # how a request's workers are chosen (gateway/routing.py): "prefix" weighs what each worker's
    # prefix cache holds of the prompt against its load, "load" takes the least loaded
    routing: str = "prefix"
    # structured outputs: a constraint's compilation may take this long before the request is refused (400)
    grammar_compile_timeout_s: float = 5.0
    # structured-output compilations waiting or running (gateway/compile_queue.py): in all, and per
    # tenant (the tenants' share key, as admission); past either a request is refused with 429
    grammar_max_pending: int = DEFAULT_MAX_PENDING
    grammar_tenant_max_pending: int = DEFAULT_TENANT_MAX_PENDING
    # how the model's output is read (gateway/chat.py output_settings): a parser's name, "none", or
    # "auto" (from the chat template's markers)
    reasoning_parser: str = "auto"
    tool_call_parser: str = "auto"
    # a /v1/completions `prompt` string whose added tokens' text (<|im_end|>, ...) reads as their
    # control ids, as the tokenizer alone reads it; off: every prompt string is text (token-id
    # prompts are taken as they are either way; chat messages are always text)
    prompt_special_tokens: bool = False

    def __post_init__(self) -> None:
        if not (self.decode_workers or self.colocated_workers):
            raise ValueError("the gateway needs at least one decode or colocated worker")
        if self.decode_workers and not self.prefill_workers:
            raise ValueError("decode workers need at least one prefill worker (or use colocated workers)")
        for name in ("max_queue", "max_running", "tenant_max_concurrency", "max_n", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations={self.max_migrations} must be >= 0")
        for name in ("queue_timeout_s", "request_timeout_s", "refresh_s", "grammar_compile_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        check_secret(self.cluster_secret)
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
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if not all(self.admin_keys):
            raise ValueError("an empty admin key would let anyone in: refused")
        if self.routing not in ROUTING_MODES:
            raise ValueError(f"routing={self.routing!r}: choose one of {', '.join(ROUTING_MODES)}")
        for name, known in (("reasoning_parser", REASONING_CHOICES), ("tool_call_parser", TOOL_CALL_CHOICES)):
            if getattr(self, name) not in known:
                raise ValueError(f"{name}={getattr(self, name)!r}: choose one of {', '.join(known)}")


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
