"""bench.real_shape and its trace on a CPU: the tiny run's JSON, the reference LRU against the
misses engine/experts counts on the same routing, the stored trace, and gpu_check's step."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.expert_trace import TRACE, load, mapped_steps, record, reference_lru_misses
from bench.gpu_check import STEPS, skip_reason
from bench.gpu_step import run_step
from bench.real_shape import SGLANG_K, main, measure
from engine.experts import ExpertSlots, ExpertStore, PagedExperts

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_cpu_run_reports_every_point_with_finite_ratios() -> None:
    out = measure("cpu", tiny=True)
    assert out["layers_run"] == 2 and out["layers_published"] == 48 and out["tiny"] is True
    assert (out["shape"]["num_experts"], out["shape"]["top_k"]) == (128, 8)
    assert out["K_preflight_16gib"] in out["Ks"] and set(SGLANG_K) <= set(out["Ks"])
    assert out["h2d_pinned_gbps"] > 0 and out["expert_bytes"] == 3 * 32 * 12 * 2
    points = out["points"]
    assert {(p["K"], p["batch"]) for p in points} >= {(k, b) for k in out["Ks"] for b in (1, 4, 16)}
    for p in points:
        assert p["misses_match_reference"], p
        assert p["tok_s"] > 0 and math.isfinite(p["tok_s"])
        assert p["ratio_to_bound"] is None or (math.isfinite(p["ratio_to_bound"]) and p["ratio_to_bound"] > 0)
        assert p["plan"] == "host" or p["single_wave"]
    for k in out["Ks"]:
        s = out["summary"][f"K{k}"]
        assert s["no_cliff_batches"] == [k // 8, k // 8 + 1]
        assert math.isfinite(s["no_cliff_ratio"]) and math.isfinite(s["b4_over_b1"])
        assert s["plan_b1"] == "device" and s["plan_b16"] == "host" and s["misses_match_reference"]
    json.dumps(out)


def test_the_command_prints_the_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--tiny", "--json", "--steps", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps_per_point"]["timed"] == 2 and "summary" in out


def test_reference_lru_by_hand() -> None:
    # K=3 starts [0, 1, 2] (0 oldest).  {1, 5}: 5 evicts 0, then 1 and 5 are used -> [2, 1, 5].
    # {2, 7}: 7 evicts 1 (2 is needed) -> [5, 2, 7].  {0, 2, 5, 7} needs 4 > K: waves [2, 5, 7] + [0],
    # the second evicting the oldest of the step's own -> 1 miss.
    assert reference_lru_misses([[1, 5], [2, 7], [0, 2, 5, 7], [2, 5]], 3) == [1, 1, 1, 1]


def paged(num_experts: int, k: int) -> PagedExperts:
    torch.manual_seed(0)
    store = ExpertStore(torch.randn(num_experts, 8, 4), torch.randn(num_experts, 4, 4))
    return PagedExperts(ExpertSlots(store, k, "cpu"))


def engine_misses(experts: PagedExperts, steps: list[torch.Tensor], on_device: bool) -> list[int]:
    out = []
    for ids in steps:
        before = experts.counters.misses
        x = torch.randn(ids.shape[0], 4)
        if on_device:
            experts.on_device = True
            experts.slots.prepare_device()
            experts(x, ids, torch.ones(ids.shape[0], dtype=torch.bool))
            experts.slots.device_stepped()
        else:
            experts(x, ids)
        out.append(experts.counters.misses - before)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_reference_lru_counts_the_misses_paged_experts_count(seed: int) -> None:
    rng = random.Random(seed)
    e, k, top_k = 16, rng.choice([4, 6, 9]), 2
    rows = [rng.choice([1, 2, 3, 5]) for _ in range(40)]   # steps of several rows: multi-wave ones too
    steps = [torch.tensor([rng.sample(range(e), top_k) for _ in range(r)]) for r in rows]
    want = reference_lru_misses([s.reshape(-1).tolist() for s in steps], k)
    assert engine_misses(paged(e, k), steps, on_device=False) == want
    single = [s for s in steps if s.numel() <= k]
    assert engine_misses(paged(e, k), single, on_device=True) == reference_lru_misses(
        [s.reshape(-1).tolist() for s in single], k)


def test_reference_lru_on_the_mapped_trace_matches_paged_experts() -> None:
    trace = load()
    (steps,) = mapped_steps(trace, 128, 8, 1, 3, 0, 24)        # [24, 3, 8]
    want = reference_lru_misses(steps.reshape(24, -1).tolist(), 24)
    assert sum(want) > 0
    assert engine_misses(paged(128, 24), list(steps), on_device=False) == want


def test_the_stored_trace_has_its_shape_and_maps_onto_pairs() -> None:
    assert TRACE.stat().st_size < 300_000
    trace = load()
    assert (trace.model, trace.num_experts, trace.top_k) == ("tiny-moe", 64, 4)
    assert tuple(trace.ids.shape) == (6, 16, 96, 4)
    assert all(len(set(row)) == 4 for row in trace.ids.reshape(-1, 4).tolist())   # top-k ids are distinct
    mapped = mapped_steps(trace, 128, 8, 8, 4, 10, 5)
    assert len(mapped) == 8 and tuple(mapped[0].shape) == (5, 4, 8)
    assert torch.equal(mapped[7], mapped[1])                                      # layers cycle over 6
    shipped = trace.ids[2, 3, 12]                                                 # layer 2, sequence 3, step 12
    assert sorted(mapped[2][2, 3].tolist()) == sorted([2 * e + j for e in shipped.tolist() for j in (0, 1)])
    with pytest.raises(ValueError, match="scaled by one factor"):
        mapped_steps(trace, 128, 4, 1, 1, 0, 1)


def test_recording_again_gives_the_stored_trace() -> None:
    again = record(sequences=2, steps=8)
    stored = load().ids[:, :2, :8]
    assert torch.equal(torch.tensor(again["ids"]), stored)


def test_gpu_check_lists_real_shape_and_skips_it_without_cuda() -> None:
    step = next(s for s in STEPS if s.name == "real_shape")
    assert skip_reason(step, False, False, {"real_shape"}, 1000.0) == "needs a CUDA device"
    assert skip_reason(step, True, False, {"real_shape"}, 1000.0) is None
    r = run_step("real_shape", "cpu", False)
    assert r["status"] == "skipped" and "needs a CUDA device" in r["reason"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_gpu_check_steps_real_shape_reports_the_skip(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--steps", "real_shape", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = {s["name"]: s for s in json.loads(out.read_text())["steps"]}
    assert steps["real_shape"]["status"] == "skipped" and steps["real_shape"]["reason"] == "needs a CUDA device"
