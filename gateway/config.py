"""The gateway's settings: one frozen config, validated."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


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

    def __post_init__(self) -> None:
        if not (self.decode_workers or self.colocated_workers):
            raise ValueError("the gateway needs at least one decode or colocated worker")
        if self.decode_workers and not self.prefill_workers:
            raise ValueError("decode workers need at least one prefill worker (or use colocated workers)")
        for name in ("max_queue", "max_running", "tenant_max_concurrency", "max_n", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("queue_timeout_s", "request_timeout_s", "refresh_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")


def load_api_keys(path: str | Path) -> dict[str, str]:
    """A keys file: JSON {"key": "tenant", ...}, or lines `KEY TENANT` (# comments)."""
    text = Path(path).read_text()
    if text.lstrip().startswith("{"):
        keys = json.loads(text)
    else:
        keys = {}
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{n}: expected `KEY TENANT`, got {line!r}")
            keys[parts[0]] = parts[1]
    if not all(isinstance(k, str) and isinstance(v, str) and k and v for k, v in keys.items()):
        raise ValueError(f"{path}: keys and tenants must be non-empty strings")
    return keys


def api_keys(path: str | Path | None, flags: list[str]) -> dict[str, str]:
    """Key -> tenant from a keys file (if any) and `--api-key KEY[:TENANT]` flags (tenant
    "default" when none is given); a flag overrides the file for the same key."""
    keys = load_api_keys(path) if path else {}
    for k in flags:
        key, _, tenant = k.partition(":")
        keys[key] = tenant or "default"
    return keys
