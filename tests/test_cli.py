"""The `tandem` command line: the single-process `generate` demo, and `serve`'s flags failing
fast with a readable message before anything starts."""

import json

import pytest

from deploy.cli import main
from engine.config import SHIPPED_MODEL, EngineConfig
from engine.options import default_of
from gateway.config import GatewaySettings
from worker.config import WorkerSettings


def test_generate_prints_replies_and_speed(capsys):
    assert main(["generate", "--max-tokens", "6", "--prompt", "Repeat after me: ok"]) == 0
    out = capsys.readouterr().out
    assert "user:      Repeat after me: ok" in out and "tokens/s" in out


def test_generate_refuses_a_prompt_over_the_context(capsys):
    assert main(["generate", "--max-model-len", "8", "--max-tokens", "6", "--prompt", "Repeat after me: ok"]) == 2
    assert "exceeds the model context of 8 tokens" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["serve", "--model", "/nonexistent/model"], "no config.json there"),
    (["serve", "--kv-cache-tokens", "512"], "cannot hold one request of the maximum context (2048 tokens)"),
    (["serve", "--kv-cache-tokens", "4096", "--mem-fraction", "0.5"], "give one"),
    (["serve", "--colocated", "--prefill-workers", "2"], "--colocated workers do both"),
    (["serve", "--decode-workers", "0"], "--decode-workers must be >= 1"),
    (["serve", "--mem-fraction", "1.5"], "mem_fraction=1.5 must be in (0, 1)"),
    (["serve", "--device", "cuda"], "--gpus-per-worker > 0"),
    (["serve", "--worker-resources", '{"gpu": {"gpu_node": 1}}'], "gpu is not a role"),
    (["serve", "--drain-grace-s", "-1"], "drain_grace_s=-1.0 must be >= 0"),
    (["serve", "--max-migrations", "-1"], "max_migrations=-1 must be >= 0"),
    (["drain", "decode-0", "--restart", "--undo"], "--restart and --undo contradict each other"),
    (["drain", "decode-0", "--grace-s", "-2"], "--grace-s must be >= 0"),
])
def test_serve_fails_fast_on_bad_settings(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_default_pool_too_small_is_named_as_the_default(capsys, tmp_path):
    """--kv-cache-tokens was never given: the message says the default is too small, with the
    field's number, rather than quote a flag the user did not pass."""
    config = json.loads((SHIPPED_MODEL / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32768}))
    assert main(["serve", "--model", str(tmp_path)]) == 2
    default = default_of(EngineConfig, "kv_cache_tokens")
    assert f"the default --kv-cache-tokens {default} cannot hold one request of the maximum context (32768 " \
        "tokens)" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path), "--kv-cache-tokens", str(default)]) == 2
    assert f"tandem: error: --kv-cache-tokens {default} cannot hold" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["serve", "--no-such-flag"], "unrecognized arguments"), (["serve", "--placement-strategy", "RANDOM"], "invalid"),
    (["serve", "--port", "eighty"], "invalid int value"),
    (["serve", "--worker-resources", "[1]"], "JSON object of role"),
    (["serve", "--worker-resources", "{"], "argument --worker-resources")])
def test_serve_refuses_unknown_or_malformed_flags(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error:" in err and message in err


def test_every_placement_strategy_the_flag_offers_is_accepted():
    from deploy.cli import build_parser, serve_settings
    from deploy.settings import PLACEMENT_STRATEGIES
    for strategy in PLACEMENT_STRATEGIES:
        assert serve_settings(build_parser().parse_args(["serve", "--placement-strategy", strategy]))


def test_a_plugged_in_command_runs_without_deploy_importing_it(capsys):
    """`tandem chaos` comes from the `tandem.commands` entry point group (chaos.cli:main)."""
    assert main(["chaos", "list"]) == 0
    assert "flipped_bit" in capsys.readouterr().out


def test_prefill_workers_get_their_own_kv_pool():
    """--prefill-kv-cache-tokens sizes the prefill workers' pool (their prefix cache) only;
    refused below one request of the context and with --colocated."""
    from deploy.cli import _check_kv, build_parser, serve_settings
    from worker.types import Role
    s = serve_settings(build_parser().parse_args(
        ["serve", "--kv-cache-tokens", "4096", "--prefill-kv-cache-tokens", "16384", "--max-model-len", "1024"]))
    assert s.worker_settings(Role.PREFILL).engine.kv_cache_tokens == 16384
    assert s.worker_settings(Role.DECODE).engine.kv_cache_tokens == 4096
    _check_kv(s, {"kv_cache_tokens", "prefill_kv_cache_tokens", "max_model_len"})
    small = serve_settings(build_parser().parse_args(["serve", "--prefill-kv-cache-tokens", "512",
                                                      "--max-model-len", "1024"]))
    with pytest.raises(ValueError, match="--prefill-kv-cache-tokens 512 cannot hold"):
        _check_kv(small, {"prefill_kv_cache_tokens", "max_model_len"})
    with pytest.raises(ValueError, match="--colocated has none"):
        serve_settings(build_parser().parse_args(["serve", "--colocated", "--prefill-kv-cache-tokens", "4096"]))


def test_serve_maps_the_drain_and_migration_flags():
    from deploy.cli import build_parser, serve_settings
    s = serve_settings(build_parser().parse_args(["serve", "--drain-grace-s", "7.5", "--max-migrations", "0"]))
    assert (s.worker.drain_grace_s, s.gateway.max_migrations) == (7.5, 0)
    d = serve_settings(build_parser().parse_args(["serve"]))
    assert (d.worker.drain_grace_s, d.gateway.max_migrations) == (default_of(WorkerSettings, "drain_grace_s"),
                                                                  default_of(GatewaySettings, "max_migrations"))


# ---- the compiled decode step's flags (nothing here compiles: engines start with --no-compile) ----

@pytest.mark.parametrize("argv", [["serve"], ["generate"], ["worker"]])
@pytest.mark.parametrize("text, message", [
    ("1,2,128", "compile bucket 128 exceeds max_num_seqs=64"),
    ("1,x,4", "'x' is not a positive batch size"),
    ("0,2", "'0' is not a positive batch size"),
    ("", "'' is not a positive batch size"),
])
def test_a_bad_bucket_list_is_refused_naming_the_entry_and_the_limit(capsys, argv, text, message):
    from deploy import worker
    run = worker.main if argv == ["worker"] else main
    args = ["--role", "decode"] if argv == ["worker"] else argv
    with pytest.raises(SystemExit) as e:
        run([*args, "--compile-buckets", text])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --compile-buckets" in err and message in err


def test_compile_flags_reach_every_worker_of_serve(monkeypatch):
    """The default (compiled unless TANDEM_COMPILE=0) is decided in the driver and handed to the
    workers; a prefill worker never compiles (it runs no decode batch)."""
    from deploy.cli import build_parser, serve_settings
    from engine.options import fields_of
    from worker.config import WorkerConfig
    from worker.types import Role
    monkeypatch.delenv("TANDEM_COMPILE", raising=False)
    s = serve_settings(build_parser().parse_args(["serve", "--compile-buckets", "4,1,2,2"]))
    assert s.engine.compile and s.engine.compile_buckets == (1, 2, 4)
    for role, compiled in ((Role.DECODE, True), (Role.COLOCATED, True), (Role.PREFILL, False)):
        ec = WorkerConfig(**fields_of(s.worker_settings(role)), secret=b"s" * 32).engine_config()
        assert (ec.compile, ec.compile_buckets) == (compiled, (1, 2, 4))
    off = serve_settings(build_parser().parse_args(["serve", "--no-compile"]))
    assert not off.engine.compile and not any(off.worker_settings(r).engine.compile for r in Role)
    monkeypatch.setenv("TANDEM_COMPILE", "0")
    assert not serve_settings(build_parser().parse_args(["serve"])).engine.compile


def test_compile_flags_reach_a_plain_worker_process_engine_config(monkeypatch):
    from deploy.worker import config_from, parser
    monkeypatch.setenv("TANDEM_CLUSTER_SECRET", "ab" * 32)
    monkeypatch.delenv("TANDEM_COMPILE", raising=False)
    on = config_from(parser().parse_args(["--role", "decode", "--compile-buckets", "1,8"])).engine_config()
    assert on.compile and on.compile_buckets == (1, 8)
    off = config_from(parser().parse_args(["--role", "colocated", "--no-compile"])).engine_config()
    assert not off.compile and off.compile_buckets is None
    prefill = config_from(parser().parse_args(["--role", "prefill", "--decode-peer", "grpc://127.0.0.1:1"]))
    assert not prefill.engine_config().compile


def test_bucket_settings_are_checked_before_anything_loads():
    """A config built without the flags (Ray hands a dict to WorkerConfig) is checked too."""
    from deploy.settings import ServeSettings
    from engine.options import build
    from worker.config import WorkerConfig
    with pytest.raises(ValueError, match="compile bucket 65 exceeds max_num_seqs=64"):
        build(ServeSettings, compile_buckets=(1, 65))
    with pytest.raises(ValueError, match="compile bucket 16 exceeds max_num_seqs=8"):
        build(WorkerConfig, max_num_seqs=8, compile_buckets=(1, 16), secret=b"s" * 32)
    with pytest.raises(ValueError, match="at least one is needed"):
        build(WorkerConfig, compile_buckets=(), secret=b"s" * 32)
    kept = build(WorkerConfig, max_num_seqs=8, compile_buckets=(8, 1), secret=b"s" * 32)
    assert kept.engine.compile_buckets == (8, 1)


def test_generate_with_no_compile_runs_eager_even_when_compiling_is_the_default(monkeypatch, capsys):
    monkeypatch.delenv("TANDEM_COMPILE", raising=False)
    assert main(["generate", "--no-compile", "--max-tokens", "2", "--prompt", "Repeat after me: ok"]) == 0
    assert "decode eager" in capsys.readouterr().out
