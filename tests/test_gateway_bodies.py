"""What a client meets first (issue 41, item 8): a body that is not a JSON object sent as
application/json is a 400 saying so (curl -d sends a form's Content-Type), invalid JSON names
its position in words, integer and boolean fields take no strings or other types, the openai
client's `models.retrieve` works, and a long client-supplied name is cut in the message."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from urllib.parse import urlparse

import openai
import pytest

from gateway.body_errors import EXPECTED
from tests.gateway_helpers import API_KEY, FakeWorker, fake_cluster

CHAT = [{"role": "user", "content": "hi"}]
BODY = json.dumps({"model": "tiny-moe", "messages": CHAT, "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[object, FakeWorker]]:
    with fake_cluster() as c:
        yield c


def send(gw, body: bytes, headers: dict[str, str], path: str = "/v1/chat/completions") -> tuple[int, dict]:
    u = urlparse(gw.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {API_KEY}", **headers})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def chat(gw, **fields) -> tuple[int, dict]:
    body = {"model": "tiny-moe", "messages": CHAT, "max_tokens": 2, **fields}
    return send(gw, json.dumps(body).encode(), {"Content-Type": "application/json"})


@pytest.mark.parametrize("body, headers, says", [
    (BODY, {}, "no Content-Type"),
    (BODY, {"Content-Type": "application/x-www-form-urlencoded"}, "'application/x-www-form-urlencoded'"),
    (BODY, {"Content-Type": "text/plain"}, "'text/plain'"),
    (b"", {"Content-Type": "application/json"}, "no body"),
    (b"[1, 2]", {"Content-Type": "application/json"}, "an array"),
    (b'"hi"', {"Content-Type": "application/json"}, "a string"),
])
def test_a_body_that_is_not_a_json_object_sent_as_json_is_a_400_saying_so(cluster, body, headers, says):
    """Before: 422 ": Input should be a valid dictionary or object to extract fields from"."""
    status, got = send(cluster[0], body, headers)
    assert status == 400, got
    error = got["error"]
    assert error["code"] == "invalid_body" and error["param"] is None
    assert error["message"].startswith(EXPECTED) and says in error["message"], error
    assert "Content-Type: application/json" in EXPECTED


def test_the_same_body_with_its_content_type_is_served(cluster):
    status, got = send(cluster[0], BODY, {"Content-Type": "application/json; charset=utf-8"})
    assert status == 200 and got["choices"][0]["message"]["content"] == "AB", got


@pytest.mark.parametrize("raw, where", [
    (b'{"model": x}', "line 1, column 11 (character 10)"),
    (b'{"model": "tiny-moe",\n "messages": [,]}', "line 2, column 15 (character 36)"),
    (b'{"model": "tiny-moe"', "line 1, column 21 (character 20)"),
])
def test_invalid_json_names_the_position_in_words(cluster, raw, where):
    """Before: "9: JSON decode error" with param "9"."""
    status, got = send(cluster[0], raw, {"Content-Type": "application/json"})
    assert status == 400, got
    error = got["error"]
    assert error["code"] == "invalid_json" and error["param"] is None
    assert error["message"].startswith(f"invalid JSON at {where}: "), error


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "10"), ("max_tokens", True), ("max_tokens", 10.0), ("n", "1"), ("n", True), ("seed", "7"),
    ("top_k", "5"), ("min_tokens", False), ("max_completion_tokens", "10"), ("top_logprobs", "2"),
    ("stream", "false"), ("stream", 0), ("logprobs", 1), ("ignore_eos", "true"), ("temperature", "0.5"),
    ("temperature", True), ("stop_token_ids", ["3"]),
])
def test_integer_boolean_and_number_fields_are_strict(cluster, field, value):
    """Before: "10" and true were taken as 10 and 1 (and "false" as false)."""
    gw, decode = cluster
    before = len(decode.generated)
    status, got = chat(gw, **{field: value})
    assert status == 400, got
    error = got["error"]
    assert error["code"] == "schema" and error["param"].split("[")[0] == field and field in error["message"], error
    assert "got a" in error["message"] or "got an" in error["message"] or "got null" in error["message"]
    assert len(decode.generated) == before


def test_a_prompt_of_numbers_or_booleans_is_not_token_ids(cluster):
    gw, decode = cluster
    for prompt in ([1.0, 2.0], [True, 5]):
        status, got = send(gw, json.dumps({"model": "tiny-moe", "prompt": prompt}).encode(),
                           {"Content-Type": "application/json"}, "/v1/completions")
        assert status == 400 and got["error"]["param"] == "prompt", got
        assert "list[int]" in got["error"]["message"] and "prompt[0] is a" in got["error"]["message"], got
    status, got = send(gw, json.dumps({"model": "tiny-moe", "prompt": [5, 6], "max_tokens": 2}).encode(),
                       {"Content-Type": "application/json"}, "/v1/completions")
    assert status == 200, got
    assert numbers_are_still_numbers(cluster)


def numbers_are_still_numbers(cluster) -> bool:
    """An integer is a number: temperature 0 and top_p 1 are taken."""
    return chat(cluster[0], temperature=0, top_p=1)[0] == 200


def test_models_retrieve(cluster):
    client = openai.OpenAI(base_url=cluster[0].url + "/v1", api_key=API_KEY, max_retries=0)
    model = client.models.retrieve("tiny-moe")
    assert (model.id, model.object, model.owned_by) == ("tiny-moe", "model", "tandem")
    assert model.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("org/other-model")
    assert e.value.code == "model_not_found" and "'org/other-model'" in e.value.message
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=cluster[0].url + "/v1", api_key="sk-wrong", max_retries=0).models.retrieve("tiny-moe")


def test_a_long_model_name_is_cut_in_the_404(cluster):
    """Before: a 100,000-character model was echoed whole."""
    status, got = send(cluster[0], json.dumps({"model": "m" * 100_000, "messages": CHAT}).encode(),
                       {"Content-Type": "application/json"})
    assert status == 404 and got["error"]["code"] == "model_not_found"
    message = got["error"]["message"]
    assert len(message) < 300 and "'" + "m" * 64 + "'... (100000 characters)" in message, message
    client = openai.OpenAI(base_url=cluster[0].url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("x" * 5000)
    assert len(e.value.message) < 300 and "(5000 characters)" in e.value.message


def test_a_long_key_in_a_fields_path_is_cut(cluster):
    status, got = chat(cluster[0], logit_bias={"k" * 10_000: "high"})
    assert status == 400 and got["error"]["code"] == "schema", got
    assert len(got["error"]["message"]) < 300 and "(10000 characters)" in got["error"]["message"], got
