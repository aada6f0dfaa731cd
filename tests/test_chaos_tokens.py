"""The chaos suite's control_tokens row (issue 41): its requests, its judgement, and the row
against a gateway, as `python -m chaos run` runs it.  Only completion, exactness and the prompt
lengths are asserted; the TTFT figures are reported, never compared with a time."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from chaos.scenarios import BY_NAME
from chaos.tokens import Answer, ControlTokenInjection, Injection, injections, judge_answer, send
from chaos.workloads import Victims
from engine.config import SHIPPED_MODEL
from engine.tokenizer import Tokenizer
from tests.gateway_helpers import API_KEY, fake_cluster

TOK = Tokenizer(SHIPPED_MODEL)
INJ = Injection("chat user", "/v1/chat/completions", {}, as_text=40, forged=20)


def test_every_injection_carries_every_special_token_and_can_be_told_apart():
    got = injections(TOK, "tiny-moe")
    assert {i.what for i in got} == {"chat system", "chat user", "chat assistant", "chat tool", "chat parts",
                                     "responses instructions and input", "messages system and user",
                                     "completion prompt"}
    assert {i.path for i in got} == {"/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions"}
    for inj in got:
        body = json.dumps(inj.body)
        assert all(json.dumps(a.content)[1:-1] in body for a in TOK.backend.get_added_tokens_decoder().values())
        assert inj.forged < inj.as_text
    row = BY_NAME["control_tokens"]
    assert row.group == "hostile" and row.workload == Victims() and row.attack is ControlTokenInjection


def test_the_judge_accepts_only_text_counts_and_named_refusals():
    assert judge_answer(Answer(INJ, 200, 40, ended="answered")) == (True, None)
    assert judge_answer(Answer(INJ, 400, None, "the control token text '<|im_end|>' ...", ended="answered")) == (
        True, None)
    forged = judge_answer(Answer(INJ, 200, 20, ended="answered"))
    assert forged[0] is False and "read as control ids" in (forged[1] or "")
    assert judge_answer(Answer(INJ, 200, 33, ended="answered"))[1] is not None
    assert judge_answer(Answer(INJ, 500, None, "internal error", ended="answered"))[1] is not None
    assert judge_answer(Answer(INJ, ended="timeout"))[1] is not None


@pytest.fixture(scope="module")
def cluster():
    with fake_cluster() as c:
        yield c


def _answers(url: str) -> list[Answer]:
    async def all_of() -> list[Answer]:
        return list(await asyncio.gather(*(send(url, API_KEY, i, 30) for i in injections(TOK, "tiny-moe"))))
    return asyncio.run(all_of())


def test_the_gateway_passes_and_a_forging_one_is_caught(cluster):
    gw, _ = cluster
    for a in _answers(gw.url):
        assert judge_answer(a) == (True, None), (a.injection.what, a.status, a.prompt_tokens, a.message)
    encoder = gw.app.state.gateway.encoder      # the gateway as it was: rendered text read whole
    honest_chat, honest_plain = encoder.encode_chat, encoder.encode_plain
    encoder.encode_chat, encoder.encode_plain = (lambda r: encoder.encode(r.text)), encoder.encode
    try:
        judged = [judge_answer(a) for a in _answers(gw.url)]
    finally:
        encoder.encode_chat, encoder.encode_plain = honest_chat, honest_plain
    assert all(not ok and "read as control ids" in (why or "") for ok, why in judged), judged


def test_the_control_tokens_row_in_a_small_run():
    proc = subprocess.run([sys.executable, "-m", "chaos", "run", "--scenarios", "control_tokens", "--requests", "4",
                           "--concurrency", "4", "--seed", "11", "--json"], capture_output=True, text=True, timeout=400)
    report = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    rows = {s["name"]: s for s in report.get("scenarios", [])}
    assert proc.returncode == 0, json.dumps({n: r["violations"] for n, r in rows.items()}) + proc.stderr[-2000:]
    row = rows["control_tokens"]
    assert report["ok"] and report["violations"] == 0 and report["leaks"] == report["corrupted_completions"] == 0
    assert row["ok"] and row["requests"] == row["completed"] >= 4        # the victims, without and beside it
    assert row["faults_injected"] >= 6 and row["faults_detected"] == row["faults_injected"], row
    assert set(report["hostile_ttft"]["control_tokens"]) == {"ttft_p99_baseline_s", "ttft_p99_attack_s", "ttft_ratio"}
