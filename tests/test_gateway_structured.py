"""Structured outputs at the gateway, against scripted workers: every field that asks for a
constraint reaches the worker as one `Constraint`; a bad, too deep or too large schema, two
constraints at once and an impossible tool_choice are refused with 400 naming them before any
worker is called; compilations are cached, within their budget, and bounded (429).  The field
policy ("no silent drops"): tests/test_gateway_fields.py; the compile queue:
tests/test_compile_queue.py; the same requests against the shipped model end to end:
tests/test_gateway_structured_e2e.py."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest

from engine.constraint import MAX_SCHEMA_DEPTH, MAX_SPEC_CHARS, Constraint, schema_depth
from gateway.fields import IGNORED_HEADER
from gateway.tool_choice import CALLS_DEPTH
from tests.gateway_helpers import API_KEY, FakeWorker, connection, fake_cluster, get

MSG = [{"role": "user", "content": "Give me a JSON object"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "the time now"}}]


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[object, FakeWorker]]:
    with fake_cluster(grammar_max_pending=100, grammar_tenant_max_pending=30) as c:
        yield c


def call(gw, body: dict, path: str = "/v1/chat/completions") -> tuple[int, dict | list, str | None]:
    """POST; (status, JSON body or SSE events, the ignored-fields header)."""
    conn = connection(gw.url)
    conn.request("POST", path, body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    resp = conn.getresponse()
    data = resp.read().decode()
    conn.close()
    if resp.getheader("content-type", "").startswith("text/event-stream"):
        return resp.status, [e[6:] for e in data.split("\n\n") if e.startswith("data: ")], \
            resp.getheader(IGNORED_HEADER)
    return resp.status, json.loads(data), resp.getheader(IGNORED_HEADER)


def chat(**kw) -> dict:
    return {"model": "tiny-moe", "messages": MSG, "max_tokens": 8, **kw}


def sent_constraint(gw, decode: FakeWorker, body: dict, path: str = "/v1/chat/completions"):
    before = len(decode.generated)
    status, got, _ = call(gw, body, path)
    assert status == 200, got
    assert len(decode.generated) == before + 1
    params = decode.generated[-1].params
    return params.constraint if params.HasField("constraint") else None


# ---- each way to ask, as the worker receives it -------------------------------------------------
@pytest.mark.parametrize("extra, kind, spec", [
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
     "json_schema", SCHEMA),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", SCHEMA),
    ({"structured_outputs": {"regex": "[ab]{1,4}"}}, "regex", "[ab]{1,4}"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
    ({"structured_outputs": {"grammar": 'start: "x" | "y"'}}, "grammar", 'start: "x" | "y"'),
    ({"structured_outputs": {"json_object": True, "disable_fallback": True}}, "json_object", ""),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}}, "json_object", ""),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": False}}, "json_schema", SCHEMA),
    ({"guided_json": SCHEMA}, "json_schema", SCHEMA),
    ({"guided_regex": "[0-9]{3}"}, "regex", "[0-9]{3}"),
    ({"guided_choice": ["red", "blue"]}, "choice", ["red", "blue"]),
    ({"guided_grammar": 'start: "a"+'}, "grammar", 'start: "a"+'),
    ({"json_schema": json.dumps(SCHEMA)}, "json_schema", SCHEMA),
    ({"regex": "x+"}, "regex", "x+"),
    ({"ebnf": 'root ::= "a" | "b"'}, "grammar", 'root ::= "a" | "b"'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "json_schema", WEATHER),
])
def test_each_field_reaches_the_worker_as_one_constraint(cluster, extra, kind, spec):
    gw, decode = cluster
    c = sent_constraint(gw, decode, chat(**extra))
    assert c is not None and c.kind == kind and c.after == ""
    if kind == "json_schema" or kind == "choice":
        assert json.loads(c.spec) == spec
    else:
        assert c.spec == spec


def test_text_and_none_ask_for_nothing(cluster):
    gw, decode = cluster
    assert sent_constraint(gw, decode, chat(response_format={"type": "text"})) is None
    assert sent_constraint(gw, decode, chat(structured_outputs={"json_object": False})) is None
    assert sent_constraint(gw, decode, chat(tools=TOOLS, tool_choice="none")) is None
    c = sent_constraint(gw, decode, {"model": "tiny-moe", "prompt": "x", "max_tokens": 4,
                                     "response_format": {"type": "json_object"}}, "/v1/completions")
    assert c is not None and c.kind == "json_object"


@pytest.mark.parametrize("tools", [{}, {"tools": []}])
def test_tool_choice_auto_without_tools_takes_a_response_format(cluster, tools):
    """Nothing to call: auto is none, so nothing of the request would be dropped."""
    gw, decode = cluster
    c = sent_constraint(gw, decode, chat(**tools, tool_choice="auto", response_format={"type": "json_object"}))
    assert c is not None and c.kind == "json_object"


def test_tools_called_at_will_and_a_response_format_are_refused_with_the_ways_out(cluster):
    gw, decode = cluster
    for tc in ({}, {"tool_choice": "auto"}):
        status, got, _ = call(gw, chat(tools=TOOLS, **tc, response_format={"type": "json_object"}))
        assert status == 400 and got["error"]["code"] == "unsupported", got
        assert all(w in got["error"]["message"] for w in ("tool_choice none", "named function", "leave the tools")), got


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_is_a_list_of_calls(cluster, parallel):
    gw, decode = cluster
    c = sent_constraint(gw, decode, chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel))
    schema = json.loads(c.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and ("maxItems" in schema) != parallel
    branches = schema["items"]["anyOf"]
    assert [b["properties"]["name"] for b in branches] == [{"enum": ["get_weather"]}, {"enum": ["get_time"]}]
    assert branches[0]["properties"]["parameters"] == WEATHER
    assert branches[1]["properties"]["parameters"] == {"type": "object", "properties": {},
                                                       "additionalProperties": False}


def test_tool_schemas_with_defs_are_hoisted_to_the_root(cluster):
    gw, decode = cluster
    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    schema = json.loads(sent_constraint(gw, decode, chat(tools=tools, tool_choice="required")).spec)
    assert schema["$defs"] == {"P": {"type": "integer"}}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]


# ---- refusals: 400 naming the problem, no worker called ----------------------------------------
DEEP: dict = {"type": "integer"}
for _ in range(MAX_SCHEMA_DEPTH):
    DEEP = {"type": "array", "items": DEEP}


@pytest.mark.parametrize("extra, code, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "invalid_constraint", "frob"),
    ({"guided_regex": "(("}, "invalid_constraint", "guided_regex"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "invalid_constraint", "nothing_here"),
    ({"guided_json": DEEP}, "invalid_constraint", f"at most {MAX_SCHEMA_DEPTH}"),
    ({"guided_json": {"type": "string", "description": "x" * MAX_SPEC_CHARS}}, "invalid_constraint", "characters"),
    ({"guided_choice": []}, "invalid_constraint", "choice"),
    ({"guided_json": "{not json"}, "invalid_constraint", "not valid JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "invalid_constraint", "schema"),
    ({"response_format": {"type": "xml"}}, "unsupported", "xml"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "invalid_request", "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "invalid_request", "both"),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}}, "unsupported",
     "disable_additional_properties"),
    ({"guided_json": SCHEMA, "tools": TOOLS}, "unsupported", "tool"),
    ({"tool_choice": "required"}, "invalid_request", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "invalid_request",
     "nope"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "invalid_request", "sometimes"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "invalid_request", "named tool_choice"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "invalid_request", "get_weather"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "invalid_request",
     "at most 128"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "invalid_request",
     "both"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"next": {"$ref": "#"}}}}}], "tool_choice": "required"},
     "invalid_constraint", "$defs"),
])
def test_refusals_name_the_problem_and_call_no_worker(cluster, extra, code, words):
    gw, decode = cluster
    before = len(decode.generated)
    status, got, _ = call(gw, chat(**extra))
    assert status == 400, got
    assert got["error"]["code"] == code and words in got["error"]["message"], got
    assert len(decode.generated) == before


def nested(depth: int) -> dict:
    """A schema of objects nested `depth` levels: `depth - 1` objects around a string (the
    levels of the value it describes, as engine/constraint.py schema_depth counts)."""
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_schema_depth_counts_the_levels_of_the_value_described():
    """31 nested objects are 31 levels (the document nests 62 containers: each object's schema
    and its properties map); maps and lists of subschemas add none, data containers one each."""
    assert schema_depth(nested(31)) == 31
    assert schema_depth({"type": "array", "items": {"anyOf": [{"type": "integer"}, nested(3)]}}) == 5
    assert schema_depth({"type": "object", "properties": {"properties": {"type": "object", "properties": {}}}}) == 2
    assert schema_depth({"enum": [[[1]]]}) == 4          # the schema, then three nested arrays of data
    assert schema_depth({"$defs": {"d": nested(4)}, "$ref": "#/$defs/d"}) == 5
    Constraint("json_schema", json.dumps(nested(MAX_SCHEMA_DEPTH)))
    with pytest.raises(ValueError, match=f"nests {MAX_SCHEMA_DEPTH + 1} levels deep; at most {MAX_SCHEMA_DEPTH}"):
        Constraint("json_schema", json.dumps(nested(MAX_SCHEMA_DEPTH + 1)))


@pytest.mark.parametrize("depth, required_ok", [(MAX_SCHEMA_DEPTH - CALLS_DEPTH, True),
                                                (MAX_SCHEMA_DEPTH - CALLS_DEPTH + 1, False),
                                                (MAX_SCHEMA_DEPTH, False), (MAX_SCHEMA_DEPTH + 1, False)])
def test_a_tool_too_deep_is_refused_by_name_and_its_own_depth(cluster, depth, required_ok):
    """Each tool's own parameters are checked, and the refusal names the tool and its depth,
    not that of the list of calls a required tool_choice wraps it in (CALLS_DEPTH levels more)."""
    gw, decode = cluster
    tools = [TOOLS[0], {"type": "function", "function": {"name": "deep", "parameters": nested(depth)}}]
    for tc, ok in (("required", required_ok),
                   ({"type": "function", "function": {"name": "deep"}}, depth <= MAX_SCHEMA_DEPTH)):
        status, got, _ = call(gw, chat(tools=tools, tool_choice=tc))
        if ok:
            assert status == 200, got
        else:
            assert status == 400 and got["error"]["code"] == "invalid_constraint", got
            assert f"tool 'deep': its parameters nest {depth} levels deep" in got["error"]["message"], got


# ---- compilation: cached, and within its time budget --------------------------------------------
def test_a_schema_is_compiled_once(cluster):
    gw, decode = cluster
    structured = gw.app.state.gateway.structured
    schema = {"type": "object", "properties": {"only_here": {"type": "boolean"}}}
    before = structured.compiler.compiled
    for _ in range(3):
        assert sent_constraint(gw, decode, chat(guided_json=schema)) is not None
    assert structured.compiler.compiled == before + 1


def test_a_compilation_past_its_budget_is_refused(cluster):
    """A compilation that has not ended when its budget runs out (held here until the answer
    came) is refused; the compilation goes on in its thread and lands in the cache."""
    gw, decode = cluster
    structured = gw.app.state.gateway.structured
    compiler, release = structured.compiler, threading.Event()

    def held(c):
        release.wait(30)
        return type(compiler).check(compiler, c)

    budget, structured.timeout_s, compiler.check = structured.timeout_s, 0.05, held
    try:
        before = len(decode.generated)
        status, got, _ = call(gw, chat(guided_json={"type": "object", "properties": {"slow": {"type": "null"}}}))
        assert status == 400 and got["error"]["code"] == "grammar_timeout", got
        assert "longer than 0.05 s" in got["error"]["message"] and len(decode.generated) == before
    finally:
        release.set()
        structured.timeout_s = budget
        del compiler.check


def test_a_full_compile_queue_is_a_429_naming_the_limit(cluster):
    """Past the tenant's share of the compile queue (gateway/compile_queue.py: the bounds and
    the turns are tested there) a constrained request is refused at once; others go on."""
    gw, decode = cluster
    queue = gw.app.state.gateway.structured.queue
    assert (queue.max_pending, queue.tenant_max_pending) == (100, 30)     # the fixture's GatewayConfig
    share, queue.tenant_max_pending = queue.tenant_max_pending, 0
    try:
        before = len(decode.generated)
        conn = connection(gw.url)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(chat(guided_regex="[ab]+")),
                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        resp = conn.getresponse()
        got = json.loads(resp.read())
        conn.close()
        assert resp.status == 429 and got["error"]["code"] == "grammar_tenant_limit", got
        assert resp.getheader("Retry-After") == "1"
        assert "grammar_tenant_max_pending" in got["error"]["message"] and len(decode.generated) == before
        assert sent_constraint(gw, decode, chat()) is None
    finally:
        queue.tenant_max_pending = share


def test_the_constraint_starts_after_the_reasoning_when_the_model_reasons(cluster):
    gw, decode = cluster
    from gateway.chat import OutputSettings
    state = gw.app.state.gateway
    final = "<|channel|>final<|message|>"
    settings, state.output_settings = state.output_settings, OutputSettings("harmony", final)
    try:
        c = sent_constraint(gw, decode, chat(guided_choice=["a", "b"]))
        assert c.kind == "choice" and c.after == final
        c = sent_constraint(gw, decode, {"model": "tiny-moe", "prompt": "x", "max_tokens": 2, "regex": "a+"},
                            "/v1/completions")
        assert c.after == ""              # a text completion has no reasoning section to wait for
        # <think> where the output may or may not open it (the prompt does not): a model that answers
        # without thinking would never write </think>, so the grammar applies from the first token
        state.output_settings = OutputSettings("think", "</think>")
        assert sent_constraint(gw, decode, chat(guided_choice=["a", "b"])).after == ""
    finally:
        state.output_settings = settings


def test_compilations_are_measured(cluster):
    gw, decode = cluster
    sent_constraint(gw, decode, chat(guided_regex="[xyz]{3}"))
    status, text = get(gw.url, "/metrics", key=None)
    assert status == 200 and "tandem_grammar_compile_seconds_count" in text
    assert "tandem_requests_with_ignored_fields_total" in text
