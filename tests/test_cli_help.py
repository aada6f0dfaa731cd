"""`tandem ... --help` says what every option does and what it is when not given, and for
`tandem serve` that default is the field's own (ServeSettings' tree: deploy/settings.py,
worker/config.py, engine/config.py, gateway/config.py), both as shown and as parsed: a default
is written once."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from deploy import worker
from deploy.cli import build_parser, serve_settings
from deploy.flags import NOT_FLAGS, serve_fields
from deploy.settings import ServeSettings
from engine.options import SAYS_DEFAULT, STATED_DEFAULT, add_flag, default_of, field_of, help_of, option, paths


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


def test_the_default_serve_shows_for_each_flag_is_the_fields_default():
    parser = subcommands()["serve"]
    by_dest = {a.dest: a for a in parser._actions}
    for name in serve_fields():
        action = by_dest[name]
        default = default_of(ServeSettings, name)
        text = shown_help(parser, action)
        assert action.default is argparse.SUPPRESS, name          # argparse keeps no copy of the default
        assert len(STATED_DEFAULT.findall(text)) == 1, (name, text)          # its default, stated once
        if field_of(ServeSettings, name).metadata[SAYS_DEFAULT]:  # said in words: "(default: all)"
            assert text == " ".join(help_of(ServeSettings, name).split()), (name, text)
        elif isinstance(action, argparse._StoreConstAction):   # a switch: it turns the field's default around
            assert action.const != default, name
            assert text.endswith(f"(default: {'on' if default else 'off'})"), (name, text)
        else:
            assert text.endswith(f"(default: {default})"), (name, text, default)


def test_a_default_is_shown_unless_the_field_says_its_help_states_it():
    """Whether a help states its default in words is the field's `says_default`, not a guess
    from the word: a help that uses "default" for something else still shows its default, and a
    help whose marking disagrees with its text is refused when the flag is made."""
    @dataclasses.dataclass(frozen=True)
    class Config:
        budget: int = option(3, help="tokens past the default_max_tokens budget")
        name: str | None = option(None, says_default=True, help="a name (default: the model's)")
        unmarked: int = option(1, help="a count (default: one)")
        unsaid: int = option(1, says_default=True, help="a count")

    parser = argparse.ArgumentParser()
    shown = {n: shown_help(parser, add_flag(parser, Config, n)) for n in ("budget", "name")}
    assert shown == {"budget": "tokens past the default_max_tokens budget (default: 3)",
                     "name": "a name (default: the model's)"}
    with pytest.raises(TypeError, match="mark it says_default=True"):
        add_flag(parser, Config, "unmarked")
    with pytest.raises(TypeError, match="says no 'default: ...'"):
        add_flag(parser, Config, "unsaid")


def test_serve_without_flags_parses_to_the_settings_defaults(monkeypatch):
    for env in ("TANDEM_API_KEYS", "TANDEM_ADMIN_KEYS", "RAY_AUTH_MODE"):
        monkeypatch.delenv(env, raising=False)
    parsed = serve_settings(build_parser().parse_args(["serve"]))
    assert parsed == ServeSettings()


def test_every_setting_of_serve_itself_has_a_flag_or_is_named_as_having_none():
    own = {f.name for f in dataclasses.fields(ServeSettings) if "branch" not in f.metadata}
    assert own - set(serve_fields()) == own & set(NOT_FLAGS)
    assert set(NOT_FLAGS) <= paths(ServeSettings).keys()


def value(settings: Any, name: str) -> Any:
    """The field `name` of a ServeSettings tree, wherever it lives."""
    for step in paths(ServeSettings)[name]:
        settings = getattr(settings, step)
    return settings


@pytest.mark.parametrize("argv, field, value_", [
    (["--port", "9000"], "port", 9000), (["--host", "0.0.0.0"], "host", "0.0.0.0"),
    (["--dtype", "bfloat16"], "dtype", "bfloat16"), (["--prefill-workers", "2"], "prefill_workers", 2),
    (["--max-model-len", "512"], "max_model_len", 512), (["--stream-idle-timeout", "5"], "stream_idle_timeout_s", 5.0),
    (["--no-prefix-cache"], "enable_prefix_cache", False), (["--header-timeout", "2.5"], "header_timeout_s", 2.5),
    (["--max-connections-per-client", "8"], "max_connections_per_client", 8),
    (["--prompt-special-tokens"], "prompt_special_tokens", True), (["--drain-grace-s", "2.5"], "drain_grace_s", 2.5),
    (["--colocated", "--colocated-workers", "3"], "colocated_workers", 3), (["--no-compile"], "compile", False),
])
def test_a_flag_given_sets_its_setting(argv, field, value_):
    assert value(serve_settings(build_parser().parse_args(["serve", *argv])), field) == value_
