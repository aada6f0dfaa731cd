""""No silent drops" at the gateway (gateway/fields.py, gateway/protocol.py), against scripted
workers: a field OpenAI or a vendor defines that Tandem cannot honour is refused with 400 naming
it unless its value is neutral; a field nobody defines, at the top or nested (messages, their
content parts and earlier tool calls, tools, options), is named in X-Tandem-Ignored-Fields (JSON,
stream and refusal alike); reasoning_effort is checked, and named when the chat template does
not read it; the log of ignored fields stays bounded whatever requests send.  Structured outputs'
own refusals: tests/test_gateway_structured.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from gateway.fields import (
    MAX_IGNORED_NAME_CHARS,
    MAX_IGNORED_NAMED,
    MAX_WARNED_FIELDS,
    IgnoredFields,
)
from tests.gateway_helpers import FakeWorker, fake_cluster
from tests.test_gateway_structured import MSG, SCHEMA, TOOLS, WEATHER, call, chat, sent_constraint


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[object, FakeWorker]]:
    with fake_cluster() as c:
        yield c


# ---- fields Tandem cannot honour: 400 naming them, no worker called ----------------------------
@pytest.mark.parametrize("extra, words", [
    # OpenAI fields Tandem cannot honour
    ({"functions": [{"name": "f"}]}, "tools"),
    ({"function_call": "auto"}, "tool_choice"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"store": True}, "store"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"echo": True}, "echo"),
    ({"prompt_logprobs": 2}, "prompt_logprobs"),
    # vendor extensions Tandem does not implement
    ({"min_p": 0.1}, "min_p"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"include_stop_str_in_output": True}, "no_stop_trim"),
    ({"messages": [{"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
                   *MSG]}, "messages[0].function_call"),
])
def test_unhonoured_fields_are_refused_by_name(cluster, extra, words):
    gw, decode = cluster
    before = len(decode.generated)
    status, got, _ = call(gw, chat(**extra))
    assert status == 400, got
    assert got["error"]["code"] == "unsupported" and words in got["error"]["message"], got
    assert len(decode.generated) == before


def test_neutral_values_of_unhonoured_fields_are_accepted(cluster):
    gw, decode = cluster
    status, got, header = call(gw, chat(store=False, modalities=["text"], min_p=0, repetition_penalty=1.0,
                                        service_tier="auto", metadata={"k": "v"}, skip_special_tokens=True,
                                        stream_options=None, user="u", prompt_cache_key="k",
                                        messages=[{"role": "assistant", "content": "hi", "refusal": None,
                                                   "annotations": []}, *MSG]))
    assert status == 200 and header is None, got


# ---- ignored fields: logged and named -----------------------------------------------------------
def test_unknown_fields_are_named_in_json_and_stream_responses(cluster, caplog):
    gw, _ = cluster
    body = chat(frobnicate=1, stream_options={"include_usage": True, "sparkle": True},
                response_format={"type": "json_schema", "extra": 1,
                                 "json_schema": {"name": "p", "schema": SCHEMA, "colour": "red"}})
    caplog.set_level("WARNING", "tandem.gateway")
    status, got, header = call(gw, body)
    assert status == 200, got
    names = ["frobnicate", "stream_options.sparkle", "response_format.extra", "response_format.json_schema.colour"]
    # without a stream, stream_options itself changes nothing: named too
    assert header.split(", ") == [names[0], "stream_options", *names[1:]]
    assert any("frobnicate" in r.getMessage() for r in caplog.records)
    status, events, header = call(gw, {**body, "stream": True})
    assert status == 200 and events[-1] == "[DONE]" and header.split(", ") == names


def test_unknown_nested_fields_of_messages_and_tools(cluster):
    gw, _ = cluster
    msgs = [{"role": "user", "content": "hi", "mood": "sunny"}]
    tools = [{"type": "function", "colour": 1, "function": {"name": "f", "parameters": WEATHER, "x": 2}}]
    named = {"type": "function", "function": {"name": "f", "why": 3}, "how": 4}
    status, got, header = call(gw, chat(messages=msgs, tools=tools, tool_choice=named))
    assert status == 200, got
    assert header.split(", ") == ["messages[].mood", "tools[].colour", "tools[].function.x", "tool_choice.how",
                                  "tool_choice.function.why"]


def test_tools_sent_to_text_completions_are_ignored_and_named(cluster):
    """tools and tool_choice are chat fields: on /v1/completions they constrain nothing, change
    nothing (not even with a response_format, which a chat's tool_choice auto would refuse) and
    are named in the header."""
    gw, decode = cluster
    text = {"model": "tiny-moe", "prompt": "x", "max_tokens": 4, "tools": TOOLS}
    for tc in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        status, got, header = call(gw, {**text, "tool_choice": tc}, "/v1/completions")
        assert status == 200, got
        assert header == "tools, tool_choice"
        assert not decode.generated[-1].params.HasField("constraint")
    c = sent_constraint(gw, decode, {**text, "tool_choice": "auto", "response_format": {"type": "json_object"}},
                        "/v1/completions")
    assert c is not None and c.kind == "json_object"


def test_a_refusal_names_the_ignored_fields_too(cluster):
    gw, _ = cluster
    status, got, header = call(gw, chat(model="gpt-4", shiny=True))
    assert status == 404 and header == "shiny"


def test_the_header_is_bounded_and_printable(cluster):
    gw, _ = cluster
    status, got, header = call(gw, chat(**{f"f{i}": i for i in range(40)}, **{"é\u2028,x" * 40: 1}))
    assert status == 200, got
    names = header.split(", ")
    assert len(names) == MAX_IGNORED_NAMED + 1 and names[-1] == "(+25 more)"
    assert header.isascii() and header.isprintable()


def test_unknown_fields_named_like_the_models_methods_change_nothing(cluster):
    gw, decode = cluster
    status, got, header = call(gw, chat(unsupported=1, ignored_fields=2, model_extra=3, __dict__=4))
    assert status == 200 and header == "unsupported, ignored_fields, model_extra, __dict__", got


def test_every_listed_vendor_extension_is_a_field_the_gateway_reads():
    """VENDOR_EXTENSIONS (what the docs list as honoured) names only fields the request models
    define, so none of them is an ignored extra."""
    from gateway.fields import VENDOR_EXTENSIONS
    from gateway.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
    fields = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    for key in VENDOR_EXTENSIONS:
        top, _, sub = key.split(" ")[0].partition(".")
        assert top in fields, key
        if sub:
            assert top == "stream_options" and sub in StreamOptions.model_fields, key


# ---- the ignored-fields log, and the gaps the review found -----------------------------------
def warnings(caplog) -> int:
    return sum(r.levelno == logging.WARNING for r in caplog.records)


def test_one_request_cannot_fill_the_ignored_fields_log(caplog):
    caplog.set_level("DEBUG", "tandem.gateway")
    log = IgnoredFields()
    log.report([f"k{i:06d}" + "x" * 200 for i in range(20000)])
    assert len(log._warned) == MAX_IGNORED_NAMED
    assert all(len(n) <= MAX_IGNORED_NAME_CHARS for n in log._warned)
    log.report(["colour"])                  # a later request's own typo is still a warning
    assert warnings(caplog) == 2


def test_many_requests_keep_it_bounded_and_warning(caplog):
    caplog.set_level("DEBUG", "tandem.gateway")
    log = IgnoredFields()
    for i in range(200):
        log.report([f"r{i}-{j}" for j in range(MAX_IGNORED_NAMED)])
    assert len(log._warned) == MAX_WARNED_FIELDS
    caplog.clear()
    log.report(["r199-0"])                  # seen lately: debug
    assert warnings(caplog) == 0
    log.report(["colour"])                  # new: a warning, though the log was full
    assert warnings(caplog) == 1


def test_neutral_values_are_accepted_others_refused(cluster):
    gw, _ = cluster
    status, got, header = call(gw, chat(verbosity="medium", function_call="none"))
    assert status == 200 and header is None, got
    for extra, words in (({"verbosity": "low"}, "verbosity"), ({"function_call": "auto"}, "tool_choice")):
        status, got, _ = call(gw, chat(**extra))
        assert status == 400 and got["error"]["code"] == "unsupported" and words in got["error"]["message"], got


def test_extras_in_content_parts_and_earlier_tool_calls_are_named(cluster):
    gw, _ = cluster
    call_item = {"id": "c1", "type": "function", "weird": 1, "function": {"name": "f", "arguments": "{}", "x": 2}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                {"role": "assistant", "content": None, "tool_calls": [call_item]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    status, got, header = call(gw, chat(messages=messages))
    assert status == 200, got
    assert header.split(", ") == ["messages[].content[].cache_control", "messages[].tool_calls[].weird",
                                  "messages[].tool_calls[].function.x"]


def test_reasoning_effort_is_checked_and_named_when_the_template_ignores_it(cluster):
    gw, _ = cluster
    status, got, header = call(gw, chat(reasoning_effort="ultra"))
    assert status == 400 and got["error"]["param"] == "reasoning_effort" and header is None, got
    assert "'ultra' is not one of minimal, low, medium, high" in got["error"]["message"]
    status, got, header = call(gw, chat(reasoning_effort="low", messages=MSG))
    assert status == 200 and header == "reasoning_effort", got      # the shipped model's template has no use for it
