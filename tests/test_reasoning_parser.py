"""Reasoning parsers on scripted outputs (no model): `<think>…</think>` sections (opened by the
output, or by the prompt), gpt-oss Harmony channels with tool calls, the per-request switch
(chat_template_kwargs), and the stream reassembling to the message for any chunking."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import SHIPPED_MODEL
from engine.tokenizer import Tokenizer
from gateway.chat import OutputSettings, output_settings, reasoning_end
from gateway.config import GatewayConfig
from gateway.reader import choice_reader
from tests.test_tool_parsers import TOK, body, calls, reader, run
from tests.workers import SECRET

SHIPPED = json.loads((SHIPPED_MODEL / "tokenizer_config.json").read_text())
# a Qwen3-like template: <think> in the prompt when thinking is on and the template opens it
OPENING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n"
           "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
           "{% else %}<think>\n{% endif %}{% endif %}")


def tokenizer(tmp_path: Path, template: str) -> Tokenizer:
    root = tmp_path / "tok"
    root.mkdir(exist_ok=True)
    (root / "tokenizer.json").write_bytes((SHIPPED_MODEL / "tokenizer.json").read_bytes())
    (root / "tokenizer_config.json").write_text(json.dumps({**SHIPPED, "chat_template": template}))
    return Tokenizer(root)


def config(**kw: object) -> GatewayConfig:
    return GatewayConfig(colocated_workers=("127.0.0.1:1",), cluster_secret=SECRET, **kw)  # type: ignore[arg-type]


def test_think_section_split_from_the_answer() -> None:
    r = reader(None, "think", tools=None)
    msg, streamed = run(r, ["<th", "ink>\nplan: ", "add</th", "ink>\n\nThe answer is 4."])
    assert msg == streamed == {"role": "assistant", "reasoning_content": "\nplan: add",
                               "content": "\n\nThe answer is 4."}


def test_no_section_is_all_content_and_an_unclosed_one_all_reasoning() -> None:
    msg, _ = run(reader(None, "think", tools=None), ["Just ", "<b>an answer</b>"])
    assert msg["content"] == "Just <b>an answer</b>" and msg["reasoning_content"] is None
    msg, _ = run(reader(None, "think", tools=None), ["<think>cut by max_tok", "ens"])
    assert msg["reasoning_content"] == "cut by max_tokens" and msg["content"] is None


def test_reasoning_then_tool_calls() -> None:
    out = ('<think>need weather</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n'
           '</tool_call>')
    msg, streamed = run(reader("hermes", "think"), [out[:9], out[9:40], out[40:]])
    assert msg == streamed and msg["reasoning_content"] == "need weather" and msg["content"] is None
    assert calls(msg) == [("get_weather", {"city": "Bern"})]


def test_prompt_that_opens_the_section_and_the_per_request_switch(tmp_path: Path) -> None:
    tok = tokenizer(tmp_path, OPENING)
    s = output_settings(config(), tok)
    assert (s.reasoning, s.reasoning_end, s.tool_parser) == ("think", "</think>", None)
    on = choice_reader(s, body(tools=None))
    assert on is not None
    msg, _ = run(on, ["thinking...", "</think>", "4"])                 # the output starts inside
    assert (msg["reasoning_content"], msg["content"]) == ("thinking...", "4")
    off = body(tools=None, chat_template_kwargs={"enable_thinking": False})
    assert choice_reader(s, off) is None and reasoning_end(s, off) == ""
    assert reasoning_end(s, body(tools=None)) == "</think>"
    start = output_settings(config(reasoning_parser="think"), TOK)      # the prompt does not open <think>
    assert start.reasoning_end == "</think>" and reasoning_end(start, body(tools=None)) == ""


def test_auto_picks_from_the_template_and_flags_override(tmp_path: Path) -> None:
    s = output_settings(config(), TOK)                                 # the shipped template renders tools
    assert (s.reasoning, s.tool_parser, s.markers) == (None, "hermes", ())
    s = output_settings(config(reasoning_parser="think", tool_call_parser="none"), TOK)
    assert (s.reasoning, s.reasoning_end, s.tool_parser) == ("think", "</think>", None)
    tok = tokenizer(tmp_path, "{{ '<|start|>assistant<|channel|>' }}{% for m in messages %}{{ m.content }}{% endfor %}")
    s = output_settings(config(), tok)
    assert (s.reasoning, s.reasoning_end, s.tool_parser) == ("harmony", "<|channel|>final<|message|>", "harmony")


def test_unknown_parser_flags_are_refused() -> None:
    for kw in ({"reasoning_parser": "qwen9"}, {"tool_call_parser": "nope"}):
        try:
            config(**kw)
        except ValueError as e:
            assert next(iter(kw)) in str(e)
        else:
            raise AssertionError(f"{kw} accepted")


HARMONY = ("<|channel|>analysis<|message|>User wants weather.<|end|><|start|>assistant<|channel|>commentary "
           'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>')


def test_harmony_channels_and_calls() -> None:
    msg, streamed = run(reader("harmony", "harmony"), [HARMONY[:30], HARMONY[30:95], HARMONY[95:]])
    assert msg == streamed and msg["reasoning_content"] == "User wants weather." and msg["content"] is None
    assert calls(msg) == [("get_weather", {"city": "Oslo"})]
    final = "<|channel|>analysis<|message|>easy<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"
    msg, _ = run(reader("harmony", "harmony"), [final])
    assert (msg["reasoning_content"], msg["content"]) == ("easy", "It is 4.") and "tool_calls" not in msg
    msg, _ = run(reader("harmony", "harmony", tools=None), [HARMONY])   # no tools offered: the text is content
    assert "tool_calls" not in msg and msg["content"] == '{"city": "Oslo"}'


def test_harmony_named_tool_choice_reads_the_final_channel() -> None:
    r = reader("harmony", "harmony", tool_choice={"type": "function", "function": {"name": "get_time"}})
    msg, _ = run(r, ["<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>final<|message|>{}"])
    assert calls(msg) == [("get_time", {})] and msg["reasoning_content"] == "ok"


PREAMBLE = ("<|channel|>analysis<|message|>User wants weather.<|end|><|start|>assistant<|channel|>commentary"
            "<|message|>Let me check the weather. <|end|><|start|>assistant<|channel|>final<|message|>")


@pytest.mark.parametrize(("tool_choice", "answer"), [
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Paris"}'),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Paris"}}]')])
def test_harmony_preambles_before_a_constrained_final_channel_are_content(tool_choice: object, answer: str) -> None:
    """With a named or required tool_choice only the final channel is grammar-constrained: a
    commentary preamble before it (gpt-oss writes them when tools are offered) is content, not
    part of the call, streamed or not, however the output is cut."""
    out = PREAMBLE + answer + "<|return|>"
    want, _ = run(reader("harmony", "harmony", tool_choice=tool_choice), [out])
    assert calls(want) == [("get_weather", {"city": "Paris"})]
    assert (want["content"], want["reasoning_content"]) == ("Let me check the weather.", "User wants weather.")
    for cut in range(0, len(out), 7):
        msg, streamed = run(reader("harmony", "harmony", tool_choice=tool_choice), [out[:cut], out[cut:]])
        assert msg == streamed
        assert {**msg, "tool_calls": calls(msg)} == {**want, "tool_calls": calls(want)}


def test_settings_without_a_tokenizer_read_nothing() -> None:
    assert choice_reader(OutputSettings("think", "</think>", "hermes"), body()) is None


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from([("think", "hermes", "<think>a</think>b<tool_call>{\"name\": \"get_time\", "
                                                 "\"arguments\": {}}</tool_call>"),
                             ("harmony", "harmony", HARMONY),
                             ("think", None, "  <thin not a section")]),
       cuts=st.lists(st.integers(0, 200), max_size=10))
def test_any_chunking_streams_the_same_message(case: tuple[str, str | None, str], cuts: list[int]) -> None:
    reasoning, tools, text = case
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    want, _ = run(reader(tools, reasoning), [text])
    msg, streamed = run(reader(tools, reasoning), chunks)
    assert msg == streamed
    strip = lambda m: {**m, "tool_calls": [c["function"] for c in m.get("tool_calls", ())]}  # noqa: E731
    assert strip(msg) == strip(want)


def test_special_marker_tokens_are_found_in_the_vocabulary(tmp_path: Path) -> None:
    """Markers that are special tokens (the worker's text leaves them out) are put back from the
    ids; markers that decode as text need nothing."""
    from tokenizers import AddedToken
    root = tmp_path / "special"
    root.mkdir()
    backend = TOK.backend.__class__.from_str(TOK.backend.to_str())
    backend.add_special_tokens([AddedToken(m, special=True) for m in HARMONY_SPECIALS])
    backend.add_tokens(["<think>", "</think>"])                          # added, not special
    backend.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({**SHIPPED, "chat_template": "<|channel|>{{ 1 }}"}))
    tok = Tokenizer(root)
    s = output_settings(config(), tok)
    assert dict(s.markers) == {tok.token_to_id(m): m for m in HARMONY_SPECIALS}
    ids = tok.encode(HARMONY)
    r = choice_reader(s, body())
    assert r is not None
    for i in ids:                                                      # as a worker streams them
        r.feed(tok.decode([i]), [i])
    r.finish()
    assert calls(r.message()) == [("get_weather", {"city": "Oslo"})]
    assert r.message()["reasoning_content"] == "User wants weather."
    s = output_settings(config(reasoning_parser="think", tool_call_parser="none"), tok)
    assert s.markers == ()                                             # <think> decodes as text


HARMONY_SPECIALS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")


@pytest.mark.parametrize("args", ['{"days": NaN}', '{"city": "Oslo", "days": Infinity}', "the weather in Oslo",
                                  '{"city": "Oslo"', '["Oslo"]'])
def test_harmony_call_arguments_that_are_not_a_json_object_are_content(args: str) -> None:
    """A commentary message to a function is a call when its body is a strict JSON object
    (RFC 8259: no NaN or Infinity), as in every other family's syntax; otherwise its text is
    content, streamed or not."""
    out = HARMONY.replace('{"city": "Oslo"}', args)
    msg, streamed = run(reader("harmony", "harmony"), [out[:100], out[100:]])
    assert msg == streamed and "tool_calls" not in msg and msg["content"] == args


def test_harmony_preambles_beside_a_constrained_answer_are_reasoning() -> None:
    """With a response_format the grammar constrains the final channel alone: a commentary
    preamble before it is reasoning, so the content is exactly the constrained answer."""
    answer = '{"city": "Paris"}'
    out = PREAMBLE + answer + "<|return|>"
    rf = {"type": "json_object"}
    want, _ = run(reader("harmony", "harmony", tools=None, response_format=rf), [out])
    assert want["content"] == answer and json.loads(want["content"]) == {"city": "Paris"}
    assert want["reasoning_content"] == "User wants weather.Let me check the weather. "
    for cut in range(0, len(out), 7):
        msg, streamed = run(reader("harmony", "harmony", tools=None, response_format=rf), [out[:cut], out[cut:]])
        assert msg == streamed == want
