"""The chaos smoke: every scenario, a few requests each, against a real Ray cluster (one
prefill and two decode workers, the shipped model), as `python -m chaos run` runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from chaos.judges import Lossless
from chaos.moving import DrainDecode
from chaos.scenarios import SCENARIOS, split


def diagnosis(stdout: str, stderr: str) -> str:
    """What a failed run says, most telling first: every failing scenario's violations and
    notes (from the JSON report when stdout parses as one), then the tails of stdout and stderr
    (a CI log that cuts a long message keeps its head)."""
    try:
        report = json.loads(stdout)
    except ValueError:
        report = None
    lines = []
    for row in (report or {}).get("scenarios", []):
        if not row.get("ok", True):
            lines.append(f"FAILED {row['name']}: {row['faults_injected']} injected, {row['faults_detected']} detected, "
                         f"{row['faults_tolerated']} tolerated, {row['completed']}/{row['requests']} completed")
            lines += [f"  violation: {v}" for v in row["violations"]] + [f"  note: {n}" for n in row["notes"]]
    if report is None:
        lines.append("(stdout is not a JSON report)")
    return "\n".join(lines + ["--- stdout tail", stdout[-2000:], "--- stderr tail", stderr[-3000:]])


def _text(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""


def said(row: dict) -> str:
    """A scenario row for an assertion message, its violations and notes first."""
    return f"{row['name']}: violations {row['violations']}; notes {row['notes']}; row {row}"


def test_a_failed_runs_diagnosis_leads_with_the_violations():
    ok = {"name": "flipped_bit", "ok": True, "violations": [], "notes": []}
    bad = {"name": "drain_decode", "ok": False, "faults_injected": 2, "faults_detected": 1, "faults_tolerated": 0,
           "completed": 8, "requests": 8, "violations": ["1 of 2 injected faults were neither detected"],
           "notes": ["drained decode-0 holding 2 streams mid-way"]}
    text = diagnosis(json.dumps({"ok": False, "scenarios": [ok, bad]}), "x" * 10_000)
    assert text.startswith("FAILED drain_decode: 2 injected, 1 detected")
    assert text.index("violation: 1 of 2") < text.index("note: drained") < text.index("--- stdout tail")
    assert "flipped_bit" not in text.split("--- stdout tail")[0] and len(text) < 6000
    assert diagnosis("Traceback ...", "boom").startswith("(stdout is not a JSON report)")


def test_every_scenario_injects_and_nothing_leaks():
    try:
        proc = subprocess.run([sys.executable, "-m", "chaos", "run", "--requests", "90", "--concurrency", "8",
                               "--seed", "7", "--json"], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        pytest.fail("the chaos run took over 600 s\n" + diagnosis(_text(e.stdout), _text(e.stderr)))
    why = diagnosis(proc.stdout, proc.stderr)
    assert proc.returncode == 0, why
    report = json.loads(proc.stdout)
    rows = {s["name"]: s for s in report["scenarios"]}
    assert list(rows) == [s.name for s in SCENARIOS], why
    assert report["ok"] and report["violations"] == 0, why
    assert report["leaks"] == report["corrupted_completions"] == report["pages_leaked"] == report["silent"] == 0
    # hostile scenarios run their requests twice, prefix ones send what their workload plans
    assert report["requests"] == sum(s.sends(n) for s, n in zip(SCENARIOS, split(90, list(SCENARIOS))))
    assert report["completed"] > 0
    for s in SCENARIOS:
        row = rows[s.name]
        assert row["ok"] and row["requests"] >= 2, said(row)
        if s.name != "at_limit":
            assert row["faults_injected"] >= 1, said(row)      # the scenario really did something
        assert row["faults_unaccounted"] == 0, said(row)       # every fault detected or tolerated
        if not row["tolerated"] and s.group != "hostile":    # a hostile row counts what was held back
            assert row["faults_detected"] + row["faults_tolerated"] == row["faults_injected"], said(row)
        if Lossless() in s.judged:                           # kills and drains: nothing fails
            assert row["completed"] == row["requests"], said(row)
            # a kill or drain is detected only by streams the gateway migrated; a drain whose
            # streams all finished within its grace is tolerated (a small run may see only that)
            assert row["faults_detected"] == 0 or row["figures"]["migrations"] >= 1, said(row)
            if not isinstance(s.driver, DrainDecode):
                assert row["figures"]["migrations"] >= 1, said(row)    # a kill always cuts a stream
    transfer = [rows[s.name] for s in SCENARIOS if s.group == "transfer"]
    assert report["transfer_faults_injected"] == sum(r["faults_injected"] for r in transfer) >= len(transfer)
    assert report["transfer_faults_detected"] == report["transfer_faults_injected"]
    assert rows["over_by_one"]["failed_explicitly"] == rows["over_by_one"]["requests"]
    assert rows["at_limit"]["completed"] == rows["at_limit"]["requests"]
    # the prefix-cache scenarios (issue 18): each sends what its workload plans, whatever its share
    probe, poison, evict = (rows[n] for n in ("cross_tenant_probe", "cache_poison", "evict_under_load"))
    assert probe["faults_injected"] >= 3 and probe["faults_detected"] == probe["faults_injected"], said(probe)
    assert probe["figures"]["probe_cached_tokens"] == 0 and probe["figures"]["own_hit_tokens"] > 0, said(probe)
    assert poison["faults_injected"] >= 1 and poison["faults_detected"] == poison["faults_injected"], said(poison)
    assert poison["figures"]["cached_pages_checked"] > 0 and poison["figures"]["cached_pages_changed"] == 0
    assert evict["figures"]["evictions"] > 0 and evict["tolerated"], said(evict)
