"""`bench.gpu_check` on a machine without CUDA: its quick path end to end, the JSON schema,
and how a failing, hanging or skipped step is recorded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_check import STEPS, child_env, run_module_step, skip_reason
from bench.gpu_pytest import pytest_step
from bench.gpu_report import summary

ROOT = Path(__file__).resolve().parents[1]
STEP_KEYS = {"name", "status", "seconds", "reason", "figures", "details"}


def check_schema(report: dict) -> None:
    assert set(report) >= {"device", "steps", "failures"}
    assert isinstance(report["device"], dict) and isinstance(report["failures"], int)
    assert [s["name"] for s in report["steps"]] == [s.name for s in STEPS]
    for s in report["steps"]:
        assert set(s) >= STEP_KEYS, s
        assert s["status"] in ("ok", "failed", "skipped")
        assert isinstance(s["seconds"], float) and isinstance(s["figures"], dict)
        assert s["status"] == "ok" or s["reason"], s        # a skip or failure says why
    assert report["failures"] == sum(s["status"] == "failed" for s in report["steps"])
    json.dumps(report)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_quick_cpu_run_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--quick", "--steps", "engine",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    check_schema(report)
    steps = {s["name"]: s for s in report["steps"]}
    assert report["device"]["device"] == "cpu" and report["device"]["cuda_available"] is False
    assert steps["device"]["status"] == "ok" and steps["engine"]["status"] == "ok"
    assert steps["engine"]["figures"]["engine_single_tok_s"] > 0
    assert steps["attention_bandwidth"]["status"] == "skipped"
    assert steps["cuda_tests"]["reason"] == "not selected (--steps)"
    assert steps["families"]["status"] == "skipped"
    assert "0 failed step(s)" in proc.stdout and str(out) in proc.stdout


def test_a_pytest_step_records_each_failure_with_its_traceback(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_good():\n    pass\n"
        "def test_bad():\n    assert 1 + 1 == 3, 'arithmetic'\n"
        "@pytest.mark.skip(reason='not here')\ndef test_skipped():\n    pass\n")
    env, _ = child_env()
    r = pytest_step([str(tmp_path / "test_sample.py")], 120, env, str(tmp_path), tmp_path, "sample")
    assert r["status"] == "failed" and r["reason"].startswith("1 of 3 tests failed")
    f = r["figures"]
    assert (f["passed"], f["failed"], f["skipped"]) == (1, 1, 1)
    assert "test_bad" in r["details"][0] and "arithmetic" in r["details"][0]


def test_a_pytest_step_whose_tests_all_skip_is_skipped_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "test_skips.py").write_text(
        "import pytest\npytestmark = pytest.mark.skip(reason='needs a CUDA device')\n"
        "def test_a():\n    pass\n")
    env, _ = child_env()
    r = pytest_step([str(tmp_path / "test_skips.py")], 120, env, str(tmp_path), tmp_path, "skips")
    assert r["status"] == "skipped" and "needs a CUDA device" in r["reason"]


def test_a_pytest_step_reads_the_figures_its_tests_record(tmp_path: Path) -> None:
    (tmp_path / "test_figures.py").write_text(
        "def test_a(record_testsuite_property):\n"
        "    record_testsuite_property('mixtral.cuda_vs_cpu_max_logprob_diff', 1.5e-06)\n"
        "    record_testsuite_property('mixtral.paged_misses', 12)\n"
        "    record_testsuite_property('note', 'text')\n")
    env, _ = child_env()
    r = pytest_step([str(tmp_path / "test_figures.py")], 120, env, str(tmp_path), tmp_path, "figures")
    assert r["status"] == "ok", r
    assert r["figures"]["properties"] == {"mixtral": {"cuda_vs_cpu_max_logprob_diff": 1.5e-06, "paged_misses": 12},
                                          "note": "text"}


def test_the_families_step_needs_cuda_and_its_summary_names_each_family() -> None:
    families = next(s for s in STEPS if s.name == "families")
    assert skip_reason(families, cuda=False, quick=False, chosen=None, left_s=300) == "needs a CUDA device"
    assert skip_reason(families, cuda=True, quick=False, chosen=None, left_s=300) is None
    figures = {"passed": 27, "failed": 0, "errors": 0, "skipped": 0,
               "families": {"deepseek_v3": {"cuda_vs_cpu_max_logprob_diff": 2.1e-06},
                            "gpt_oss": {"cuda_vs_cpu_max_logprob_diff": 9.5e-07}}}
    steps = [{"name": s.name, "status": "ok" if s.name == "families" else "skipped", "reason": "why",
              "figures": figures if s.name == "families" else {}, "details": [], "seconds": 0.0} for s in STEPS]
    text = summary({"device": {"device": "cuda"}, "steps": steps, "failures": 0, "seconds": 3.0}, "/x.json")
    assert "passed 27 failed 0" in text and "deepseek_v3 2.1e-06, gpt_oss 9.5e-07" in text


def test_a_step_over_its_time_limit_fails_and_says_so(tmp_path: Path) -> None:
    env, _ = child_env()
    r = run_module_step("engine", "cpu", True, 0.5, env, str(tmp_path))
    assert r["status"] == "failed" and r["reason"] == "timed out after 0 s"   # 0.5 s, rounded


def test_summary_fits_a_screen_and_names_failures() -> None:
    steps = [{"name": s.name, "status": "skipped", "reason": "why", "figures": {}, "details": [],
              "seconds": 0.0} for s in STEPS]
    steps[1] = {**steps[1], "status": "failed", "reason": "1 of 2 tests failed",
                "details": ["tests/test_cuda_paths.py::test_x: boom\ntrace"]}
    text = summary({"device": {"device": "cpu"}, "steps": steps, "failures": 1, "seconds": 3.0}, "/x.json")
    lines = text.splitlines()
    assert len(lines) <= 24 and all(len(line) <= 220 for line in lines)
    assert "! cuda_tests: tests/test_cuda_paths.py::test_x: boom" in text and "1 failed step(s)" in text
