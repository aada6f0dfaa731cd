"""The chaos smoke: every scenario, a few requests each, against a real Ray cluster (one
prefill and two decode workers, the shipped model), as `python -m chaos run` runs it."""

from __future__ import annotations

import json
import subprocess
import sys

from chaos.prefix import planned
from chaos.scenarios import SCENARIOS, split


def test_every_scenario_injects_and_nothing_leaks():
    proc = subprocess.run([sys.executable, "-m", "chaos", "run", "--requests", "90", "--concurrency", "8",
                           "--seed", "7", "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    rows = {s["name"]: s for s in report["scenarios"]}
    assert list(rows) == [s.name for s in SCENARIOS]
    assert report["ok"] and report["violations"] == 0
    assert report["leaks"] == report["corrupted_completions"] == report["pages_leaked"] == report["silent"] == 0
    # hostile scenarios run their requests twice, prefix ones send what their workload plans
    assert report["requests"] == sum(planned(s, n) for s, n in zip(SCENARIOS, split(90, list(SCENARIOS))))
    assert report["completed"] > 0
    for s in SCENARIOS:
        row = rows[s.name]
        assert row["ok"] and row["requests"] >= 2, row
        if s.name != "at_limit":
            assert row["faults_injected"] >= 1, row            # the scenario really did something
        assert row["faults_unaccounted"] == 0, row             # every fault detected or tolerated
        if not row["tolerated"] and s.group != "hostile":    # a hostile row counts what was held back
            assert row["faults_detected"] + row["faults_tolerated"] == row["faults_injected"], row
        if s.lossless:                                       # kills and drains: nothing fails
            assert row["completed"] == row["requests"], row
            # a kill or drain is detected only by streams the gateway migrated; a drain whose
            # streams all finished within its grace is tolerated (a small run may see only that)
            assert row["faults_detected"] == 0 or row["figures"]["migrations"] >= 1, row
            if s.driver != "drain_decode":
                assert row["figures"]["migrations"] >= 1, row      # a kill always cuts a stream
    transfer = [rows[s.name] for s in SCENARIOS if s.group == "transfer"]
    assert report["transfer_faults_injected"] == sum(r["faults_injected"] for r in transfer) >= len(transfer)
    assert report["transfer_faults_detected"] == report["transfer_faults_injected"]
    assert rows["over_by_one"]["failed_explicitly"] == rows["over_by_one"]["requests"]
    assert rows["at_limit"]["completed"] == rows["at_limit"]["requests"]
    assert rows["cross_tenant_probe"]["figures"]["probe_cached_tokens"] == 0
    assert rows["evict_under_load"]["figures"]["evictions"] > 0
