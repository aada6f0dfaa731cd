"""The `tandem` command line: the single-process `generate` demo, and `serve`'s flags failing
fast with a readable message before anything starts."""

import pytest

from deploy.cli import main


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
    (["serve", "--mem-fraction", "1.5"], "--mem-fraction must be in (0, 1)"),
    (["serve", "--device", "cuda"], "--gpus-per-worker > 0"),
    (["serve", "--worker-resources", "[1]"], "JSON object of role"),
    (["serve", "--worker-resources", '{"gpu": {"gpu_node": 1}}'], "gpu is not a role"),
    (["serve", "--drain-grace-s", "-1"], "--drain-grace-s must be >= 0"),
    (["serve", "--max-migrations", "-1"], "--max-migrations must be >= 0"),
    (["drain", "decode-0", "--restart", "--undo"], "--restart and --undo contradict each other"),
    (["drain", "decode-0", "--grace-s", "-2"], "--grace-s must be >= 0"),
])
def test_serve_fails_fast_on_bad_settings(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["serve", "--no-such-flag"], ["serve", "--placement-strategy", "RANDOM"],
                                  ["serve", "--port", "eighty"]])
def test_serve_refuses_unknown_or_malformed_flags(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


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
    assert s.worker_config(Role.PREFILL)["kv_cache_tokens"] == 16384
    assert s.worker_config(Role.DECODE)["kv_cache_tokens"] == 4096
    _check_kv(s)
    small = serve_settings(build_parser().parse_args(["serve", "--prefill-kv-cache-tokens", "512",
                                                      "--max-model-len", "1024"]))
    with pytest.raises(ValueError, match="--prefill-kv-cache-tokens 512 cannot hold"):
        _check_kv(small)
    with pytest.raises(ValueError, match="--colocated has none"):
        serve_settings(build_parser().parse_args(["serve", "--colocated", "--prefill-kv-cache-tokens", "4096"]))


def test_serve_maps_the_drain_and_migration_flags():
    from deploy.cli import build_parser, serve_settings
    s = serve_settings(build_parser().parse_args(["serve", "--drain-grace-s", "7.5", "--max-migrations", "0"]))
    assert (s.drain_timeout_s, s.max_migrations) == (7.5, 0)
    d = serve_settings(build_parser().parse_args(["serve"]))
    assert (d.drain_timeout_s, d.max_migrations) == (30.0, 3)
