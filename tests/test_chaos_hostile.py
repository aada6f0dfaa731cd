"""The chaos suite's hostile scenarios (issue 16): their parts on their own, then the four in a
small real run, as `python -m chaos run` runs them.  Only completion, exactness and the
refusals are asserted; the TTFT figures are reported, never compared with a time."""

from __future__ import annotations

import json
import subprocess
import sys

from chaos.attacker import Reply, _parse
from chaos.client import Outcome
from chaos.gauges import metric, parse_metrics, percentile
from chaos.hostile import REDOS, judge_redos
from chaos.oracle import judge
from chaos.prompts import ATTACKER, VICTIMS, Job
from chaos.report import ScenarioResult
from chaos.scenarios import BY_NAME

HOSTILE = ("redos", "slow_reader", "chunked_bomb", "kv_hog")


def test_metrics_are_read_by_name_and_labels():
    samples = parse_metrics('# HELP x\ntandem_tenant_running{tenant="umbrella"} 3.0\n'
                            'tandem_tenant_running{tenant="acme"} 1.0\ntandem_responses_stalled_total 4.0\n')
    assert metric(samples, "tandem_tenant_running", tenant="umbrella") == 3
    assert metric(samples, "tandem_tenant_running") == 4
    assert metric(samples, "tandem_responses_stalled_total") == 4 and metric(samples, "nothing") == 0


def test_percentile_is_nearest_rank():
    assert percentile([], 99) is None
    assert percentile([0.3, 0.1, 0.2], 99) == 0.3 and percentile(list(range(1, 101)), 99) == 99


def test_redos_rules_accept_only_the_expected_ends():
    refusal = Reply("x", 400, "invalid_request", "stop has 17 strings; at most 16 are allowed", ended="answered")
    assert judge_redos(refusal, "refused", ("stop", "16")) == (True, None)
    assert judge_redos(refusal, "refused", ("stop_regex", "4"))[1] is not None        # names another field
    budget = Reply("x", 400, "INVALID_REQUEST", "stop_regex '(?:.|.)+(?!)' exceeded the stop-check budget of "
                   "50 ms per token", ended="answered")
    assert judge_redos(budget, "budget", ()) == (True, None)
    done = Reply("x", 200, finish="length", ended="answered")
    assert judge_redos(done, "budget", ()) == (False, None) and judge_redos(done, "bounded", ()) == (True, None)
    assert judge_redos(Reply("x", ended="timeout"), "budget", ())[1] is not None     # a hang
    assert judge_redos(Reply("x", 500, "INTERNAL", "boom", ended="answered"), "bounded", ())[1] is not None
    assert {expect for _, _, expect, _ in REDOS} == {"refused", "budget", "bounded"}


def test_an_attackers_stream_and_error_bodies_are_read():
    out = Reply("hog")
    _parse(b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": null}]}\n\n'
           b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}\n\ndata: [DONE]\n\n', out)
    assert (out.text, out.finish) == ("hi", "length")
    err = Reply("x")
    _parse(b'{"error": {"message": "too big", "code": "body_too_large"}}', err)
    assert (err.code, err.message) == ("body_too_large", "too big")


def test_victims_are_the_other_tenants_and_an_attackers_canary_is_a_leak():
    from chaos.prompts import jobs_for

    class Maker:
        rng = __import__("random").Random(1)
        n = 0

        def job(self, scenario, length, max_tokens, **kw):
            self.n += 1
            return Job(self.n, scenario, "umbrella", f"canary {self.n:010x}", [1] * length, max_tokens, **kw)
    jobs = jobs_for(Maker(), BY_NAME["kv_hog"], 9, 512)     # type: ignore[arg-type]
    assert ATTACKER not in {j.tenant for j in jobs} and {j.tenant for j in jobs} == set(VICTIMS)
    assert all(j.stream for j in jobs)
    r = ScenarioResult("kv_hog", "hostile", "", outcomes=[Outcome(jobs[0], "ok", text=jobs[0].canary)],
                       other_texts=[f"... {jobs[0].canary} ..."])

    class Ref:
        def tokens(self, ids, max_tokens):
            return []
    judge([r], Ref())      # type: ignore[arg-type]
    assert r.leaks == 1 and any("the attacker was sent the canary" in v for v in r.violations)


def test_the_hostile_scenarios_in_a_small_run():
    proc = subprocess.run([sys.executable, "-m", "chaos", "run", "--scenarios", ",".join(HOSTILE), "--requests", "8",
                           "--concurrency", "4", "--seed", "11", "--json"], capture_output=True, text=True, timeout=400)
    report = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    rows = {s["name"]: s for s in report.get("scenarios", [])}
    assert proc.returncode == 0, json.dumps({n: r["violations"] for n, r in rows.items()}) + proc.stderr[-2000:]
    assert list(rows) == list(HOSTILE) and report["ok"] and report["violations"] == 0
    assert report["leaks"] == report["corrupted_completions"] == report["pages_leaked"] == report["silent"] == 0
    for row in rows.values():      # every victim request, without the attack and beside it, completed exactly
        assert row["ok"] and row["requests"] == row["completed"] >= 4 and row["faults_injected"] >= 1, row
        assert any(n.startswith("workers ready") for n in row["notes"]), row["notes"]
        assert set(report["hostile_ttft"][row["name"]]) == {"ttft_p99_baseline_s", "ttft_p99_attack_s", "ttft_ratio"}
    notes = {name: " ".join(row["notes"]) for name, row in rows.items()}
    refused = sum(expect == "refused" for _, _, expect, _ in REDOS)
    assert rows["redos"]["faults_injected"] >= len(REDOS) and rows["redos"]["faults_detected"] >= refused
    assert "repeats too much" in notes["redos"] and "at most 16 are allowed" in notes["redos"]
    assert "exceeded the stop-check budget" in notes["redos"]
    slow = rows["slow_reader"]
    assert slow["faults_injected"] == slow["faults_detected"] == 4
    assert "without [DONE]" in notes["slow_reader"] and "with [DONE]" not in notes["slow_reader"]
    bomb = rows["chunked_bomb"]
    assert bomb["faults_injected"] >= 3 and bomb["faults_detected"] == bomb["faults_injected"]
    assert "HTTP 413" in notes["chunked_bomb"]
    hog = rows["kv_hog"]
    assert hog["faults_injected"] == 80 and hog["faults_detected"] >= 16 and "429 tenant_limit" in notes["kv_hog"]
