"""The Responses API (`POST /v1/responses`) with the official `openai` client against a gateway
in front of real prefill and decode workers: text equal to the engine's greedy output for the
templated prompt (instructions first), usage, max_output_tokens ending incomplete, a forced
function call whose arguments validate and its output sent back, text.format json_schema, the
stream's events in the documented order adding up to the answer, and the refusals (store,
previous_response_id, built-in tools, images, an oversized prompt before any worker).  Reasoning
items and a failure mid-stream, on scripted outputs, are read back with the SDK's own types."""

from __future__ import annotations

import asyncio
import json
import typing

import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import ResponseStreamEvent

from engine.params import SamplingParams
from gateway.admission import InvalidField
from gateway.chat import OutputSettings
from gateway.choice import Choice
from gateway.errors import ForwardError, error_body
from gateway.reader import choice_reader
from gateway.responses import ResponsesFormatter, response_events
from gateway.responses_input import to_chat
from gateway.responses_request import ResponsesRequest
from gateway.streaming import DoneEvent, ErrorEvent, Event, TokensEvent
from proto import worker_pb2 as wpb
from tests.gateway_helpers import API_KEY, gateway_cluster, get, post
from tests.test_chat_tools import tokens
from tests.test_gateway_admission import counters
from tests.test_tool_parsers import TOK
from tests.workers import config

M = "tiny-moe"
USER = {"role": "user", "content": "Please repeat: paged experts keep the hot experts resident"}
SYSTEM = {"role": "system", "content": "Be brief."}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "parameters": CITY}
# each stream event's type -> the SDK's model of it
EVENTS = {typing.get_args(m.model_fields["type"].annotation)[0]: m
          for m in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}


@pytest.fixture(scope="module")
def cluster():
    with gateway_cluster(config(), config()) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster[0].url + "/v1", api_key=API_KEY, max_retries=0)


def greedy(llm, messages, max_tokens, tools=None):
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages, tools=tools))
    return ids, llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0))[0]


def test_text_equals_the_engine_with_instructions_first_and_usage(client, shipped_llm):
    ids, want = greedy(shipped_llm, [SYSTEM, USER], 24)
    r = client.responses.create(model=M, instructions=SYSTEM["content"], input=[USER], max_output_tokens=24,
                                temperature=0)
    assert r.output_text == want.text and r.id.startswith("resp_") and r.object == "response"
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.status == ("completed" if want.finish_reason == "stop" else "incomplete")
    u = r.usage
    assert (u.input_tokens, u.output_tokens) == (len(ids), len(want.token_ids))   # the system message counted
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    assert 0 <= u.input_tokens_details.cached_tokens < u.input_tokens
    assert (r.store, r.instructions, r.max_output_tokens, r.temperature, r.tool_choice) == (
        False, "Be brief.", 24, 0, "auto")
    plain = client.responses.create(model=M, input=USER["content"], max_output_tokens=24, temperature=0)
    assert plain.output_text == greedy(shipped_llm, [USER], 24)[1].text          # a string is a user message


def test_max_output_tokens_ends_incomplete(client, shipped_llm):
    _, want = greedy(shipped_llm, [USER], 3)
    assert want.finish_reason == "length"
    r = client.responses.create(model=M, input=[USER], max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == want.text and r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


def test_the_stream_keeps_the_documented_order_and_adds_up(client):
    whole = client.responses.create(model=M, input=[USER], max_output_tokens=24, temperature=0)
    events = list(client.responses.create(model=M, input=[USER], max_output_tokens=24, temperature=0, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = events[-1].response
    assert "".join(deltas) == events[-4].text == last.output_text == whole.output_text
    assert last.usage.output_tokens == whole.usage.output_tokens and last.id == events[0].response.id
    assert whole.status == "completed"
    with client.responses.stream(model=M, input=[USER], max_output_tokens=24, temperature=0) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == whole.output_text


def test_a_forced_function_call_validates_and_its_output_goes_back(client, shipped_llm):
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    kw = dict(model=M, input=[ask], tools=[TOOL], max_output_tokens=48, temperature=0)
    r = client.responses.create(**kw, tool_choice={"type": "function", "name": "get_weather"})
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), CITY)
    events = list(client.responses.create(**kw, tool_choice="required", parallel_tool_calls=False, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["function_call"] and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == \
        done[0].arguments
    jsonschema.validate(json.loads(done[0].arguments), CITY)
    # the call as the client received it, and its output, back: rendered as chat renders them
    back = [ask, call.model_dump(exclude_none=True), {"type": "function_call_output", "call_id": call.call_id,
                                                      "output": "sunny"}]
    history = [ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    ids, want = greedy(shipped_llm, history, 16)
    again = client.responses.create(model=M, input=back, tools=[TOOL], tool_choice="none", max_output_tokens=16,
                                    temperature=0)
    assert again.output_text == want.text and again.usage.input_tokens == len(ids)


def test_text_format_json_schema_gives_valid_json(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}, "required": ["name"],
              "additionalProperties": False}
    r = client.responses.create(model=M, input=[{"role": "user", "content": "A user as JSON."}], temperature=0,
                                max_output_tokens=48, text={"format": {"type": "json_schema", "name": "user",
                                                                       "schema": schema, "strict": True}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_refusals_name_the_field(client, cluster):
    gw, decode, prefill = cluster
    before = counters(decode, prefill)
    cases = [({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
             ({"tools": [{"type": "web_search"}]}, "tools[0].type"), ({"background": True}, "background"),
             ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
              "input[0].content[0].type"), ({"truncation": "auto"}, "truncation"),
             ({"max_output_tokens": "8"}, "max_output_tokens")]
    for extra, param in cases:
        status, body = post(gw.url, "/v1/responses", {"model": M, "input": "hi", **extra})
        assert status == 400 and body["error"]["param"] == param, (extra, body)
    assert "web_search" in post(gw.url, "/v1/responses", {"model": M, "input": "hi", **cases[2][0]})[1][
        "error"]["message"]
    status, body = post(gw.url, "/v1/responses", {"model": M, "input": "word " * 3000})
    assert body["error"]["code"] == "context_length" and counters(decode, prefill) == before   # no worker saw it
    assert post(gw.url, "/v1/responses", {"model": M, "input": "hi"}, key=None)[0] == 401
    with pytest.raises(openai.BadRequestError, match="store=true"):
        client.responses.create(model=M, input="hi", store=True)
    status, text = get(gw.url, "/v1/responses/resp_1")
    assert status == 404 and "stores no responses" in json.loads(text)["error"]["message"]
    r = client.responses.with_raw_response.create(model=M, input="hi", max_output_tokens=2,
                                                  metadata={"k": "v"},
                                                  extra_body={"colour": "red"})
    assert r.headers["x-tandem-ignored-fields"] == "colour" and r.parse().metadata == {"k": "v"}


def test_input_items_become_the_chat_messages():
    """Each kind of item as chat has it: calls join the assistant message before them, a
    reasoning item goes to the message that follows it, text parts are joined."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}',
            "id": "fc_1", "status": "completed"}
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "Be "}, {"type": "input_text",
                                                                                      "text": "brief."}]},
             USER, {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                                  "text": "look it up"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.",
                                                                   "annotations": []}]},
             call, {**call, "call_id": "call_2"},
             {"type": "function_call_output", "call_id": "call_1", "output": "sun"}]
    chat = to_chat(ResponsesRequest(model=M, input=items, instructions="Hi."), 8)
    calls = [{"id": c, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
             for c in ("call_1", "call_2")]
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Hi."}, {"role": "developer", "content": "Be brief."}, USER,
        {"role": "assistant", "content": "Checking.", "reasoning_content": "look it up", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "sun"}]
    assert chat.unread == []
    for bad, param in (([USER, items[2]], "input[1]"), ([items[-1]], "input[0].call_id"),
                       ([USER] * 8, "input"), ([{"type": "item_reference", "id": "x"}], "input[0].type")):
        with pytest.raises(InvalidField) as e:
            to_chat(ResponsesRequest(model=M, input=bad, instructions="Hi."), 8)
        assert e.value.param == param, e.value.message


# ---- scripted outputs: reasoning items, calls and a failure, read back with the SDK's types -----
THINK = OutputSettings("think", "</think>", "hermes", (), TOK)


def scripted(text: str, end: wpb.Finish | ForwardError, tools: list | None = None) -> list[dict]:
    """The events of a response whose choice streams `text` token by token and ends with `end`."""
    req = ResponsesRequest(model=M, input="hi", tools=tools)
    fmt = ResponsesFormatter(M, TOK, req)
    choice = Choice(0, [1] * 5, SamplingParams(), reader=choice_reader(THINK, to_chat(req, 8)))

    async def run() -> list[str]:
        events = asyncio.Queue[Event]()
        for t in tokens(text):
            choice.add(t)
            events.put_nowait(TokensEvent(choice, t))
        if isinstance(end, ForwardError):
            events.put_nowait(ErrorEvent(end, choice))
        else:
            choice.end(end)
            events.put_nowait(DoneEvent(choice))
        first = await events.get()
        on_error = lambda e: error_body(e.code, e.message)  # noqa: E731
        return [e async for e in response_events(fmt, choice, events, first, on_error, lambda: None)]
    out = []
    for raw in asyncio.run(run()):
        head, data = raw.rstrip("\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        sdk_valid(event)
        out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def sdk_valid(event: dict) -> None:
    """The SDK's own types read `event`, but for usage's cache_write_tokens, which the gateway
    leaves out (docs/api.md: it does not learn what the decode worker's prefix cache took in)."""
    try:
        EVENTS[event["type"]].model_validate(event)
    except pydantic.ValidationError as e:
        assert all(err["loc"][-1] == "cache_write_tokens" for err in e.errors()), e


def test_reasoning_content_and_a_call_come_as_items_in_the_order_written():
    text = '<think>plan: ask</think>Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' \
           '\n</tool_call>'
    events = scripted(text, wpb.Finish(finish_reason="stop"), tools=[TOOL])
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["status"] == "completed"
    reasoning, msg, call = final["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "plan: ask"}] and reasoning["summary"] == []
    assert msg["content"][0]["text"] == "Checking." and msg["status"] == "completed"
    assert (call["name"], json.loads(call["arguments"]), call["call_id"][:5]) == ("get_weather", {"city": "Oslo"},
                                                                                  "call_")
    assert 0 < final["usage"]["output_tokens_details"]["reasoning_tokens"] < final["usage"]["output_tokens"]
    done = [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"]
    assert done == ["reasoning", "message", "function_call"]
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "plan: ask"
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]


def test_a_failure_mid_stream_ends_with_response_failed():
    from engine.errors import ErrorCode
    events = scripted("Half an answ", ForwardError(ErrorCode.DECODE_FAILED, "cut"))
    failed = events[-1]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "cut (decode_failed)",
                                           "type": "server_error", "param": None}
    (msg,) = failed["response"]["output"]
    assert msg["status"] == "incomplete" and msg["content"][0]["text"] == "Half an answ"
