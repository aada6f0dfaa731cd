"""Tool-call parsers on scripted outputs (no model): each family's syntax into OpenAI's
tool_calls, content around the calls, blocks that do not parse kept as content, and the
stream of deltas reassembling to the non-streaming message for any chunking of the output."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import SHIPPED_MODEL
from engine.tokenizer import Tokenizer
from gateway.chat import OutputSettings
from gateway.protocol import ChatCompletionRequest
from gateway.reader import ChoiceReader, choice_reader

TOK = Tokenizer(SHIPPED_MODEL)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def body(tool_choice: Any = None, tools: list | None = TOOLS, messages: list | None = None,
         **kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=messages or [{"role": "user", "content": "hi"}], tools=tools,
                                 tool_choice=tool_choice, **kw)


def reader(tool_parser: str | None = None, reasoning: str | None = None, tok: Any = TOK,
           markers: tuple = (), **kw: Any) -> ChoiceReader:
    end = {"think": "</think>", "harmony": "<|channel|>final<|message|>"}.get(reasoning or "", "")
    r = choice_reader(OutputSettings(reasoning, end, tool_parser, markers, tok), body(**kw))
    assert r is not None
    return r


def run(r: ChoiceReader, chunks: list[str], ids: list[list[int]] | None = None) -> tuple[dict, dict]:
    """Feed the chunks; returns (the message, the message reassembled from the stream's deltas)."""
    deltas = []
    for i, c in enumerate(chunks):
        r.feed(c, ids[i] if ids else [])
        deltas.append(r.take())
    r.finish()
    deltas.append(r.take())
    return r.message(), reassemble(deltas, r.reasoning)


def reassemble(deltas: list[dict], reasoning: bool) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": None}
    if reasoning:
        msg["reasoning_content"] = None
    calls: list[dict] = []
    for d in deltas:
        for key in ("content", "reasoning_content"):
            if key in d:
                msg[key] = (msg[key] or "") + d[key]
        for c in d.get("tool_calls", ()):
            if c["index"] == len(calls):
                assert {"id", "type", "function"} <= set(c) and c["type"] == "function"
                calls.append({"id": c["id"], "type": "function", "function": dict(c["function"])})
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    if calls:
        msg["tool_calls"] = calls
    return msg


def calls(msg: dict) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", ())]


def whole(r: ChoiceReader, text: str) -> dict:
    msg, streamed = run(r, [text])
    assert msg == streamed
    return msg


def test_hermes_calls_and_content() -> None:
    out = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
           '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": "{}"}\n</tool_call>')
    msg = whole(reader("hermes"), out)
    assert msg["content"] == "Let me check."                 # whitespace around calls is not content
    assert calls(msg) == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    assert all(c["id"].startswith("call_") for c in msg["tool_calls"])
    assert reader("hermes").finish_reason("stop") == "stop"       # no calls, no change


def test_parallel_tool_calls_false_keeps_the_first_call_in_auto_mode() -> None:
    out = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert calls(whole(reader("hermes"), out)) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    r = reader("hermes", parallel_tool_calls=False)
    msg = whole(r, out)
    assert calls(msg) == [("get_weather", {"city": "Oslo"})] and msg["content"] is None
    assert r.finish_reason("stop") == "tool_calls"


def test_only_calls_give_no_content_and_finish_reason_tool_calls() -> None:
    r = reader("hermes")
    msg = whole(r, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n')
    assert msg["content"] is None and calls(msg) == [("get_time", {})]
    assert r.finish_reason("stop") == "tool_calls" and r.finish_reason("length") == "length"


@pytest.mark.parametrize("bad", ['<tool_call>{"name": "get_time", "arguments": </tool_call>',
                                 '<tool_call>{"name": "get_time", "argu'])
def test_a_block_that_does_not_parse_stays_content(bad: str) -> None:
    msg = whole(reader("hermes"), "x " + bad)
    assert msg["content"] == "x " + bad and "tool_calls" not in msg


def test_mistral_both_spellings() -> None:
    msg = whole(reader("mistral"), '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                                   '{"name": "get_time", "arguments": {}}]')
    assert calls(msg) == [("get_weather", {"city": "Oslo"}), ("get_time", {})] and msg["content"] is None
    msg = whole(reader("mistral"), 'ok[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}')
    assert calls(msg) == [("get_weather", {"city": "Oslo"}), ("get_time", {})] and msg["content"] == "ok"


def test_deepseek_v3_and_v31() -> None:
    v3 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
          '{"city": "Rome"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
          "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert calls(whole(reader("deepseek_v3"), v3)) == [("get_weather", {"city": "Rome"}), ("get_time", {})]
    v31 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Rome"}'
           "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert calls(whole(reader("deepseek_v3"), v31)) == [("get_weather", {"city": "Rome"})]


def test_glm45_values_follow_the_schema() -> None:
    out = ("I will look.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n"
           "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
    msg = whole(reader("glm45"), out)
    assert msg["content"] == "I will look." and calls(msg) == [("get_weather", {"city": "123", "days": 3})]


def test_long_whitespace_runs_parse_in_linear_time() -> None:
    """Call bodies padded with long whitespace runs (a model can be steered into them) parse like
    unpadded ones; the parsers split on their markers (a lazy-group regex took 74 s on 5,000
    spaces of the DeepSeek body)."""
    pad = " " * 50_000
    v3 = (f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{pad}get_weather{pad}```json{pad}"
          f'{{"city": "Rome"}}{pad}```{pad}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    assert calls(whole(reader("deepseek_v3"), v3)) == [("get_weather", {"city": "Rome"})]
    broken = (f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{pad}x{pad}```{pad}``"
              "<｜tool▁call▁end｜>")
    assert calls(whole(reader("deepseek_v3"), broken)) == []
    kimi = (f"<|tool_calls_section_begin|><|tool_call_begin|>{pad}functions.get_time:0{pad}"
            f"<|tool_call_argument_begin|>{{}}<|tool_call_end|><|tool_calls_section_end|>")
    assert calls(whole(reader("kimi_k2"), kimi)) == [("get_time", {})]
    glm = "<tool_call>get_weather" + "<arg_key>city" * 2000 + f"</arg_key>{pad}<arg_value>Rome</arg_value></tool_call>"
    key = "city" + "<arg_key>city" * 1999                     # from the first <arg_key> to the first close
    assert calls(whole(reader("glm45"), glm)) == [("get_weather", {key: "Rome"})]


def test_kimi_k2_keeps_its_call_ids() -> None:
    out = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
           '{"city": "Kyoto"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
           "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>")
    msg = whole(reader("kimi_k2"), out)
    assert calls(msg) == [("get_weather", {"city": "Kyoto"}), ("get_time", {})]
    assert [c["id"] for c in msg["tool_calls"]] == ["functions.get_weather:0", "functions.get_time:1"]
    # an id the model repeats is given once: clients match tool results to calls by id
    twice = out.replace("functions.get_time:1", "functions.get_weather:0")
    ids = [c["id"] for c in whole(reader("kimi_k2"), twice)["tool_calls"]]
    assert ids[0] == "functions.get_weather:0" and ids[1].startswith("call_")


def test_named_and_required_grammar_outputs() -> None:
    named = reader("hermes", tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg, streamed = run(named, ['{"ci', 'ty": "Lima"', "}"])
    assert msg == streamed and calls(msg) == [("get_weather", {"city": "Lima"})] and msg["content"] is None
    required = reader(None, tool_choice="required")        # needs no parser: the grammar fixes the shape
    out = '[{"name": "get_weather", "parameters": {"city": "Lima"}}, {"name": "get_time", "parameters": {}}]'
    msg, streamed = run(required, [out[:20], out[20:61], out[61:]])
    assert msg == streamed and calls(msg) == [("get_weather", {"city": "Lima"}), ("get_time", {})]


def test_no_reader_without_tools_or_reasoning() -> None:
    s = OutputSettings(None, "", "hermes", (), TOK)
    assert choice_reader(s, body(tools=None)) is None
    assert choice_reader(s, body(tool_choice="none")) is None


class SpecialTok:
    """A tokenizer whose marker tokens are special: the worker's text leaves them out."""
    marks = {900: "<|tool_calls_section_begin|>", 901: "<|tool_call_begin|>", 902: "<|tool_call_argument_begin|>",
             903: "<|tool_call_end|>", 904: "<|tool_calls_section_end|>"}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if i in self.marks else chr(i) for i in ids)


def test_special_marker_tokens_are_put_back_from_the_ids() -> None:
    tok = SpecialTok()
    markers = tuple(tok.marks.items())
    pieces = [(900, ""), (901, ""), (None, "functions.get_time:0"), (902, ""), (None, "{}"), (903, ""), (904, "")]
    r = reader("kimi_k2", tok=tok, markers=markers)
    msg, streamed = run(r, [t for _, t in pieces], [[i] if i else [ord("a")] for i, _ in pieces])
    assert msg == streamed and calls(msg) == [("get_time", {})]
    r = reader("kimi_k2", tok=tok, markers=markers)           # one message carrying several tokens
    ids = [900, 901, *map(ord, "functions.get_time:0"), 902, ord("{"), ord("}"), 903, 904]
    msg, _ = run(r, ["functions.get_time:0{}"], [ids])
    assert calls(msg) == [("get_time", {})]


CASES = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>tail"),
    ("deepseek_v3", "a<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```"
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'),
    ("hermes", "no calls at all, but a <tool partial marker and <tool_call> unclosed"),
]


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_any_chunking_streams_the_same_message(case: tuple[str, str], cuts: list[int]) -> None:
    parser, text = case
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    want, _ = run(reader(parser), [text])
    msg, streamed = run(reader(parser), chunks)
    assert msg == streamed
    strip = lambda m: {**m, "tool_calls": [c["function"] for c in m.get("tool_calls", ())]}  # noqa: E731
    assert strip(msg) == strip(want)                          # ids are fresh per reader
