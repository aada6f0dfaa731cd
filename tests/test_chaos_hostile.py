"""The chaos suite's hostile scenarios (issue 16): their parts on their own, then the four in a
small real run, as `python -m chaos run` runs them.  Only completion, exactness and the
refusals are asserted; the TTFT figures are reported, never compared with a time."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from dataclasses import replace

from chaos.attacker import Reply, _parse
from chaos.bombs import ChunkedBomb, SlowReader
from chaos.client import Outcome
from chaos.gauges import Peaks, metric, parse_metrics, percentile, server_sockets
from chaos.hostile import REDOS, KvHog, judge_redos
from chaos.oracle import judge
from chaos.prompts import APIS, ATTACKER, VICTIMS, Job
from chaos.report import ScenarioResult
from chaos.scenarios import BY_NAME
from chaos.workloads import Victims

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
    budget = Reply("x", 400, "invalid_request", "stop_regex '(?:.|.)+(?!)' exceeded the stop-check budget of "
                   "50 ms per token", ended="answered")
    assert judge_redos(budget, "budget", ()) == (True, None)
    done = Reply("x", 200, finish="length", ended="answered")
    assert judge_redos(done, "budget", ()) == (False, None) and judge_redos(done, "bounded", ()) == (True, None)
    assert judge_redos(Reply("x", ended="timeout"), "budget", ())[1] is not None     # a hang
    assert judge_redos(Reply("x", 500, "internal", "boom", ended="answered"), "bounded", ())[1] is not None
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
    class Maker:
        rng = __import__("random").Random(1)
        n = 0

        def job(self, scenario, length, max_tokens, **kw):
            self.n += 1
            return Job(self.n, scenario, "umbrella", f"canary {self.n:010x}", [1] * length, max_tokens, **kw)

        def for_api(self, job, api):
            return replace(job, api=api)
    jobs = Victims().jobs(Maker(), "kv_hog", 10, 512)     # type: ignore[arg-type]
    assert BY_NAME["kv_hog"].workload == Victims() and BY_NAME["kv_hog"].sends(9) == 18   # and again, alone
    assert ATTACKER not in {j.tenant for j in jobs} and {j.tenant for j in jobs} == set(VICTIMS)
    assert all(j.stream for j in jobs) and {j.api for j in jobs} == set(APIS)        # every API meets the attacker
    r = ScenarioResult("kv_hog", "hostile", "", outcomes=[Outcome(jobs[0], "ok", text=jobs[0].canary)],
                       other_texts=[f"... {jobs[0].canary} ..."])

    class Ref:
        def tokens(self, ids, max_tokens):
            return []
    judge([r], Ref())      # type: ignore[arg-type]
    assert r.leaks == 1 and any("the attacker was sent the canary" in v for v in r.violations)


def _bare(cls, **attrs):
    """An attack without a cluster: only what its `judge` reads."""
    attack = cls.__new__(cls)
    attack.__dict__.update(attrs)
    return attack


def test_slow_reader_flags_held_slots_unclosed_streams_and_lingering_connections():
    good = dict(running_seen=True, released_s=6.0, stalled_at_release=0, stalled=4, closed_s=20.0, peers=[0, 1, 2, 3],
                at_release={p: ("ESTABLISHED", 130_000) for p in range(4)}, after_close={})
    ends = [{"bytes": 6700, "done": False, "end": "ConnectionResetError"}] * 4

    def judged(facts, ends=ends):
        res = ScenarioResult("slow_reader", "hostile", "")
        _bare(SlowReader, idle_s=15.0, max_connections=512, facts=facts, ends=ends).judge(res, Peaks(running=4))
        return res
    res = judged(good)
    assert not res.violations and (res.faults_injected, res.faults_detected) == (4, 4)
    assert any("did not come back" in v for v in judged({**good, "released_s": None}).violations)
    assert any("did not come back" in v for v in judged({**good, "stalled_at_release": 2}).violations)
    assert any("closed 2 of 4" in v for v in judged({**good, "stalled": 2}).violations)
    done = [{"bytes": 200_000, "done": True, "end": "eof"}] * 4
    assert any("read them to [DONE]" in v for v in judged(good, done).violations)
    lingering = judged({**good, "after_close": {1: ("ESTABLISHED", 129_952)}})
    assert any("still ESTABLISHED" in v for v in lingering.violations) and lingering.faults_detected == 3


def test_chunked_bomb_flags_an_answer_other_than_413_and_a_gateway_that_holds_the_body():
    refused = {"what": "chunked, no key", "status": 413, "code": "body_too_large", "sent": 8 << 20, "message": ""}

    def judged(bombs, peak=160.0):
        res = ScenarioResult("chunked_bomb", "hostile", "")
        _bare(ChunkedBomb, limit=4 << 20, bombs=bombs, memory={"before": 145.0, "peak": peak, "after": peak,
                                                                "peak_reset": 1.0}).judge(res, Peaks())
        return res
    res = judged([refused] * 3)
    assert not res.violations and res.faults_detected == 3 and res.figures["gateway_rss_peak_mib"] == 160.0
    assert judged([{**refused, "status": 401, "code": "invalid_api_key"}]).violations
    assert judged([{**refused, "sent": ChunkedBomb.SIZE}]).violations                  # the whole body went in
    assert any("RSS grew by 200 MiB" in v for v in judged([refused], peak=345.0).violations)


def test_kv_hog_flags_a_hog_over_its_budget_or_not_held_at_all():
    replies = [Reply("hog", 429, "tenant_limit", "limit", ended="answered")] * 16 + [Reply("hog", ended="hung up")] * 64

    def judged(peaks, replies=replies):
        res = ScenarioResult("kv_hog", "hostile", "")
        _bare(KvHog, flood=80, replies=replies).judge(res, peaks)
        return res
    res = judged(Peaks(samples=5, running=16, queued=48, kv_reserved=8192, kv_budget=8192))
    assert not res.violations and (res.faults_injected, res.faults_detected, res.faults_tolerated) == (80, 64, 16)
    assert res.unaccounted == 0                                  # the 16 ran within the tenant's limits
    assert any("over its budget" in v for v in judged(Peaks(samples=5, kv_reserved=9000, kv_budget=8192)).violations)
    free = [Reply("hog", ended="hung up")] * 80
    assert any("neither queued nor refused" in v for v in judged(Peaks(samples=5, kv_budget=8192), free).violations)
    broken = [Reply("hog", 500, "internal", "x", ended="answered")] + replies[1:]
    assert any("otherwise than completed" in v for v in judged(Peaks(samples=5, queued=3), broken).violations)


def test_server_sockets_reads_the_server_side_of_a_loopback_connection():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            conn, _ = server.accept()
            peer = client.getsockname()[1]
            conn.sendall(b"x" * 1000)
            assert server_sockets(port, [peer])[peer][0] == "ESTABLISHED"
            conn.close()
        assert server_sockets(port, [peer]).get(peer, ("gone",))[0] != "ESTABLISHED"


def test_a_bomb_measures_what_a_server_that_reads_it_all_took():
    """Against a server that reads the whole body before answering 401 (the gateway before
    issue 16), the bomb records it all sent and its row flags the answer."""
    async def run():
        async def naive(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
            writer.close()
        server = await asyncio.start_server(naive, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        bomb = _bare(ChunkedBomb, url=url, limit=1 << 20, SIZE=2 << 20)
        try:
            return await asyncio.wait_for(bomb._bomb(None, chunked=False), 60), bomb
        finally:
            server.close()
    out, bomb = asyncio.run(run())
    assert out["status"] == 401 and out["sent"] == 2 << 20
    res = ScenarioResult("chunked_bomb", "hostile", "")
    bomb.bombs, bomb.memory = [{"what": "announced", **out}], {}
    bomb.judge(res, Peaks())
    assert res.faults_detected == 0 and any("HTTP 401" in v for v in res.violations)


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
    # the per-token budget, or on a slower moment the mean one, ended a catastrophic pattern
    assert "exceeded the stop-check budget" in notes["redos"] or "per token on average" in notes["redos"]
    slow = rows["slow_reader"]
    assert slow["faults_injected"] == slow["faults_detected"] == 4
    assert "without [DONE]" in notes["slow_reader"] and "with [DONE]" not in notes["slow_reader"]
    bomb = rows["chunked_bomb"]
    assert bomb["faults_injected"] >= 3 and bomb["faults_detected"] == bomb["faults_injected"]
    assert "HTTP 413" in notes["chunked_bomb"]
    hog = rows["kv_hog"]
    assert hog["faults_injected"] == 80 and hog["faults_detected"] >= 16 and "429 tenant_limit" in notes["kv_hog"]
