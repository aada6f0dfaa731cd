"""The official `openai` client against a running gateway with real prefill and decode
workers on loopback: chat, completion, streaming, stop, logprobs, usage, n, and the
endpoints and error shapes around them."""

from __future__ import annotations

import json

import openai
import pytest

from engine.params import SamplingParams
from tests.gateway_helpers import API_KEY, gateway_cluster, get, post
from tests.workers import config

CHAT = [{"role": "user", "content": "Please repeat: paged experts keep the hot experts resident"}]


@pytest.fixture(scope="module")
def cluster():
    with gateway_cluster(config(), config()) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster[0].url + "/v1", api_key=API_KEY, max_retries=0)


def chat_ids(llm):
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(CHAT))


def test_chat_equals_the_engine_with_usage(client, shipped_llm):
    r = client.chat.completions.create(model="tiny-moe", messages=CHAT, max_tokens=24, temperature=0)
    want = shipped_llm.generate([chat_ids(shipped_llm)], SamplingParams(max_tokens=24, temperature=0))[0]
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(chat_ids(shipped_llm))        # counted after the template
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_chat_adds_up_to_the_same_text(client):
    full = client.chat.completions.create(model="tiny-moe", messages=CHAT, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny-moe", messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_continuous_usage_stats_puts_usage_in_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats (sent by guidellm and aiperf): each chunk
    carries the usage so far; without it only the last chunk does."""
    full = client.chat.completions.create(model="tiny-moe", messages=CHAT, max_tokens=24, temperature=0)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.chat.completions.create(model="tiny-moe", messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True, stream_options=opts))
    assert all(c.usage is not None for c in chunks)
    assert all(c.usage.prompt_tokens == full.usage.prompt_tokens for c in chunks)
    so_far = [c.usage.completion_tokens for c in chunks]
    assert so_far == sorted(so_far) and so_far[0] <= 1
    assert chunks[-2].usage == chunks[-1].usage      # the last content chunk, then usage alone
    last, whole = chunks[-1].usage, full.usage           # (a later time more of the prompt may be cached)
    assert (last.prompt_tokens, last.completion_tokens) == (whole.prompt_tokens, whole.completion_tokens)
    assert 0 <= whole.prompt_tokens_details.cached_tokens <= last.prompt_tokens_details.cached_tokens
    assert last.prompt_tokens_details.cached_tokens < last.prompt_tokens
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    plain = list(client.chat.completions.create(model="tiny-moe", messages=CHAT, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_completion_and_stream_and_stop(client, shipped_llm):
    prompt = "def add(a, b):\n    return"
    want = shipped_llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    r = client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == want.text and r.usage.prompt_tokens == len(shipped_llm.tokenizer.encode(prompt))
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny-moe", prompt=prompt, max_tokens=12, temperature=0, stream=True) if c.choices)
    assert streamed == want.text
    stop = want.text[3:6]
    r = client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == want.text[:want.text.find(stop)] and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["matched_stop"] == stop


def test_return_token_ids_in_the_response_and_the_stream(client, shipped_llm):
    ids = shipped_llm.tokenizer.encode("def add(a, b):\n    return")
    want = shipped_llm.generate([ids], SamplingParams(max_tokens=10, temperature=0))[0]
    r = client.completions.create(model="tiny-moe", prompt=ids, max_tokens=10, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == want.token_ids
    chunks = client.completions.create(model="tiny-moe", prompt=ids, max_tokens=10, temperature=0, stream=True,
                                       extra_body={"return_token_ids": True})
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]] == want.token_ids
    plain = client.completions.create(model="tiny-moe", prompt=ids, max_tokens=10, temperature=0)
    assert "token_ids" not in plain.choices[0].model_extra                 # only when asked


def test_logprobs_in_both_shapes(client):
    r = client.chat.completions.create(model="tiny-moe", messages=CHAT, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob for t in content)
    assert all(t.logprob == max(x.logprob for x in t.top_logprobs) for t in content)   # greedy picks the top
    c = client.completions.create(model="tiny-moe", prompt="x = [i * i for i in", max_tokens=5, temperature=0,
                                  logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == c.choices[0].text and all(len(t) == 2 for t in lp.top_logprobs)


def test_n_choices_with_a_seed(client):
    r = client.chat.completions.create(model="tiny-moe", messages=CHAT, max_tokens=8, temperature=1.0,
                                       seed=7, n=3)
    again = client.chat.completions.create(model="tiny-moe", messages=CHAT, max_tokens=8, temperature=1.0,
                                           seed=7, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [c.message.content for c in again.choices]
    assert r.usage.prompt_tokens == again.usage.prompt_tokens               # counted once for n choices


def test_models_health_metrics_server_info(cluster, client):
    gw, decode, _ = cluster
    assert [m.id for m in client.models.list().data] == ["tiny-moe"]
    assert get(gw.url, "/health", key=None)[0] == 200
    status, text = get(gw.url, "/metrics", key=None)
    assert status == 200 and "tandem_requests_total" in text and "tandem_worker_kv_capacity_tokens" in text
    assert "tandem_time_to_first_token_seconds_bucket" in text
    status, info = get(gw.url, "/v1/server_info")
    info = json.loads(info)
    assert info["context_length"] == 2048
    assert {w["role"]: w["kv_capacity_tokens"] for w in info["workers"]}["decode"] == 8192


@pytest.mark.parametrize("body, key, status, code", [
    ({"model": "tiny-moe", "messages": CHAT}, None, 401, "invalid_api_key"),
    ({"model": "tiny-moe", "messages": CHAT}, "sk-wrong", 401, "invalid_api_key"),
    ({"model": "gpt-4", "messages": CHAT}, API_KEY, 404, "model_not_found"),
    ({"model": "tiny-moe"}, API_KEY, 400, "schema"),
    ({"model": "tiny-moe", "messages": CHAT, "temperature": "hot"}, API_KEY, 400, "schema"),
    ({"model": "tiny-moe", "messages": CHAT, "presence_penalty": 1.0}, API_KEY, 400, "unsupported"),
    ({"model": "tiny-moe", "messages": CHAT, "n": 9}, API_KEY, 400, "too_many_choices"),
    ({"model": "tiny-moe", "messages": CHAT, "min_tokens": 9, "max_tokens": 3}, API_KEY, 400, "invalid_request"),
    ({"model": "tiny-moe", "messages": CHAT, "stop_regex": "("}, API_KEY, 400, "invalid_request"),
])
def test_errors_have_the_openai_shape(cluster, body, key, status, code):
    got_status, got = post(cluster[0].url, "/v1/chat/completions", body, key=key)
    assert got_status == status, got
    assert got["error"]["code"] == code and got["error"]["message"]


def test_a_body_too_large_is_413(cluster):
    status, got = post(cluster[0].url, "/v1/completions", None, raw=b"{" + b" " * (5 << 20) + b"}")
    assert status == 413 and got["error"]["code"] == "body_too_large"
