"""/tokenize and /detokenize (gateway/tokenize.py): the count equals the usage a completion of
the same prompt or messages reports, and the ids are the ones the decode worker is sent
(scripted workers, gateway_helpers.fake_cluster); a round trip; auth, bounds and refusals; and
both endpoints answering while no worker is ready."""

from __future__ import annotations

import json

import pytest

from engine.config import SHIPPED_MODEL, ModelConfig
from engine.tokenizer import Tokenizer
from gateway.fields import IGNORED_HEADER
from tests.gateway_helpers import API_KEY, connection, fake_cluster, post, start_gateway

MESSAGES = [{"role": "system", "content": "You copy text."},
            {"role": "user", "content": "Please repeat: paged experts keep the hot experts resident"}]
PROMPT = "class Version:\n    def __lt__(self, other):\n        if not isinstance(other,"


@pytest.fixture(scope="module")
def cluster():
    with fake_cluster() as c:
        yield c


@pytest.fixture(scope="module")
def idle():
    """A gateway whose only worker address answers nothing: never ready."""
    gw = start_gateway(["127.0.0.1:9"], ["127.0.0.1:9"], max_messages=4, max_body_bytes=8192)
    yield gw
    gw.stop()


def sent_ids(decode) -> list[int]:
    return list(decode.generated[-1].prompt_token_ids)


def test_a_prompt_counts_as_a_completion_of_it(cluster):
    gw, decode = cluster
    status, tok = post(gw.url, "/tokenize", {"model": "tiny-moe", "prompt": PROMPT})
    assert status == 200 and set(tok) == {"count", "max_model_len", "tokens", "token_strs"}
    status, done = post(gw.url, "/v1/completions", {"model": "tiny-moe", "prompt": PROMPT, "max_tokens": 2})
    assert status == 200 and done["usage"]["prompt_tokens"] == tok["count"] == len(tok["tokens"])
    assert sent_ids(decode) == tok["tokens"]
    assert tok["max_model_len"] == 2048 and tok["token_strs"] is None     # the workers' context


TOOLS = [{"type": "function", "function": {"name": "repeat", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("extra", [{"chat_template_kwargs": {"enable_thinking": False}}, {"tools": TOOLS},
                                   {"tools": TOOLS, "tool_choice": "none"}])
def test_messages_count_as_a_chat_completion_of_them(cluster, extra):
    gw, decode = cluster
    body = {"messages": MESSAGES, **extra}
    status, tok = post(gw.url, "/tokenize", body)                         # model may be left out
    assert status == 200, tok
    status, done = post(gw.url, "/v1/chat/completions", {"model": "tiny-moe", **body, "max_tokens": 2})
    assert status == 200 and done["usage"]["prompt_tokens"] == tok["count"]
    assert sent_ids(decode) == tok["tokens"]
    if "tools" in extra:          # the tools are rendered unless tool_choice is none, as chat does
        bare = post(gw.url, "/tokenize", {"messages": MESSAGES})[1]["count"]
        assert (tok["count"] == bare) == (extra.get("tool_choice") == "none")
    else:
        text = Tokenizer(SHIPPED_MODEL).apply_chat_template(MESSAGES)
        plain = post(gw.url, "/tokenize", {"prompt": text})[1]
        assert plain["count"] > tok["count"]   # the template's own tokens are control ids, read as text there


def test_a_round_trip_gives_back_the_text(cluster):
    gw, _ = cluster
    tok = post(gw.url, "/tokenize", {"prompt": PROMPT, "return_token_strs": True})[1]
    assert tok["token_strs"][-1] == "," and len(tok["token_strs"]) == tok["count"]
    assert post(gw.url, "/detokenize", {"model": "tiny-moe", "tokens": tok["tokens"]}) == (200, {"prompt": PROMPT})
    chat = post(gw.url, "/tokenize", {"messages": MESSAGES})[1]
    status, text = post(gw.url, "/detokenize", {"tokens": chat["tokens"]})
    assert status == 200 and text["prompt"] == Tokenizer(SHIPPED_MODEL).apply_chat_template(MESSAGES)
    assert post(gw.url, "/detokenize", {"tokens": []}) == (200, {"prompt": ""})


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})])
def test_both_need_an_api_key(cluster, path, body):
    gw, _ = cluster
    for key in (None, "sk-wrong"):
        status, err = post(gw.url, path, body, key=key)
        assert status == 401 and err["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("tokens, message", [
    ([5, 4096], "tokens[1]=4096 is not a token of this model's vocabulary (0..4095)"),
    ([-1], "tokens[0]=-1 is not a token"),
    ([7] * 2049, "the request has 2049 tokens; at most 2048 (this model's context length) are allowed"),
])
def test_detokenize_refuses_ids_out_of_bounds(cluster, tokens, message):
    status, err = post(cluster[0].url, "/detokenize", {"tokens": tokens})
    assert status == 400 and err["error"]["param"] == "tokens" and message in err["error"]["message"]


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": "x", "messages": MESSAGES}, "prompt", "not both"),
    ({}, "prompt", "not neither"),
    ({"prompt": "x", "tools": []}, "tools", "tools goes with messages"),
    ({"messages": MESSAGES, "add_generation_prompt": False}, "add_generation_prompt", "is not supported"),
    ({"messages": MESSAGES, "chat_template": "{{ x }}"}, "chat_template", "the checkpoint's template is used"),
    ({"prompt": ["x"]}, "prompt", ""),
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": MESSAGES, "reasoning_effort": "max"}, "reasoning_effort", "is not one of"),
    ({"messages": [{"role": "user", "content": "a"}] * 5}, "messages", "5 messages; at most 4 are allowed"),
])
def test_a_bad_request_is_refused_naming_the_field(idle, body, param, message):
    status, err = post(idle.url, "/tokenize", body)
    assert status == 400 and err["error"]["param"] == param and message in err["error"]["message"], err


def test_another_model_an_unknown_field_and_neutral_values(cluster):
    gw, _ = cluster
    status, err = post(gw.url, "/tokenize", {"model": "gpt-4", "prompt": "x"})
    assert status == 404 and err["error"]["code"] == "model_not_found"
    conn = connection(gw.url)
    body = {"prompt": "x", "add_special_tokens": True, "add_generation_prompt": True, "colour": "red"}
    conn.request("POST", "/tokenize", json.dumps(body), {"Authorization": f"Bearer {API_KEY}",
                                                         "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader(IGNORED_HEADER) == "colour"
    assert json.loads(resp.read())["count"] == 1      # this tokenizer adds no special token: true changes nothing
    conn.close()


def test_both_answer_while_no_worker_is_ready(idle):
    assert post(idle.url, "/v1/completions", {"model": "tiny-moe", "prompt": "x"})[0] == 503
    status, tok = post(idle.url, "/tokenize", {"prompt": PROMPT})
    assert status == 200 and tok["max_model_len"] == ModelConfig.from_path(SHIPPED_MODEL).max_position_embeddings
    assert post(idle.url, "/detokenize", {"tokens": tok["tokens"]}) == (200, {"prompt": PROMPT})


def test_the_body_limit_holds(idle):
    status, err = post(idle.url, "/tokenize", {"prompt": "x" * 9000})
    assert status == 413, err
