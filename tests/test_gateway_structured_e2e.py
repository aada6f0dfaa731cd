"""Structured outputs end to end: the official `openai` client against a gateway in front of a
colocated worker running the shipped model.  Quality is not the point, validity is: every
choice that ends with "stop" parses and validates (jsonschema), and none ends with "length"
with the max_tokens given (a "length" ending is reported as such).  The gateway-side refusals
and field policy: tests/test_gateway_structured.py."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import openai
import pydantic
import pytest

from tests.gateway_helpers import API_KEY, colocated_gateway
from tests.workers import config

MSG = [{"role": "user", "content": "Describe a user as JSON."}]
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                  "role": {"enum": ["admin", "guest"]}},
                 "required": ["id", "role"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
        "required": ["user", "tags"], "additionalProperties": False},
    "enum_bool": {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
                  "required": ["ok", "level"], "additionalProperties": False},
}
MAX_TOKENS = 96
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with colocated_gateway(config()) as (gw, _):
        yield openai.OpenAI(base_url=gw.url + "/v1", api_key=API_KEY, max_retries=0)


def finished(choice) -> str:
    """The choice's text, once it is known to have ended with "stop"."""
    assert choice.finish_reason != "length", \
        f"ran out of max_tokens ({MAX_TOKENS}) before the grammar could end: {choice.message.content!r}"
    assert choice.finish_reason == "stop", choice
    return choice.message.content


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11, "n": 3}])
def test_json_schema_outputs_validate(client, name, sampling):
    schema = SCHEMAS[name]
    r = client.chat.completions.create(model="tiny-moe", messages=MSG, max_tokens=MAX_TOKENS, **sampling,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": name, "schema": schema}})
    for choice in r.choices:
        jsonschema.validate(json.loads(finished(choice)), SCHEMAS[name])


@pytest.mark.parametrize("seed", [None, 3])
def test_json_object(client, seed):
    """Any JSON object: nothing bounds its strings, so the shipped model's sampled output may
    run on inside one; greedy (and seed 3) close the object within max_tokens."""
    r = client.chat.completions.create(model="tiny-moe", messages=MSG, max_tokens=MAX_TOKENS, seed=seed,
                                       temperature=0 if seed is None else 1.0, response_format={"type": "json_object"})
    assert isinstance(json.loads(finished(r.choices[0])), dict)


def test_regex_and_choice(client):
    def ask(**kw):
        return client.chat.completions.create(model="tiny-moe", messages=MSG, max_tokens=MAX_TOKENS,
                                              temperature=1.0, seed=3, n=3, extra_body=kw).choices
    for choice in ask(structured_outputs={"regex": "[a-z]{2,6}-[0-9]{1,3}"}):
        assert re.fullmatch("[a-z]{2,6}-[0-9]{1,3}", finished(choice))
    for choice in ask(guided_choice=["sunny", "rainy", "cloudy"]):
        assert finished(choice) in ("sunny", "rainy", "cloudy")
    for choice in ask(guided_grammar='start: "x=" NUM ";"\nNUM: /[0-9]{1,4}/'):
        assert re.fullmatch("x=[0-9]{1,4};", finished(choice))


def test_a_constrained_stream_adds_up_to_the_same_text(client):
    kw = dict(model="tiny-moe", messages=MSG, max_tokens=MAX_TOKENS, temperature=0,
              response_format={"type": "json_schema",
                               "json_schema": {"name": "f", "schema": SCHEMAS["flat"]}})
    whole = finished(client.chat.completions.create(**kw).choices[0])
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    legs: int = pydantic.Field(ge=0, le=8)
    kind: str = pydantic.Field(json_schema_extra={"enum": ["cat", "dog"]})


def test_the_openai_parse_helper_returns_a_pydantic_object(client):
    r = client.chat.completions.parse(model="tiny-moe", messages=MSG, max_tokens=MAX_TOKENS, temperature=0,
                                      response_format=Pet)
    msg = r.choices[0].message
    finished(r.choices[0])
    assert isinstance(msg.parsed, Pet) and msg.parsed.kind in ("cat", "dog")


def calls_of(choice) -> list[tuple[str, dict]]:
    """(name, arguments) of the choice's tool calls."""
    assert choice.finish_reason != "length", f"ran out of max_tokens: {choice.message}"
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or ()]


@pytest.mark.parametrize("seed", [None, 5])
def test_a_named_tool_choice_always_calls_it_with_valid_arguments(client, seed):
    r = client.chat.completions.create(
        model="tiny-moe", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=MAX_TOKENS,
        temperature=0 if seed is None else 1.0, seed=seed, n=1 if seed is None else 3)
    for choice in r.choices:
        calls = calls_of(choice)
        assert [n for n, _ in calls] == ["get_weather"] and choice.finish_reason == "tool_calls"
        jsonschema.validate(calls[0][1], WEATHER)


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_always_calls_a_tool(client, parallel):
    r = client.chat.completions.create(
        model="tiny-moe", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
        tool_choice="required", parallel_tool_calls=parallel, max_tokens=MAX_TOKENS * 2, temperature=1.0,
        seed=9, n=3)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in r.choices:
        calls = calls_of(choice)
        assert calls and choice.finish_reason == "tool_calls" and (parallel or len(calls) == 1)
        for name, args in calls:
            jsonschema.validate(args, schemas[name])


def test_tool_call_stream_reassembles_to_the_response(client):
    kw = dict(model="tiny-moe", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS,
              tool_choice="required", max_tokens=MAX_TOKENS * 2, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    args: dict[int, list] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices else ():
            entry = args.setdefault(d.index, [None, ""])
            entry[0] = entry[0] or d.function.name
            entry[1] += d.function.arguments or ""
    assert [(n, json.loads(a)) for n, a in args.values()] == calls_of(whole)


def test_a_disaggregated_pair_gives_the_same_constrained_outputs(client):
    """Through a prefill + decode pair the grammar crosses the KV transfer (the prefill worker
    picks the first token under it, the decode worker replays it): the same outputs as the
    colocated worker, greedy and seeded."""
    from tests.gateway_helpers import gateway_cluster
    asks = [dict(response_format={"type": "json_schema", "json_schema": {
                 "name": "n", "schema": SCHEMAS["nested"]}}, temperature=0),
            dict(extra_body={"guided_choice": ["sunny", "rainy", "cloudy"]}, temperature=1.0, seed=4, n=2),
            dict(tools=TOOLS, tool_choice="required", temperature=1.0, seed=2)]
    with gateway_cluster(config(), config()) as (gw, _, _):
        pair = openai.OpenAI(base_url=gw.url + "/v1", api_key=API_KEY, max_retries=0)
        for kw in asks:
            got, want = (c.chat.completions.create(model="tiny-moe", messages=MSG, max_tokens=MAX_TOKENS * 2, **kw)
                         for c in (pair, client))
            assert [shown(c) for c in got.choices] == [shown(c) for c in want.choices], kw


def shown(choice) -> tuple:
    """A choice as the client reads it, less the tool calls' random ids."""
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    return choice.message.content, calls, choice.finish_reason
