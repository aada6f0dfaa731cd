"""A required or named tool call cut by max_tokens (issue 41): the parsed part is the response's
`tool_calls`, streamed and not, with finish_reason "length"; the raw `[{"name": ...` text of a
required tool_choice's array never becomes content.  The official `openai` client against a
gateway in front of scripted workers that stream a given output (the grammar's shape) and
stop by length."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import openai
import pytest

from proto import worker_pb2 as wpb
from tests.gateway_helpers import API_KEY, FakeWorker, start_gateway, wait_ready
from tests.test_tool_parsers import reassemble

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


class ScriptedWorker(FakeWorker):
    """A fake decode worker that streams `pieces` (one token each) and finishes by length."""

    pieces: list[str] = []

    def Generate(self, request, context):
        self.generated.append(request)
        yield wpb.GenerateResponse(reservation=wpb.Reservation(
            transfer_id=request.request_id.encode(), transfer_endpoint="grpc://fake",
            prompt_tokens=len(request.prompt_token_ids)))
        end = time.monotonic() + 10
        while self.peer is not None and not any(p.transfer_id == request.request_id.encode()
                                                for p in self.peer.prefilled):
            assert time.monotonic() < end, "the gateway never sent the prefill"
            time.sleep(0.01)
        for i, piece in enumerate(self.pieces):
            yield wpb.GenerateResponse(tokens=wpb.Tokens(token_ids=[100 + i], text=piece))
        yield wpb.GenerateResponse(finish=wpb.Finish(
            finish_reason="length", prompt_tokens=len(request.prompt_token_ids), completion_tokens=len(self.pieces)))


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[openai.OpenAI, ScriptedWorker]]:
    prefill, decode = FakeWorker("prefill"), ScriptedWorker()
    decode.peer = prefill
    gw = start_gateway([decode.address], [prefill.address])
    with contextlib.ExitStack() as stack:
        stack.callback(prefill.stop)
        stack.callback(decode.stop)
        stack.callback(gw.stop)
        wait_ready(gw.url)
        yield openai.OpenAI(base_url=gw.url + "/v1", api_key=API_KEY, max_retries=0), decode


def both(cluster, output: str, tool_choice, **kw) -> tuple[dict, dict, list[str | None]]:
    """The output (cut into a few tokens) answered streamed and not: (the message, the message
    the stream's deltas reassemble to, the stream's finish reasons)."""
    client, decode = cluster
    decode.pieces = [output[i:i + 7] for i in range(0, len(output), 7)]
    request = dict(model="tiny-moe", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                   tool_choice=tool_choice, max_tokens=len(decode.pieces), **kw)
    r = client.chat.completions.create(**request)
    assert r.choices[0].finish_reason == "length", r
    message = r.choices[0].message.model_dump(exclude_none=True)
    chunks = list(client.chat.completions.create(**request, stream=True))
    deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in chunks if c.choices]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    streamed = {k: v for k, v in reassemble(deltas, reasoning=False).items() if v is not None}
    return message, streamed, reasons


def calls(message: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", ())]


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_a_call_cut_inside_its_arguments_is_a_partial_call(cluster, tool_choice) -> None:
    params = '{"city":"Paris","da'
    output = f'[{{"name":"get_weather","parameters":{params}' if tool_choice == "required" else params
    message, streamed, reasons = both(cluster, output, tool_choice)
    assert calls(message) == [("get_weather", params)] and "content" not in message, message
    assert calls(streamed) == calls(message) and "content" not in streamed, streamed
    assert [c["id"] for c in streamed["tool_calls"]][0].startswith("call_")
    assert reasons[-1] == "length"


def test_complete_calls_then_one_cut(cluster) -> None:
    output = '[{"name":"get_time","parameters":{"zone":"CET"}},{"name":"get_weather","parameters":{"ci'
    message, streamed, _ = both(cluster, output, "required")
    assert [n for n, _ in calls(message)] == ["get_time", "get_weather"], message
    assert json.loads(calls(message)[0][1]) == {"zone": "CET"} and calls(message)[1][1] == '{"ci'
    assert calls(streamed) == calls(message) and "content" not in message and "content" not in streamed


@pytest.mark.parametrize("output, name", [('[{"name":"get_w', "get_weather"),       # one tool starts so
                                          ('[{"name":"get_weather"', "get_weather"),
                                          ('[{"name":"get_weather","param', "get_weather")])
def test_a_call_cut_at_its_name_has_the_name_and_no_arguments_yet(cluster, output, name) -> None:
    message, streamed, _ = both(cluster, output, "required")
    assert calls(message) == [(name, "")] and "content" not in message, message
    assert calls(streamed) == calls(message) and "content" not in streamed


@pytest.mark.parametrize("output", ['[{"name":"get_', '[{"na', "["])
def test_a_call_cut_before_its_name_is_known_is_no_call_and_no_content(cluster, output) -> None:
    message, streamed, reasons = both(cluster, output, "required")
    assert "tool_calls" not in message and "content" not in message, message
    assert streamed == {"role": "assistant"} and reasons[-1] == "length", streamed
