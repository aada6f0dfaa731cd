"""Prompt logprobs across the split: /v1/completions' echo (with and without logprobs, with
max_tokens 0), vLLM's prompt_logprobs and logit_bias through a gateway in front of a prefill and
a decode worker, and in front of a colocated worker.  The prompt's logprobs equal the
single-process engine's within 1e-5 (computed on the prefill side, never by the decode worker)."""

from __future__ import annotations

import json

import pytest

from engine.params import MAX_PROMPT_LOGPROB_ENTRIES, SamplingParams
from tests.gateway_helpers import colocated_gateway, gateway_cluster, post
from tests.workers import config

PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"
EXACT = 1e-5


@pytest.fixture(scope="module", params=["split", "colocated"])
def gateway(request):
    if request.param == "split":      # the prefill worker prefills in chunks of 16 tokens
        with gateway_cluster(config(), config(max_prefill_tokens=16)) as (gw, _, _):
            yield gw
        return
    with colocated_gateway(config()) as (gw, _):
        yield gw


def complete(gw, **body):
    status, got = post(gw.url, "/v1/completions", {"model": "tiny-moe", "prompt": PROMPT, "temperature": 0, **body})
    assert status == 200, got
    return got


def reference(llm, max_tokens, n):
    return llm.generate(PROMPT, SamplingParams(max_tokens=max(max_tokens, 1), temperature=0, logprobs=n,
                                               prompt_logprobs=n))[0]


def test_echo_with_logprobs_equals_the_engine(gateway, shipped_llm):
    ref = reference(shipped_llm, 6, 2)
    got = complete(gateway, max_tokens=6, echo=True, logprobs=2)
    choice = got["choices"][0]
    assert choice["text"] == PROMPT + ref.text
    lp = choice["logprobs"]
    n = len(ref.prompt_token_ids)
    assert len(lp["tokens"]) == n + len(ref.token_ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for want, have, top in zip(ref.prompt_logprobs, lp["token_logprobs"][1:n], lp["top_logprobs"][1:n]):
        assert abs(want.logprob - have) <= EXACT
        assert len(top) == 2 and max(top.values()) >= have - EXACT
    assert lp["text_offset"][0] == 0 and lp["text_offset"][n] == len(PROMPT)
    assert got["usage"]["prompt_tokens"] == n and got["usage"]["completion_tokens"] == len(ref.token_ids)


def test_max_tokens_0_echoes_the_prompt_only(gateway, shipped_llm):
    ref = reference(shipped_llm, 0, 1)
    got = complete(gateway, max_tokens=0, echo=True, logprobs=1)
    choice = got["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == 0
    lps = choice["logprobs"]["token_logprobs"]
    assert len(lps) == len(ref.prompt_token_ids)
    assert all(abs(a.logprob - b) <= EXACT for a, b in zip(ref.prompt_logprobs, lps[1:]))
    plain = complete(gateway, max_tokens=0, echo=True)["choices"][0]        # echo alone
    assert plain["text"] == PROMPT and plain["logprobs"] is None
    metrics = gateway.app.state.gateway.metrics.render().decode()
    assert "tandem_prompt_logprob_entries_total" in metrics and "tandem_prompt_logprob_entries_total 0.0" not in metrics


def test_vllm_prompt_logprobs_and_a_stream(gateway, shipped_llm):
    ref = reference(shipped_llm, 4, 3)
    got = complete(gateway, max_tokens=4, prompt_logprobs=3)["choices"][0]
    assert got["text"] == ref.text and got["prompt_logprobs"][0] is None
    for want, entry in zip(ref.prompt_logprobs, got["prompt_logprobs"][1:]):
        own = entry[str(want.token)]
        assert abs(own["logprob"] - want.logprob) <= EXACT and own["rank"] == want.rank
        assert sorted(int(k) for k in entry if entry[k]["rank"] <= 3) == sorted(t for t, _ in want.top)
    status, events = post(gateway.url, "/v1/completions", {"model": "tiny-moe", "prompt": PROMPT, "temperature": 0,
                                                           "max_tokens": 4, "echo": True, "logprobs": 0,
                                                           "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT + ref.text
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None and len(first["tokens"]) >= len(ref.prompt_token_ids)


def test_logit_bias_on_the_first_token_and_after(gateway):
    got = complete(gateway, max_tokens=3, logit_bias={"77": 100}, return_token_ids=True)["choices"][0]
    assert got["token_ids"] == [77, 77, 77]       # prefill's first token and the decode worker's


@pytest.mark.parametrize("body,field", [
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"), ({"max_tokens": 0}, "max_tokens=0"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": [5] * (MAX_PROMPT_LOGPROB_ENTRIES // 6 + 1), "echo": True, "logprobs": 5, "max_tokens": 0},
     "prompt logprobs"),
])
def test_bad_requests_are_refused_before_any_worker(gateway, body, field):
    status, got = post(gateway.url, "/v1/completions", {"model": "tiny-moe", "prompt": PROMPT, **body})
    assert status == 400 and field in got["error"]["message"], got


def test_chat_refuses_echo_and_prompt_logprobs(gateway):
    for extra in ({"echo": True}, {"prompt_logprobs": 1}):
        status, got = post(gateway.url, "/v1/chat/completions", {"model": "tiny-moe", "max_tokens": 2,
                                                                 "messages": [{"role": "user", "content": "hi"}],
                                                                 **extra})
        assert status == 400 and "/v1/completions only" in got["error"]["message"], got


def test_a_migrated_choice_does_not_ask_for_the_prompt_logprobs_again():
    from gateway.choice import Choice
    from proto import worker_pb2 as wpb
    c = Choice(0, [5, 6, 7], SamplingParams(max_tokens=4, prompt_logprobs=2))
    assert c.awaits_prompt_logprobs and c.attempt_params().prompt_logprobs == 2
    c.keep_prompt_logprobs(wpb.PromptLogprobs(logprobs=[wpb.PromptLogprob(token_id=6), wpb.PromptLogprob(token_id=7)]))
    assert not c.awaits_prompt_logprobs and c.attempt_params().prompt_logprobs is None
    c.keep_prompt_logprobs(wpb.PromptLogprobs())              # a later attempt's: the first ones stay
    assert [e.token_id for e in c.prompt_logprobs or []] == [6, 7]
