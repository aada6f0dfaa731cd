"""Output readers on hostile model output (no model): whatever the text, a choice's reader
gives content and tool calls without raising, tool-call arguments are strict JSON (RFC 8259),
and the parsers read each character a bounded number of times."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.tool_parsers import parse_glm45
from gateway.tools import Text
from tests.test_tool_parsers import reader, run

DEEP = "[" * 5000 + "]" * 5000               # past the interpreter's recursion limit when decoded
DEEP_ARGS = '{"a":' * 3000 + "1" + "}" * 3000

BLOCKS = [  # (parser, a call of get_time with its arguments at "{}")
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'),
    ("mistral", "[TOOL_CALLS]get_time[ARGS]{}"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}"
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>"
                "{}<|tool_call_end|><|tool_calls_section_end|>"),
]


def strict(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def read(parser: str | None, text: str, **kw: Any) -> dict:
    msg, streamed = run(reader(parser, **kw), [text[:7], text[7:]])
    assert msg == streamed
    for c in msg.get("tool_calls", ()):
        assert isinstance(strict(c["function"]["arguments"]), dict)
    return msg


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("payload", [DEEP, DEEP_ARGS, json.dumps(DEEP_ARGS)])
def test_deeply_nested_json_in_a_call_block_stays_content(block: tuple[str, str], payload: str) -> None:
    """JSON nested past the recursion limit (json raises RecursionError, not ValueError), also
    inside arguments given as a JSON string, is a block that does not parse: it stays content,
    the reader does not raise."""
    parser, template = block
    assert read(parser, template)["tool_calls"]                     # with "{}" the block is a call
    text = template.replace("{}", payload)
    msg = read(parser, text)
    assert "tool_calls" not in msg and msg["content"] == text


def test_deeply_nested_json_in_glm45_values_and_required_calls() -> None:
    glm = "<tool_call>get_time\n<arg_key>a</arg_key><arg_value>" + DEEP + "</arg_value></tool_call>"
    msg = read("glm45", glm)                  # a value that is not JSON is the value's text
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [{"a": DEEP}]
    out = '[{"name": "get_time", "parameters": ' + DEEP_ARGS + "}]"
    msg = read(None, out, tool_choice="required")
    assert "tool_calls" not in msg and msg["content"] == out


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("payload", ['{"days": NaN}', '{"days": Infinity}', '{"a": [-Infinity]}', '{"a": 1e999}',
                                     json.dumps('{"days": NaN}'), '{"city": "\\ud800"}'])
def test_nan_and_infinity_are_not_json_arguments(block: tuple[str, str], payload: str) -> None:
    """Python's json takes NaN and ±Infinity (and writes them back, also for 1e999, which it
    reads as infinity); RFC 8259 and clients' parsers (JSON.parse) do not: such a block is not a
    call, it stays content.  So is one whose string holds a lone surrogate (`\\ud800` decodes
    to one, which UTF-8 cannot carry: the response failed to encode, a 500)."""
    parser, template = block
    text = template.replace("{}", payload)
    msg = read(parser, text)
    assert "tool_calls" not in msg and msg["content"] == text


def test_nan_in_required_calls_and_glm45_values() -> None:
    out = '[{"name": "get_time", "parameters": {"x": NaN}}]'
    msg = read(None, out, tool_choice="required")
    assert "tool_calls" not in msg and msg["content"] == out
    glm = "<tool_call>get_time\n<arg_key>a</arg_key><arg_value>NaN</arg_value></tool_call>"
    msg = read("glm45", glm)                  # a value that is not JSON is the value's text
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [{"a": "NaN"}]


class CountingText(str):
    """A text that counts the characters its `find` calls scan."""
    scanned = 0

    def find(self, sub: str, start: Any = None, end: Any = None) -> int:  # type: ignore[override]
        at = super().find(sub, start, end)
        CountingText.scanned += (at + len(sub) if at >= 0 else len(self)) - (start or 0)
        return at


@pytest.mark.parametrize("tail", ["", "</arg_value>"])
def test_glm45_reads_each_character_a_bounded_number_of_times(tail: str) -> None:
    """Values whose `</arg_value>` is missing (or one close for all of them, at the end) are
    found with one scan each way, not one scan to the end per key: the parser runs on the
    event loop when the block closes, and the model's output is as long as it likes."""
    block = CountingText("get_time" + "".join(f"<arg_key>k{i}</arg_key><arg_value>x" for i in range(2000)) + tail)
    CountingText.scanned = 0
    parsed = parse_glm45(block, {})
    assert CountingText.scanned <= 3 * len(block)
    want = {"k0": block[block.index("<arg_value>") + len("<arg_value>"):-len(tail)]} if tail else {}
    assert parsed is not None and [(n, json.loads(a)) for n, a, _ in parsed] == [("get_time", want)]


def test_glm45_pairs_do_not_overlap() -> None:
    """A value's text is everything up to its `</arg_value>`, marker-like text included (as the
    families' own parsers read it); pairs after it are read after it."""
    out = ("<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>a<arg_key>hours</arg_key><arg_value>2"
           "</arg_value><arg_key>days</arg_key>\n<arg_value>3</arg_value></tool_call>")
    msg = read("glm45", out)
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        {"city": "a<arg_key>hours</arg_key><arg_value>2", "days": 3}]


class CountingList(list):
    """A list that counts the items read by index."""
    reads = 0

    def __getitem__(self, i: Any) -> Any:
        CountingList.reads += 1
        return super().__getitem__(i)


def test_a_stream_of_many_calls_reads_each_call_a_bounded_number_of_times() -> None:
    """A take reads the calls it may still send (the last sent one and the new ones), not every
    call so far: a stream of n calls costs O(n) reads, not O(n^2) (n = 300 here would be 45,000)."""
    r = reader("hermes")
    r.out.calls = CountingList()
    block = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    n, deltas = 300, []
    for _ in range(n):
        r.feed(block, [])
        deltas.append(r.take())
    r.finish()
    assert len(r.message()["tool_calls"]) == n
    assert [d["tool_calls"][0]["index"] for d in deltas] == list(range(n))
    assert CountingList.reads <= 3 * n


def test_a_long_stream_appends_and_takes_without_joining_its_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """Content, reasoning and a named call's arguments grow by pieces (`Text`): a take sends the
    new pieces and never joins the whole text (str += on an attribute copied it at every token,
    quadratic: 128k tokens cost 7.3 s of the event loop); the message joins it once."""
    joins = []
    real = Text.__str__
    monkeypatch.setattr(Text, "__str__", lambda self: joins.append(1) or real(self))
    for kw, key in (({}, "content"), ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
                                      "tool_calls")):
        r = reader("hermes", "think", **kw)
        pieces = ["<think>", *("r" * 3 for _ in range(500)), "</think>", *("x" * 3 for _ in range(500))]
        streamed = []
        for p in pieces:
            r.feed(p, [])
            streamed.append(r.take())
        joins.clear()
        for p in ["y"] * 500:
            r.feed(p, [])
            streamed.append(r.take())
        assert not joins
        r.finish()
        streamed.append(r.take())
        msg = r.message()
        assert msg["reasoning_content"] == "r" * 1500
        got = "".join(d.get("content", "") for d in streamed) if key == "content" else \
            "".join(c["function"]["arguments"] for d in streamed for c in d.get("tool_calls", ()))
        want = msg["content"] if key == "content" else msg["tool_calls"][0]["function"]["arguments"]
        assert got == want == "x" * 1500 + "y" * 500


def test_text_since_any_offset() -> None:
    t = Text()
    for piece in ("ab", "", "cde", "f"):
        t += piece
    assert [t.since(n) for n in range(8)] == ["abcdef", "bcdef", "cdef", "def", "ef", "f", "", ""]
    assert len(t) == 6 and str(t) == "abcdef" and t == "abcdef" and t.since(2) == "cdef"
