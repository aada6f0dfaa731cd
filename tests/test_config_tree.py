"""Config is one tree (issue 33, item 6): ServeSettings holds WorkerSettings, which holds
EngineConfig, and GatewaySettings; WorkerConfig and GatewayConfig add a process's wiring.
Every `tandem serve` flag maps to one field of that tree, each setting is declared once (no
config restates another's field, no command line or `LLM` restates a default), and a value
given by name reaches the config that uses it."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from deploy import worker as worker_process
from deploy.cli import build_parser, serve_settings
from deploy.flags import ENGINE_FLAGS, SERVE_FLAGS, Flag, serve_fields
from deploy.settings import ServeSettings
from engine.config import EngineConfig
from engine.constraint import GRAMMAR_COMPILE_TIMEOUT_S
from engine.llm import LLM
from engine.options import HELP, build, default_of, fields_of, flag_of, paths
from engine.params import REQUEST_TIMEOUT_S
from gateway import server as gateway_process
from gateway.config import GatewayConfig, GatewaySettings
from worker.config import GRAMMAR_CHECK_TIMEOUT_S, MAX_REQUEST_TIMEOUT_S, WorkerConfig, WorkerSettings
from worker.types import Role

SECRET = b"s" * 32
TREES = (EngineConfig, WorkerConfig, GatewayConfig, ServeSettings)


def own_fields(cls: type) -> set[str]:
    """The fields `cls` declares itself: not inherited, not a branch holding another config."""
    inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base) for f in dataclasses.fields(base)}
    return {f.name for f in dataclasses.fields(cls) if f.name not in inherited and "branch" not in f.metadata}


def command_parsers() -> dict[str, tuple[argparse.ArgumentParser, type]]:
    """Each command that builds a config from flags: its parser and the config it builds."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {"tandem serve": (sub.choices["serve"], ServeSettings),
            "tandem generate": (sub.choices["generate"], EngineConfig),
            "python -m deploy.worker": (worker_process.parser(), WorkerConfig),
            "python -m gateway.server": (gateway_process.parser(), GatewayConfig)}


# ---- every serve flag maps to one field ---------------------------------------------------

def test_every_serve_flag_maps_to_one_field_of_the_tree():
    parser, _ = command_parsers()["tandem serve"]
    tree = paths(ServeSettings)                       # raises TypeError when two fields share a name
    extras = {row.name for rows in SERVE_FLAGS.values() for row in rows if isinstance(row, Flag)}
    options = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    assert len({a.dest for a in options}) == len(options), "two flags set one field"
    for action in options:
        if action.dest in serve_fields():
            assert action.dest in tree, action.option_strings
            assert action.option_strings == [flag_of(ServeSettings, action.dest)]
        else:
            assert action.option_strings[0] in extras, f"{action.option_strings[0]} sets no field of ServeSettings"
    assert sorted(serve_fields()) == sorted(set(serve_fields())), "a field listed twice"


def test_each_tree_names_each_setting_once_and_gives_it_help():
    for cls in TREES:
        for name in paths(cls):                        # raises TypeError on a name two fields share
            field = next(f for f in _all_fields(cls) if f.name == name)
            assert field.metadata.get(HELP), f"{cls.__name__}.{name} has no help"


def _all_fields(cls: type) -> list[dataclasses.Field]:
    out = []
    for f in dataclasses.fields(cls):
        out.append(f)
        if "branch" in f.metadata:
            out.extend(_all_fields(f.metadata["branch"]))
    return out


# ---- no default is restated -----------------------------------------------------------------

def test_no_config_restates_a_field_of_a_config_it_holds_or_builds():
    components = {f.name for cls in (EngineConfig, WorkerSettings, GatewaySettings) for f in dataclasses.fields(cls)}
    assert not own_fields(ServeSettings) & components
    assert not own_fields(WorkerSettings) & {f.name for f in dataclasses.fields(EngineConfig)}
    assert not own_fields(WorkerConfig) & {f.name for f in dataclasses.fields(EngineConfig)}
    assert issubclass(WorkerConfig, WorkerSettings) and issubclass(GatewayConfig, GatewaySettings)


def test_llm_takes_the_engine_configs_fields_without_restating_them():
    params = inspect.signature(LLM.__init__).parameters
    assert any(p.kind is p.VAR_KEYWORD for p in params.values())
    assert not (set(params) - {"self", "model"}) & {f.name for f in dataclasses.fields(EngineConfig)}
    with pytest.raises(TypeError, match="no_such_field"):
        LLM(no_such_field=1)


@pytest.mark.parametrize("command", sorted(command_parsers()))
def test_no_command_line_holds_a_default_of_a_field(command):
    """An option that sets a field parses to nothing when not given: the default the config
    gets is the field's, and --help shows that one."""
    parser, cls = command_parsers()[command]
    tree = paths(cls)
    fields = [a for a in parser._actions if a.dest in tree]
    assert fields
    for action in fields:
        assert action.default is argparse.SUPPRESS, (command, action.option_strings, action.default)


def test_the_engine_flags_are_the_same_fields_on_every_command_that_runs_an_engine():
    for command in ("tandem serve", "tandem generate", "python -m deploy.worker"):
        parser, _ = command_parsers()[command]
        by_dest = {a.dest: a for a in parser._actions}
        for name in ENGINE_FLAGS:
            assert by_dest[name].option_strings == [flag_of(EngineConfig, name)], (command, name)


# ---- values given by name reach their config --------------------------------------------------

def test_build_puts_each_name_on_its_field_and_refuses_unknown_ones():
    cfg = build(WorkerConfig, kv_cache_tokens=4096, verify_experts=True, port=7, secret=SECRET)
    assert (cfg.engine.kv_cache_tokens, cfg.verify_experts, cfg.port) == (4096, True, 7)
    assert cfg.engine.page_size == default_of(EngineConfig, "page_size")
    whole = build(WorkerConfig, engine=EngineConfig(seed=3), kv_cache_tokens=64, secret=SECRET)
    assert (whole.engine.seed, whole.engine.kv_cache_tokens) == (3, 64)
    with pytest.raises(TypeError, match="prefix_cache"):
        build(WorkerConfig, prefix_cache=False, secret=SECRET)      # the old name: enable_prefix_cache


def test_build_refuses_a_field_given_with_the_one_it_replaces():
    """mem_fraction sizes the pool instead of kv_cache_tokens: a library caller that names both
    is refused as `tandem serve` is, not silently given mem_fraction's pool."""
    for cls, extra in ((ServeSettings, {}), (WorkerSettings, {}), (WorkerConfig, {"secret": SECRET})):
        with pytest.raises(ValueError, match="--kv-cache-tokens and --mem-fraction are both given.*give one"):
            build(cls, kv_cache_tokens=4096, mem_fraction=0.5, **extra)
    assert build(WorkerSettings, mem_fraction=0.5).mem_fraction == 0.5


def test_a_worker_holds_its_engine_config_and_always_bounds_grammar_checks():
    cfg = build(WorkerConfig, kv_cache_tokens=4096, secret=SECRET)
    assert cfg.engine_config() is cfg.engine
    assert cfg.engine_config(2048) == dataclasses.replace(cfg.engine, kv_cache_tokens=2048)
    assert default_of(EngineConfig, "grammar_check_timeout_s") is None          # engine.LLM: no budget
    assert cfg.engine.grammar_check_timeout_s == GRAMMAR_CHECK_TIMEOUT_S       # a worker: always one
    assert build(WorkerConfig, grammar_check_timeout_s=2.0, secret=SECRET).engine.grammar_check_timeout_s == 2.0


def test_the_gateway_and_the_workers_read_their_paired_timeouts_from_one_engine_constant():
    """The gateway cannot import worker/config.py (it loads torch): both read torch-free engine
    modules, the worker's values derived from the gateway's defaults."""
    assert default_of(GatewaySettings, "request_timeout_s") == REQUEST_TIMEOUT_S
    assert default_of(WorkerSettings, "max_request_timeout_s") == MAX_REQUEST_TIMEOUT_S == REQUEST_TIMEOUT_S
    assert default_of(GatewaySettings, "grammar_compile_timeout_s") == GRAMMAR_COMPILE_TIMEOUT_S
    assert GRAMMAR_CHECK_TIMEOUT_S == 2 * GRAMMAR_COMPILE_TIMEOUT_S       # what the gateway passed passes there


def test_serve_flags_reach_the_worker_and_gateway_configs():
    s = serve_settings(build_parser().parse_args(
        ["serve", "--kv-cache-tokens", "4096", "--no-prefix-cache", "--prefill-kv-cache-tokens", "8192",
         "--port", "9000", "--gateway-replicas", "2", "--routing", "load"]))
    decode = WorkerConfig(**fields_of(s.worker_settings(Role.DECODE)), secret=SECRET)
    prefill = WorkerConfig(**fields_of(s.worker_settings(Role.PREFILL)), secret=SECRET)
    assert (decode.engine.kv_cache_tokens, decode.engine.enable_prefix_cache) == (4096, False)
    assert (prefill.engine.kv_cache_tokens, prefill.engine.compile) == (8192, False)
    second = GatewayConfig(**s.gateway_fields(1), colocated_workers=("127.0.0.1:1",), cluster_secret=SECRET)
    assert (second.port, second.routing, second.model) == (9001, "load", s.model)
    assert second.served_model_name == s.name == "tiny-moe"


def test_a_gateway_left_unnamed_serves_its_model_directorys_name(tmp_path):
    model = tmp_path / "my-model"
    cfg = GatewayConfig(model=str(model), colocated_workers=("127.0.0.1:1",), cluster_secret=SECRET)
    assert cfg.served_model_name == "my-model"
    named = GatewayConfig(served_model_name="x", colocated_workers=("127.0.0.1:1",), cluster_secret=SECRET)
    assert named.served_model_name == "x"
