"""`tandem preflight`: sizes from config.json, a K recommendation, readable refusals."""

import json

import pytest

from deploy.cli import main
from engine.experts.preflight import preflight


def test_preflight_figures_for_the_shipped_model():
    r = preflight("models/tiny-moe", memory_gib=0.02, dtype="bfloat16", concurrency=8,
                  target_tok_s=100.0, link_bytes_per_s=2e6)
    assert r["bytes_per_expert"] == 3 * 128 * 64 * 2
    assert r["slot_cost_bytes"] == 6 * r["bytes_per_expert"]
    assert r["kv_bytes_per_token"] == 2 * 6 * 2 * 32 * 2
    assert r["slot_cost_kv_tokens"] == 192
    assert r["host_store_bytes"] == 64 * r["slot_cost_bytes"]
    assert r["recommended_k"] == 32 and r["single_wave_batch_cap"] == 8
    # 100 tokens/s x 4 experts x 6 layers x 49152 bytes = 118 MB/s if every expert missed
    assert r["max_miss_rate_for_target"] == pytest.approx(2e6 / (100 * 4 * 6 * 49152))


def test_preflight_command_prints_text_and_json(capsys):
    assert main(["preflight", "--memory-gib", "0.05", "--link-gbps", "16"]) == 0
    text = capsys.readouterr().out
    assert "one wave serves up to" in text and "KV-cache tokens" in text
    assert main(["preflight", "--memory-gib", "0.05", "--link-gbps", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recommended_k"] == 32


def test_preflight_refuses_a_budget_too_small(capsys):
    assert main(["preflight", "--memory-gib", "0.001", "--link-gbps", "16"]) == 2
    assert "raise --memory-gib" in capsys.readouterr().err
