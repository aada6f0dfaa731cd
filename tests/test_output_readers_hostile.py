"""Output readers on hostile model output (no model): whatever the text, a choice's reader
gives content and tool calls without raising, tool-call arguments are strict JSON (RFC 8259),
and the parsers read each character a bounded number of times."""

from __future__ import annotations

import json
from typing import Any

import pytest

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
                                     json.dumps('{"days": NaN}')])
def test_nan_and_infinity_are_not_json_arguments(block: tuple[str, str], payload: str) -> None:
    """Python's json takes NaN and ±Infinity (and writes them back, also for 1e999, which it
    reads as infinity); RFC 8259 and clients' parsers (JSON.parse) do not: such a block is not a
    call, it stays content."""
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
