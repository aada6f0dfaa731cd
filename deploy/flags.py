"""The `tandem` commands' flags: lists of config field names, each flag's help, type and default
read from its field (engine/options.py `add_flags`), so a default is written once, in the
dataclass, and argparse holds no copy of it.

    ENGINE_FLAGS   EngineConfig's fields that tandem serve, tandem generate and
                   python -m deploy.worker all take
    SERVE_FLAGS    tandem serve's, by group: fields of ServeSettings' tree, and the few options
                   that are not one field (keys gathered from several sources, JSON, a check)

A new flag is its field's name added to a list here (the field's help says what it does).
`DefaultsShown` makes the other options of every `tandem` command say their default too.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from deploy.settings import ServeSettings
from engine.options import add_flags
from gateway.config import FRONT_DOOR

# EngineConfig fields every command that runs an engine takes
ENGINE_FLAGS = ("model", "dtype", "device", "max_model_len", "kv_cache_tokens", "paged_experts_num_resident",
                "keep_dense_quantized",
                "enable_prefix_cache", "compile", "compile_buckets")


class DefaultsShown(argparse.HelpFormatter):
    """Help that says every option's default: "(default: X)" after a help text that does not
    mention one; a switch (store_true/store_false) shows "(default: off)".  (An option made
    from a config field says its default already: engine/options.py.)"""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._StoreConstAction):      # store_true, store_false
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


@dataclass(frozen=True)
class Flag:
    """An option that sets no one field: read by cli.serve_settings itself."""
    name: str
    help: str
    options: dict[str, Any] = field(default_factory=dict)

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        parser.add_argument(self.name, help=self.help, **self.options)


# group -> its rows: a field of ServeSettings' tree by name, or a Flag
SERVE_FLAGS: dict[str, tuple[str | Flag, ...]] = {
    "deployment": (
        "address",
        Flag("--allow-insecure-ray", "join a Ray cluster without RAY_AUTH_MODE=token here (anyone reaching it "
             "runs code on it)", {"action": "store_true"}),
        "prefill_workers", "decode_workers", "colocated", "colocated_workers", "gpus_per_worker",
        "placement_strategy",
        "worker_resources",
        "gateway_replicas", "worker_cores", "tls", "log_level"),
    "engine (every worker's)": ENGINE_FLAGS,
    "workers": ("prefill_kv_cache_tokens", "mem_fraction", "verify_experts", "transfer", "drain_grace_s"),
    "gateway": (
        "served_model_name", "host", "port",
        Flag("--api-key", "KEY or KEY:TENANT (repeatable; default: none, every request is let in; `ps` shows it: "
             "prefer TANDEM_API_KEYS or --api-keys-file)", {"action": "append", "default": []}),
        Flag("--api-keys-file", "JSON {key: tenant} or lines `KEY TENANT` (default: none)"),
        "default_max_tokens", "tenant_max_kv_tokens", "stream_idle_timeout_s", "ssl_certfile", "ssl_keyfile",
        "routing", "max_migrations", "reasoning_parser", "tool_call_parser", *FRONT_DOOR, "prompt_special_tokens"),
}
# fields of ServeSettings' tree that tandem serve sets but no flag sets one to one: read from the
# environment (admin keys), built from several flags and the environment (api keys); and
# ServeSettings' own fields for library callers only
NOT_FLAGS = ("api_keys", "admin_keys", "worker_host", "max_restarts")


def serve_fields() -> tuple[str, ...]:
    """The field names SERVE_FLAGS sets, in order."""
    return tuple(row for rows in SERVE_FLAGS.values() for row in rows if isinstance(row, str))


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """Every row of SERVE_FLAGS as an option of `parser`, in argument groups."""
    for title, rows in SERVE_FLAGS.items():
        group = parser.add_argument_group(title)
        for row in rows:
            if isinstance(row, Flag):
                row.add_to(group)
            else:
                add_flags(group, ServeSettings, [row])
