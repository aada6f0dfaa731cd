"""`tandem serve`'s flags, one table: each row names the ServeSettings field it sets, its help
and how argparse reads it; the default shown in `--help` and the one parsed are the field's
default in deploy/settings.py (written once, there).

    add_serve_flags(parser)                     # every row, as argparse options
    ServeSettings(**settings_fields(args), ...) # what the rows read, by field name

A new setting is a ServeSettings field plus one row here.  `--help` of every `tandem` command
shows each option's default: `DefaultsShown` adds "(default: X)" to a help text that does not
give its default in words (a None default always does: "default: all").
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from deploy.settings import (
    PLACEMENT_STRATEGIES,
    REASONING_CHOICES,
    ROUTING_MODES,
    TLS_MODES,
    TOOL_CALL_CHOICES,
    ServeSettings,
)
from gateway.config import FRONT_DOOR_FLAGS
from worker.config import WorkerConfig

DTYPES = ("float32", "bfloat16", "float16")
LOG_LEVELS = ("debug", "info", "warning", "error")


def default_of(cls: type, name: str) -> Any:
    """The default of dataclass `cls`'s field `name` (its default_factory called)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    if f.default is dataclasses.MISSING:
        raise ValueError(f"{cls.__name__}.{name} has no default")
    return f.default


class DefaultsShown(argparse.HelpFormatter):
    """Help that says every option's default: "(default: X)" after a help text that does not
    mention one; a switch (store_true/store_false) shows "(default: off)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._StoreConstAction):      # store_true, store_false
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


@dataclass(frozen=True)
class Flag:
    """One option of `tandem serve`.  `setting`: the ServeSettings field it sets (None: read by
    cli.serve_settings itself).  `unset`: the option parses to None when not given (so a
    conflict with another flag can be told apart from the default) and the field keeps its
    default; its help still shows that default.  `options`: argparse's (type, choices, action)."""

    name: str
    setting: str | None
    help: str
    options: dict[str, Any] = field(default_factory=dict)
    unset: bool = False

    @property
    def dest(self) -> str:
        return str(self.options.get("dest", self.name.lstrip("-").replace("-", "_")))

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        options = dict(self.options)
        text = self.help
        if self.setting is not None:
            default = default_of(ServeSettings, self.setting)
            if self.unset:        # parsed as None when not given: say the setting's default here
                text = f"{text} (default: {default})"
            else:
                options["default"] = default
        parser.add_argument(self.name, help=text, **options)


def _row(name: str, setting: str | None, text: str, unset: bool = False, **options: Any) -> Flag:
    return Flag(name, setting, text, options, unset)


SERVE_FLAGS: tuple[Flag, ...] = (
    _row("--address", "address", "join this Ray cluster (auto, or HOST:PORT) instead of starting one; default: start "
       "one on 127.0.0.1, listening on loopback only. Joining needs RAY_AUTH_MODE=token here (Ray token "
       "authentication)"),
    _row("--allow-insecure-ray", None, "join a Ray cluster without RAY_AUTH_MODE=token here (anyone reaching it runs "
       "code on it)", action="store_true"),
    _row("--model", "model", "HF checkpoint directory (the shipped tiny-moe unless given)"),
    _row("--served-model-name", "served_model_name", "the model name clients use (default: the model "
         "directory's name)"),
    _row("--prefill-workers", "prefill_workers", "prefill workers to start", unset=True, type=int),
    _row("--decode-workers", "decode_workers", "decode workers to start", unset=True, type=int),
    _row("--colocated", "colocated", "workers that do both prefill and decode (no KV transfer)", action="store_true"),
    _row("--colocated-workers", "colocated_workers", "how many with --colocated", type=int),
    _row("--host", "host", "the address the gateway listens on (0.0.0.0: every interface)"),
    _row("--port", "port", "the gateway's port (0: a free one)", type=int),
    _row("--api-key", None, "KEY or KEY:TENANT (repeatable; default: none, every request is let in; `ps` shows it: "
       "prefer TANDEM_API_KEYS or --api-keys-file)", action="append", default=[]),
    _row("--api-keys-file", None, "JSON {key: tenant} or lines `KEY TENANT` (default: none)"),
    _row("--dtype", "dtype", "the weights' and KV cache's floating point type", choices=DTYPES),
    _row("--device", "device", "where the workers compute: cpu, cuda or cuda:N (cuda needs --gpus-per-worker)"),
    _row("--max-model-len", "max_model_len", "the longest prompt + output, in tokens (default: the model's "
       "max_position_embeddings)", type=int),
    _row("--kv-cache-tokens", "kv_cache_tokens", "KV pool per worker, in tokens (default: the workers' own, "
       f"{default_of(WorkerConfig, 'kv_cache_tokens')}, unless --mem-fraction)", type=int),
    _row("--prefill-kv-cache-tokens", "prefill_kv_cache_tokens", "the prefill workers' KV pool (their prefix cache), "
       "in tokens (default: as the others')", type=int),
    _row("--mem-fraction", "mem_fraction", "KV pool as a share of free memory, instead of --kv-cache-tokens "
       "(default: not used)", type=float),
    _row("--paged-experts-num-resident", "paged_experts_num_resident", "keep K experts of each MoE layer on the "
       "device, the rest in host memory (default: all resident)", type=int),
    _row("--verify-experts", "verify_experts", "check each resident expert slot against the host copy before use "
       "(costs a read)", action="store_true"),
    _row("--gpus-per-worker", "gpus_per_worker", "each worker's share of a GPU (Ray's num_gpus)", type=float),
    _row("--placement-strategy", "placement_strategy", "Ray's placement of the workers (STRICT_PACK: one node, as "
       "--transfer shm needs; STRICT_SPREAD: one worker per node)", choices=PLACEMENT_STRATEGIES),
    _row("--transfer", "transfer", "how prefill reaches decode (shm: same node only)", choices=("grpc", "shm")),
    _row("--worker-resources", None, 'extra Ray resources per role, JSON: {"decode": {"gpu_node": 1}} (default: none)'),
    _row("--gateway-replicas", "gateway_replicas", "gateways on --port, --port+1, ...", type=int),
    _row("--worker-cores", "worker_cores", "pin each worker to this many CPU cores of its own, round robin "
       "(default: not pinned)", type=int),
    _row("--default-max-tokens", "default_max_tokens", "a chat request's max_tokens when it sets none (clipped to the "
       "context left)", type=int),
    _row("--tenant-max-kv-tokens", "tenant_max_kv_tokens", "KV tokens one tenant may hold reserved at once (default: "
       "half the decode workers' KV; all of it when the API keys name one tenant)", type=int),
    _row("--stream-idle-timeout", "stream_idle_timeout_s", "seconds a client may read nothing of its streamed response "
       "before it is reset", type=float),
    _row("--tls", "tls", "mutual TLS between workers and gateway with a new cluster CA (auto: when they span more "
       "than one node)", choices=TLS_MODES),
    _row("--ssl-certfile", "ssl_certfile", "the gateway serves HTTPS with this certificate, PEM (default: plain HTTP)"),
    _row("--ssl-keyfile", "ssl_keyfile", "... and this private key, PEM (default: none)"),
    _row("--no-prefix-cache", "prefix_cache", "no prefix cache on any worker: every prompt is computed and its KV "
       "moved in full", action="store_false", dest="prefix_cache"),
    _row("--routing", "routing", "how the gateway picks a request's workers: prefix weighs the prompt's prefix each "
       "worker caches against its load; load takes the least loaded", choices=ROUTING_MODES),
    _row("--drain-grace-s", "drain_timeout_s", "on shutdown (SIGINT/SIGTERM), scale-down or a worker's SIGTERM: "
       "seconds in-flight requests may finish before they are ended (a decode worker's streams then continue on "
       "another)", type=float),
    _row("--max-migrations", "max_migrations", "how many times one response may move to another decode worker (its "
       "worker died or drained) before it ends with an error", type=int),
    _row("--reasoning-parser", "reasoning_parser", "how the gateway splits reasoning from the answer "
       "(reasoning_content); auto: from the chat template's markers, none: off", choices=REASONING_CHOICES),
    _row("--tool-call-parser", "tool_call_parser", "the model's tool-call syntax, read into tool_calls; auto: from the "
       "chat template's markers, none: tool_choice auto is refused", choices=TOOL_CALL_CHOICES),
    *(_row(flag, name, text, type=type(default_of(ServeSettings, name)))
      for name, (flag, text) in FRONT_DOOR_FLAGS.items()),
    _row("--prompt-special-tokens", "prompt_special_tokens", "read control token text in a /v1/completions prompt "
       "string as the control token (as before issue 41); chat messages are always text", action="store_true"),
    _row("--log-level", "log_level", "the driver's and workers' log level", choices=LOG_LEVELS),
)


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """Every row of SERVE_FLAGS as an option of `parser`."""
    for flag in SERVE_FLAGS:
        flag.add_to(parser)


COMPILE_SETTINGS = ("compile", "compile_buckets")   # settings.add_compile_flags' (shared with generate, worker)


def settings_fields(args: argparse.Namespace) -> dict[str, Any]:
    """ServeSettings fields from the parsed rows that set one and the compile flags; an `unset`
    row not given is left out (the field keeps its default)."""
    out = {name: getattr(args, name) for name in COMPILE_SETTINGS}
    for f in SERVE_FLAGS:
        if f.setting is not None and not (f.unset and getattr(args, f.dest) is None):
            out[f.setting] = getattr(args, f.dest)
    return out
