"""bench.compile_cost's plumbing without a model: the alternating timer, the compile child's
environment, and the guard that a cold compile really starts from an empty cache."""

from __future__ import annotations

import os

import pytest

from bench import compile_cost
from bench.compile_cost import ROOT, alternate, batch_prompts, child_env


def test_alternate_warms_each_then_reverses_the_order_every_other_round():
    calls: list[str] = []
    best = alternate({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert set(best) == {"a", "b"} and all(0 <= t < float("inf") for t in best.values())


def test_batch_prompts_cycle():
    assert batch_prompts(["x", "y"], 5) == ["x", "y", "x", "y", "x"]


def test_child_env_points_every_cache_at_the_new_directory(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere/inductor")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere/triton")
    env = child_env("/tmp/fresh")
    assert "TORCHINDUCTOR_CACHE_DIR" not in env and "TRITON_CACHE_DIR" not in env
    assert env["TANDEM_CACHE_DIR"] == "/tmp/fresh"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


def test_compile_cost_refuses_a_child_whose_cache_is_not_the_fresh_one(monkeypatch):
    def child(cache, device, threads, buckets, resident):
        return {"compile_s": 1.0, "wall_s": 2.0, "buckets": [1], "cache_dir": "/tmp/torchinductor_x", "cache": {}}
    monkeypatch.setattr(compile_cost, "_child", child)
    with pytest.raises(RuntimeError, match="not under its TANDEM_CACHE_DIR"):
        compile_cost.compile_cost("cpu", 1, [1])


def test_compile_cost_reports_both_children(monkeypatch):
    def child(cache, device, threads, buckets, resident):
        return {"compile_s": 1.0, "wall_s": 2.0, "buckets": [1, 2], "cache_dir": f"{cache}/inductor",
                "cache": {"fxgraph_cache_hit": 1}}
    monkeypatch.setattr(compile_cost, "_child", child)
    out = compile_cost.compile_cost("cpu", 1, [1, 2])
    assert out["compile_buckets"] == [1, 2] and out["compile_resident"] is None
    assert {"compile_s", "compile_cached_s", "compile_wall_s", "compile_cached_wall_s"} <= set(out)
    assert out["compile_cache_counters"] == {"cold": {"fxgraph_cache_hit": 1}, "warm": {"fxgraph_cache_hit": 1}}


def test_compile_cost_passes_the_resident_experts_to_both_children(monkeypatch):
    seen = []

    def child(cache, device, threads, buckets, resident):
        seen.append(resident)
        return {"compile_s": 1.0, "wall_s": 2.0, "buckets": [1], "cache_dir": f"{cache}/inductor", "cache": {}}
    monkeypatch.setattr(compile_cost, "_child", child)
    assert compile_cost.compile_cost("cpu", 1, [1], resident=16)["compile_resident"] == 16
    assert seen == [16, 16]
