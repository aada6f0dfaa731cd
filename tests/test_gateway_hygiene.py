"""Answers that say only what the client needs: integers out of range are a 400 naming the
field (never a 500, never a traceback in the log); an internal error is a coded 500 with an
id, its details only in the log; no error body carries a worker address, a path, a gRPC
status or another request's id; /health does not show the model's path; /metrics and
/v1/server_info can be put behind admin keys."""

from __future__ import annotations

import json
import logging

import pytest

import gateway.completions
from engine.config import SHIPPED_MODEL
from engine.errors import ErrorCode
from gateway.errors import ForwardError
from proto import worker_pb2 as wpb
from tests.gateway_helpers import API_KEY, gateway_cluster, get, post, start_gateway, wait_ready
from tests.workers import config

CHAT = [{"role": "user", "content": "hello"}]
LEAKS = ("127.0.0.1", "localhost", str(SHIPPED_MODEL), "/work", "Traceback", "grpc", "StatusCode", "File \"")


@pytest.fixture(scope="module")
def cluster():
    with gateway_cluster(config(max_model_len=512), config()) as c:
        yield c


def assert_clean(body, *addresses: str) -> None:
    """No worker address, path, traceback or gRPC detail anywhere in a response body."""
    text = body if isinstance(body, str) else json.dumps(body)
    for leak in LEAKS + addresses:
        assert leak not in text, (leak, text)


def no_tracebacks(caplog) -> None:
    logged = [r for r in caplog.records if r.name.startswith("tandem") and r.exc_info]
    assert not logged, [r.getMessage() for r in logged]


@pytest.mark.parametrize("chat, extra, field", [
    (True, {"top_k": 2**40}, "top_k"),
    (False, {"top_k": -2}, "top_k"),
    (False, {"stop_token_ids": [2**33]}, "stop_token_ids"),
    (True, {"stop_token_ids": [5, -1]}, "stop_token_ids"),
    (False, {"stop_token_ids": [4096]}, "stop_token_ids"),        # one past the vocabulary
    (False, {"n": 0}, "n"),
    (True, {"n": -3}, "n"),
    (False, {"max_tokens": -1}, "max_tokens"),         # 0 is the prompt alone (echo): tests/test_gateway_echo.py
    (False, {"max_tokens": 2**40}, "max_tokens"),
    (True, {"max_completion_tokens": 0}, "max_completion_tokens"),
    (False, {"seed": -1}, "seed"),
    (True, {"seed": 2**64}, "seed"),
    (False, {"logprobs": 6}, "logprobs"),
    (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (False, {"min_tokens": -1}, "min_tokens"),
    (False, {"min_tokens": 2**40}, "min_tokens"),
])
def test_integers_out_of_range_are_a_400_naming_the_field(cluster, caplog, chat, extra, field):
    caplog.set_level(logging.INFO)
    body = {"model": "tiny-moe", **({"messages": CHAT} if chat else {"prompt": "x = "}), "max_tokens": 4, **extra}
    status, got = post(cluster[0].url, "/v1/chat/completions" if chat else "/v1/completions", body)
    assert status == 400, got
    assert got["error"]["param"] == field and field in got["error"]["message"], got
    assert got["error"]["code"] == "out_of_range"
    assert_clean(got)
    no_tracebacks(caplog)


def test_too_many_messages_or_prompts_are_refused_before_any_is_tokenized(cluster, monkeypatch):
    gw = cluster[0]
    calls = []
    encoder = gw.app.state.gateway.encoder
    monkeypatch.setattr(encoder, "encode", lambda *a, **k: calls.append(a) or [1])
    status, got = post(gw.url, "/v1/chat/completions", {"model": "tiny-moe", "messages": CHAT * 1025})
    assert status == 400 and got["error"]["param"] == "messages" and "at most 1024" in got["error"]["message"], got
    status, got = post(gw.url, "/v1/completions", {"model": "tiny-moe", "prompt": ["x"] * 20000})
    assert status == 400 and got["error"]["code"] == "too_many_choices" and "limit of 8" in got["error"]["message"]
    assert not calls


@pytest.mark.parametrize("path, body, key, status", [
    ("/v1/chat/completions", {"model": "tiny-moe", "messages": CHAT}, None, 401),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": CHAT}, API_KEY, 404),
    ("/v1/chat/completions", {"model": "tiny-moe"}, API_KEY, 400),
    ("/v1/completions", {"model": "tiny-moe", "prompt": "x", "stop_regex": "("}, API_KEY, 400),
    ("/v1/completions", {"model": "tiny-moe", "prompt": [99999]}, API_KEY, 400),
    ("/v1/completions", {"model": "tiny-moe", "prompt": "x " * 5000}, API_KEY, 400),
    ("/v1/nothing", {}, API_KEY, 404),
])
def test_client_errors_are_openai_shaped_and_clean(cluster, caplog, path, body, key, status):
    gw, decode, prefill = cluster
    got_status, got = post(gw.url, path, body, key=key)
    assert got_status == status, got
    assert got["error"]["message"] and got["error"]["code"]
    assert_clean(got, decode.address, prefill.address)
    no_tracebacks(caplog)


def test_an_internal_error_is_a_coded_500_with_an_id_and_the_details_only_in_the_log(cluster, caplog):
    gw = cluster[0]
    handler = gw.app.state.gateway.completions

    def broken(body):
        raise RuntimeError("boom at 10.1.2.3:50051 reading /secret/path")

    handler.check = broken
    try:
        status, got = post(gw.url, "/v1/completions", {"model": "tiny-moe", "prompt": "x = "})
    finally:
        del handler.check
    assert status == 500 and got["error"]["code"] == "internal", got
    assert "10.1.2.3" not in json.dumps(got) and "/secret" not in json.dumps(got)
    error_id = got["error"]["message"].split("error id ")[1].rstrip(")")
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged and logged[0].exc_info and "10.1.2.3" in str(logged[0].exc_info[1])


def failing_forward(tokens_first: bool, error: Exception):
    """A stand-in for gateway.forward.forward: maybe one token (recorded in the choice, as the
    attempts do), then `error`."""
    async def forward(choice, route):
        if tokens_first:
            tokens = wpb.Tokens(text="a", token_ids=[64])
            choice.add(tokens)
            yield tokens
        raise error
    return forward


DETAILED = ForwardError(ErrorCode.DECODE_FAILED, "10.9.8.7:50052: UNAVAILABLE failed to connect; "
                                                 "transfer of request cmpl-someone-else.1 broke")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("error", [DETAILED, RuntimeError("bug near 10.9.8.7:50052 cmpl-someone-else")])
def test_worker_failures_reach_the_client_without_addresses_or_other_ids(cluster, monkeypatch, caplog,
                                                                         stream, error):
    caplog.set_level(logging.INFO)
    gw = cluster[0]
    monkeypatch.setattr(gateway.completions, "forward", failing_forward(stream, error))
    status, got = post(gw.url, "/v1/completions", {"model": "tiny-moe", "prompt": "x = ", "stream": stream})
    text = json.dumps(got)
    if stream:
        assert status == 200 and "[DONE]" not in got
        text = got[-1]
        assert "error" in json.loads(text)
    else:
        assert status >= 500 and got["error"]["code"] in ("decode_failed", "internal"), got
    assert "10.9.8.7" not in text and "someone-else" not in text and "request id cmpl-" in text, text
    assert any("10.9.8.7" in r.getMessage() or (r.exc_info and "10.9.8.7" in str(r.exc_info[1]))
               for r in caplog.records)                      # the details are in the log


def test_health_does_not_show_the_model_path(cluster):
    gw = cluster[0]
    status, text = get(gw.url, "/health", key=None)
    assert status == 200 and json.loads(text) == {"status": "ok"}
    status, text = get(gw.url, "/v1/models")
    assert status == 200
    assert_clean(text)


def test_metrics_and_server_info_behind_admin_keys(cluster):
    _, decode, prefill = cluster
    gw = start_gateway([decode.address], [prefill.address], admin_keys=("sk-admin",))
    try:
        wait_ready(gw.url)
        for path in ("/metrics", "/v1/server_info"):
            for key in (None, API_KEY, "sk-wrong"):
                status, text = get(gw.url, path, key=key)
                assert status == 401 and json.loads(text)["error"]["code"] == "invalid_admin_key", (path, key)
                assert_clean(text, decode.address, prefill.address)
            assert get(gw.url, path, key="sk-admin")[0] == 200
        assert get(gw.url, "/health", key=None)[0] == 200
    finally:
        gw.stop()


def test_by_default_metrics_are_open_and_server_info_takes_an_api_key(cluster):
    gw = cluster[0]
    assert get(gw.url, "/metrics", key=None)[0] == 200
    assert get(gw.url, "/v1/server_info", key=None)[0] == 401
    assert get(gw.url, "/v1/server_info")[0] == 200
