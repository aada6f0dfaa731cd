"""`tandem ... --help` says what every option does and what it is when not given, and for
`tandem serve` that default is the setting's own (deploy/settings.py ServeSettings), both as
shown and as parsed: a default is written once."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from deploy import worker
from deploy.cli import build_parser, serve_settings
from deploy.flags import COMPILE_SETTINGS, SERVE_FLAGS, default_of
from deploy.settings import ServeSettings

# ServeSettings fields no flag sets one to one: read from the environment (admin keys), built
# from several flags (api keys), parsed from JSON (worker resources), or for library callers only
NOT_FLAGS = {"api_keys", "admin_keys", "worker_resources", "worker_host", "max_restarts"}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """Every built-in subcommand's parser (a plugged-in command parses its own arguments), and
    the plain worker process's."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parsers = {name: p for name, p in sub.choices.items() if p.add_help}
    return {**parsers, "deploy.worker": worker.parser()}


def shown_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text `--help` prints for `action` (defaults expanded), on one line."""
    if not action.help:
        return ""
    return " ".join(parser._get_formatter()._expand_help(action).split())


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_every_option_of_every_command_has_help_that_shows_its_default(name):
    parser = subcommands()[name]
    assert options(parser)
    for action in options(parser):
        text = shown_help(parser, action)
        assert text, f"tandem {name} {action.option_strings or action.dest}: no help"
        if action.option_strings and not action.required:
            assert "default" in text.lower(), f"tandem {name} {action.option_strings[0]}: no default in {text!r}"


def test_the_default_serve_shows_for_each_flag_is_the_settings_default():
    parser = subcommands()["serve"]
    by_dest = {a.dest: a for a in parser._actions}
    for flag in SERVE_FLAGS:
        if flag.setting is None:
            continue
        action = by_dest[flag.dest]
        default = default_of(ServeSettings, flag.setting)
        text = shown_help(parser, action)
        if isinstance(action, argparse._StoreConstAction):     # a switch: off means the setting's default
            assert action.default == default and action.const != default, flag.name
            assert text.endswith("(default: off)"), (flag.name, text)
        elif default is None:                                  # said in words: "(default: all)"
            assert re.search(r"default: \w", text), (flag.name, text)
        else:
            assert text.endswith(f"(default: {default})"), (flag.name, text, default)


def test_serve_without_flags_parses_to_the_settings_defaults(monkeypatch):
    for env in ("TANDEM_API_KEYS", "TANDEM_ADMIN_KEYS", "RAY_AUTH_MODE"):
        monkeypatch.delenv(env, raising=False)
    parsed = serve_settings(build_parser().parse_args(["serve"]))
    assert parsed == ServeSettings()


def test_every_setting_has_a_flag_or_is_named_as_having_none():
    flagged = {f.setting for f in SERVE_FLAGS if f.setting is not None} | set(COMPILE_SETTINGS)
    fields = {f.name for f in dataclasses.fields(ServeSettings)}
    assert fields - flagged == NOT_FLAGS
    assert flagged <= fields


@pytest.mark.parametrize("argv, field, value", [
    (["--port", "9000"], "port", 9000), (["--host", "0.0.0.0"], "host", "0.0.0.0"),
    (["--dtype", "bfloat16"], "dtype", "bfloat16"), (["--prefill-workers", "2"], "prefill_workers", 2),
    (["--max-model-len", "512"], "max_model_len", 512), (["--stream-idle-timeout", "5"], "stream_idle_timeout_s", 5.0),
    (["--no-prefix-cache"], "prefix_cache", False), (["--header-timeout", "2.5"], "header_timeout_s", 2.5),
    (["--max-connections-per-client", "8"], "max_connections_per_client", 8),
    (["--prompt-special-tokens"], "prompt_special_tokens", True), (["--drain-grace-s", "2.5"], "drain_timeout_s", 2.5),
    (["--colocated", "--colocated-workers", "3"], "colocated_workers", 3), (["--no-compile"], "compile", False),
])
def test_a_flag_given_sets_its_setting(argv, field, value):
    assert getattr(serve_settings(build_parser().parse_args(["serve", *argv])), field) == value
