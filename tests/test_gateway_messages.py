"""Anthropic's Messages API (`/v1/messages`): the official `anthropic` client against a gateway with
real prefill and decode workers on loopback (text equal to the engine's greedy output for the
templated conversation, usage, stop sequences, max_tokens, a forced tool and a tool_result round
trip, streamed and not, x-api-key, refusals in Anthropic's error shape, an oversized prompt
refused before any worker); and, without workers, the named event stream of a choice with
reasoning and a tool call, a failure mid-stream, and the translation's refusals and bounds."""

from __future__ import annotations

import asyncio
import http.client
import json

import anthropic
import jsonschema
import pytest

from engine.errors import ErrorCode
from engine.params import SamplingParams
from gateway.admission import Rejected
from gateway.chat import OutputSettings
from gateway.choice import Choice
from gateway.errors import ForwardError
from gateway.messages_format import MessagesFormatter, error_body, message_events, tool_input
from gateway.messages_request import MessagesRequest, chat_request
from gateway.reader import choice_reader
from gateway.streaming import DoneEvent, ErrorEvent, Event, TokensEvent
from proto import worker_pb2 as wpb
from tests.gateway_helpers import API_KEY, connection, gateway_cluster, post
from tests.test_chat_tools import tokens
from tests.test_gateway_admission import counters
from tests.test_tool_parsers import TOK, body
from tests.workers import config

CONTEXT = 512
SYSTEM = "Be brief."
USER = "Please repeat: paged experts keep the hot experts resident"
GREEDY = {"temperature": 0}           # the installed client has no temperature argument: sent as is
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": CITY}


@pytest.fixture(scope="module")
def cluster():
    with gateway_cluster(config(max_model_len=CONTEXT), config(max_model_len=CONTEXT)) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return anthropic.Anthropic(base_url=cluster[0].url, api_key=API_KEY, max_retries=0)


def greedy(llm, messages, max_tokens, tools=None):
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages, True, tools=tools))
    return ids, llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0))[0]


def kw(**more):
    return {"model": "tiny-moe", "max_tokens": 24, "system": SYSTEM, "messages": [{"role": "user", "content": USER}],
            "extra_body": GREEDY, **more}


def test_a_message_is_the_engines_greedy_output_with_its_usage(client, shipped_llm):
    ids, want = greedy(shipped_llm, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}], 24)
    r = client.messages.create(**kw())
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant" and r.model == "tiny-moe"
    assert [(b.type, b.text) for b in r.content] == [("text", want.text)]
    assert r.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[want.finish_reason]
    assert r.stop_sequence is None
    u = r.usage                          # the prompt is what the prefix cache held plus what was computed
    assert u.input_tokens + u.cache_read_input_tokens == len(ids) and u.cache_creation_input_tokens == 0
    assert u.output_tokens == len(want.token_ids)

    with client.messages.stream(**kw()) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].text == want.text and final.stop_reason == r.stop_reason
    assert final.usage.output_tokens == u.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == len(ids)
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    raw = list(client.messages.create(**kw(), stream=True))
    assert "".join(e.delta.text for e in raw if e.type == "content_block_delta") == want.text


def test_the_wire_names_every_event_and_pings_once(cluster):
    conn = connection(cluster[0].url)
    conn.request("POST", "/v1/messages", body=json.dumps({**{k: v for k, v in kw().items() if k != "extra_body"},
                                                          **GREEDY, "stream": True}),
                 headers={"Content-Type": "application/json", "x-api-key": API_KEY, "anthropic-version": "2023-06-01"})
    resp = conn.getresponse()
    events = [e.split("\n") for e in resp.read().decode().strip().split("\n\n")]
    conn.close()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    names = [e[0].removeprefix("event: ") for e in events]
    assert all(json.loads(e[1].removeprefix("data: "))["type"] == n for n, e in zip(names, events, strict=True))
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names.count("ping") == 1
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}


def test_stop_sequences_and_max_tokens(client, shipped_llm):
    _, want = greedy(shipped_llm, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}], 24)
    stop = want.text[4:8]
    before = want.text[:want.text.find(stop)]
    r = client.messages.create(**kw(stop_sequences=[stop, "never-seen"]))
    assert (r.stop_reason, r.stop_sequence, r.content[0].text) == ("stop_sequence", stop, before)
    with client.messages.stream(**kw(stop_sequences=[stop])) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", stop, before)
    r = client.messages.create(**kw(max_tokens=3))
    assert (r.stop_reason, r.stop_sequence, r.usage.output_tokens) == ("max_tokens", None, 3)


def test_a_forced_tool_then_its_result(client, shipped_llm):
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    forced = dict(model="tiny-moe", max_tokens=64, messages=[ask], tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    r = client.messages.create(**forced)
    (call,) = r.content
    assert (r.stop_reason, call.type, call.name) == ("tool_use", "tool_use", "get_weather")
    jsonschema.validate(call.input, CITY)
    with client.messages.stream(**forced) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and [(b.name, b.input) for b in final.content] == [("get_weather",
                                                                                              call.input)]
    # the call and its result go back: a tool message answering the call's id, under the same tools
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                           "content": [{"type": "text", "text": "sunny, 21 C"}]}]}
    r2 = client.messages.create(model="tiny-moe", max_tokens=16, messages=[ask, r.to_param(), result],
                                tools=[WEATHER], extra_body=GREEDY)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                               "parameters": CITY}}]
    tool_call = {"id": call.id, "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": json.dumps(call.input)}}
    ids, want = greedy(shipped_llm, [ask, {"role": "assistant", "content": None, "tool_calls": [tool_call]},
                                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}], 16, tools)
    assert r2.usage.input_tokens + r2.usage.cache_read_input_tokens == len(ids)
    assert "<tool_call>" not in want.text and [b.text for b in r2.content] == [want.text]


def test_x_api_key_authenticates_and_refusals_have_anthropics_shape(cluster, client):
    url = cluster[0].url
    good = {"model": "tiny-moe", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert post(url, "/v1/messages", good)[0] == 200                          # Authorization: Bearer
    assert client.messages.create(**good).usage.output_tokens == 2           # x-api-key (the client's)
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0).messages.create(**good)
    assert e.value.status_code == 401 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    for headers in ({}, {"x-api-key": API_KEY, "Authorization": "Bearer sk-other"}):
        status, got = raw_post(url, good, headers)
        assert (status, got["error"]["type"], got["error"]["code"]) == (401, "authentication_error",
                                                                        "invalid_api_key")
    assert raw_post(url, good, {"x-api-key": API_KEY, "Authorization": f"Bearer {API_KEY}"})[0] == 200
    status, got = raw_post(url, {"model": "tiny-moe", "max_tokens": 2, "messages": good["messages"]},
                           {"x-api-key": API_KEY}, path="/v1/chat/completions")     # every endpoint takes it
    assert status == 200 and got["object"] == "chat.completion"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**{**good, "messages": [{"role": "user", "content": [image, {"type": "text",
                                                                                            "text": "what?"}]}]})
    assert e.value.body["error"] == {"type": "invalid_request_error", "code": "unsupported",
                                     "param": "messages[0].content[0]", "message": "messages[0].content[0]: image "
                                     "blocks are not supported: this server's model reads text only"}
    status, got = post(url, "/v1/messages", {"model": "tiny-moe", "messages": good["messages"]})
    assert (status, got["type"], got["error"]["param"]) == (400, "error", "max_tokens")     # required
    status, got = post(url, "/v1/messages", {**good, "thinking": {"type": "enabled", "budget_tokens": 2048}})
    assert (status, got["error"]["code"], got["error"]["param"]) == (400, "unsupported", "thinking")
    status, got = post(url, "/v1/messages", None, raw=b" " * ((4 << 20) + 1))          # before any parsing
    assert (status, got["type"], got["error"]["type"], got["error"]["code"]) == (413, "error", "request_too_large",
                                                                                 "body_too_large")


def test_unknown_fields_are_named_back(cluster):
    status, headers = raw_post(cluster[0].url, {"model": "tiny-moe", "max_tokens": 2, "metadata": {"user_id": "u"},
                                                "messages": [{"role": "user", "content": "hi", "colour": 1}],
                                                "frobnicate": True}, {"x-api-key": API_KEY}, head=True)
    assert status == 200 and headers["x-tandem-ignored-fields"] == "frobnicate, messages[].colour"


def test_an_oversized_prompt_is_refused_before_any_worker(cluster):
    gw, decode, prefill = cluster
    before = counters(decode, prefill)
    status, got = post(gw.url, "/v1/messages", {"model": "tiny-moe", "max_tokens": 4,
                                                "messages": [{"role": "user", "content": "word " * 600}]})
    assert status == 400 and got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
    assert got["error"]["code"] == "context_length" and f"context length of {CONTEXT} tokens" in got["error"]["message"]
    assert counters(decode, prefill) == before                 # no reservation, no KV byte
    assert decode.core.pool.num_free == decode.core.pool.num_pages


def raw_post(url: str, payload: dict, headers: dict, head: bool = False, path: str = "/v1/messages"):
    conn = connection(url)
    conn.request("POST", path, body=json.dumps(payload), headers={"Content-Type": "application/json", **headers})
    resp: http.client.HTTPResponse = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, ({k.lower(): v for k, v in resp.getheaders()} if head else json.loads(data))


# ---- without workers: the stream of a choice with reasoning and a call, and a failure in it ----------
def parsed(lines: list[str]) -> list[tuple[str, dict]]:
    out = []
    for e in lines:
        name, data = e.strip().split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def stream(choice: Choice, events: list[Event]) -> list[tuple[str, dict]]:
    async def go() -> list[str]:
        q: asyncio.Queue[Event] = asyncio.Queue()
        for e in events[1:]:
            q.put_nowait(e)
        fmt = MessagesFormatter("tiny-moe", TOK)
        return [x async for x in message_events(fmt, choice, q, events[0],
                                                lambda e: error_body(e.code, e.message, status=e.status),
                                                lambda: None)]
    return parsed(asyncio.run(go()))


def test_thinking_text_and_tool_use_blocks_stream_in_order() -> None:
    text = '<think>plan it</think>Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' \
           '\n</tool_call>'
    settings = OutputSettings("think", "</think>", "hermes", (), TOK)

    def choice() -> Choice:
        return Choice(0, [1] * 5, SamplingParams(), reader=choice_reader(settings, body()))
    c, whole = choice(), choice()
    events: list[Event] = []
    for t in tokens(text):
        c.add(t)
        whole.add(t)
        events.append(TokensEvent(c, t))
    for x in (c, whole):
        x.end(wpb.Finish(finish_reason="stop", prompt_tokens=5, completion_tokens=len(events), cached_tokens=2))
    got = stream(c, [*events, DoneEvent(c)])
    names = [n for n, _ in got]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    starts = [d["content_block"]["type"] for n, d in got if n == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert [d["index"] for n, d in got if n == "content_block_stop"] == [0, 1, 2]
    deltas = {i: "".join(d["delta"].get("thinking", d["delta"].get("text", d["delta"].get("partial_json", "")))
                         for n, d in got if n == "content_block_delta" and d["index"] == i) for i in range(3)}
    assert deltas[0] == "plan it" and deltas[1] == "Checking." and json.loads(deltas[2]) == {"city": "Oslo"}
    last = dict(got)["message_delta"]
    assert last["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert last["usage"]["input_tokens"] == 3 and last["usage"]["cache_read_input_tokens"] == 2
    msg = MessagesFormatter("tiny-moe", TOK).response([whole])
    assert [b["type"] for b in msg["content"]] == ["thinking", "text", "tool_use"]
    assert msg["content"][0] == {"type": "thinking", "thinking": "plan it", "signature": ""}
    assert msg["content"][2]["input"] == {"city": "Oslo"} and msg["stop_reason"] == "tool_use"


def test_a_failure_mid_stream_ends_it_with_an_error_event() -> None:
    c = Choice(0, [1] * 5, SamplingParams())
    (t, *_) = tokens("Hello there")
    c.add(t)
    got = stream(c, [TokensEvent(c, t), ErrorEvent(ForwardError(ErrorCode.DECODE_FAILED, "boom"), c)])
    assert [n for n, _ in got] == ["message_start", "ping", "content_block_start", "content_block_delta", "error"]
    assert got[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "boom", "code": "decode_failed",
                                                     "param": None}}


def test_a_cut_tool_input_keeps_its_complete_members() -> None:
    assert tool_input('{"city": "Oslo", "days": 3') == {"city": "Oslo", "days": 3}
    assert tool_input('{"city": "Os') == {} and tool_input("") == {}
    assert tool_input('{"a": {"b": [1, 2') == {"a": {"b": [1, 2]}}


def request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "tiny-moe", "max_tokens": 8,
                                           "messages": [{"role": "user", "content": "hi"}], **fields})


def test_the_conversation_translates_turn_by_turn() -> None:
    chat = chat_request(request(system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}], messages=[
        {"role": "user", "content": "one"}, {"role": "user", "content": [{"type": "text", "text": " two"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "no",
                                      "is_error": True}, {"type": "text", "text": "and?"}]}],
        tools=[{"name": "f", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, stop_sequences=["END"], top_k=0), 64, False)
    got = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert got == [{"role": "system", "content": "AB"}, {"role": "user", "content": "one two"},
                   {"role": "assistant", "content": "Let me look.", "reasoning_content": "hm",
                    "tool_calls": [{"id": "toolu_1", "type": "function",
                                    "function": {"name": "f", "arguments": '{"x": 1}'}}]},
                   {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: no"},
                   {"role": "user", "content": "and?"}]
    assert (chat.tool_choice, chat.parallel_tool_calls, chat.stop, chat.top_k, chat.n) == ("required", False,
                                                                                         ["END"], -1, 1)


@pytest.mark.parametrize("fields, param", [
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "messages[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0]"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [{**WEATHER, "strict": True}]}, "tools[0].strict"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"container": "c-1"}, "container"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"stop_sequences": ["s"] * 17}, "stop_sequences"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 9}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [3]}]}]},
     "messages[0].content[0].content[0]"),
])
def test_what_cannot_be_honoured_or_is_past_a_bound_is_refused_naming_it(fields, param) -> None:
    with pytest.raises(Rejected) as e:
        chat_request(request(**fields), 2, False)           # 2 messages: at most 8 content blocks
    assert e.value.status == 400 and e.value.param == param, e.value.message
