"""Tools through the chat template and back out of the response: the shipped template renders
tools, earlier calls and tool results (plain chat byte for byte as before, and as transformers
renders it); a choice's tokens become message.tool_calls and stream deltas that reassemble to
it; and, end to end with real workers, a named tool_choice yields a call whose arguments
validate, streamed or not."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from engine.config import SHIPPED_MODEL
from engine.params import SamplingParams
from gateway.chat import OutputSettings, render_chat
from gateway.choice import Choice
from gateway.openai_format import Formatter
from gateway.reader import choice_reader
from gateway.streaming import DoneEvent, Event, TokensEvent, sse
from proto import worker_pb2 as wpb
from tests.gateway_helpers import API_KEY, gateway_cluster
from tests.test_tool_parsers import TOK, TOOLS, body, reassemble
from tests.workers import config

# the shipped template before it learnt tools: plain chat must render exactly as it did
PLAIN = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
         "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
         "{%- endif %}")

def _call(i: int, city: str) -> dict:
    args = json.dumps({"city": city})
    return {"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": args}}


HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris and Rome?"},
           {"role": "assistant", "content": None, "tool_calls": [_call(1, "Paris"), _call(2, "Rome")]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
           {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]


def test_plain_chat_renders_as_before() -> None:
    import jinja2.sandbox
    old = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(PLAIN)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "a\n b"},
            {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    for n in range(1, len(msgs) + 1):
        for gen in (True, False):
            assert TOK.apply_chat_template(msgs[:n], gen) == old.render(messages=msgs[:n], add_generation_prompt=gen)
    plain = body(tools=None, messages=msgs)
    assert render_chat(TOK, plain) == old.render(messages=msgs, add_generation_prompt=True)


def test_tools_calls_and_results_render_as_transformers_does() -> None:
    got = render_chat(TOK, body(messages=HISTORY))
    hf = AutoTokenizer.from_pretrained(str(SHIPPED_MODEL))
    assert got == hf.apply_chat_template(HISTORY, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert got.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and got.count("<|im_start|>system") == 1
    assert '"name": "get_weather"' in got.split("</tools>")[0]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in got
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>" \
           "<|im_end|>" in got


def test_tool_choice_none_does_not_offer_the_tools() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    without = render_chat(TOK, body(tools=None, messages=msgs))
    assert render_chat(TOK, body(tool_choice="none", messages=msgs)) == without
    assert "# Tools" in render_chat(TOK, body(messages=msgs))


def test_template_kwargs_cannot_replace_the_conversation() -> None:
    with pytest.raises(ValueError, match="messages"):
        render_chat(TOK, body(chat_template_kwargs={"messages": []}))


# Mixtral's guard: its template refuses a conversation whose roles do not alternate
ALTERNATE = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
             "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
             "{% endif %}{{ m.content }}{% endfor %}")


def test_a_conversation_the_template_refuses_is_a_400_with_its_message(tmp_path) -> None:
    from types import SimpleNamespace

    from gateway.admission import Rejected
    from gateway.completions import CompletionHandler
    from gateway.prompts import PromptEncoder
    from tests.test_reasoning_parser import tokenizer
    tok = tokenizer(tmp_path, ALTERNATE)
    handler = CompletionHandler(SimpleNamespace(tokenizer=tok, encoder=PromptEncoder(tok)))  # type: ignore[arg-type]
    ok = body(tools=None, messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert len(handler.prompts(ok, 2048)) == 1
    bad = body(tools=None, messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(Rejected) as e:
        handler.prompts(bad, 2048)
    assert e.value.status == 400 and e.value.reason == "invalid_request"
    assert e.value.message == ("the chat template refused the conversation: Conversation roles must alternate "
                               "user/assistant/user/assistant/...")


def tokens(text: str) -> list[wpb.Tokens]:
    return [wpb.Tokens(token_ids=[t], text=TOK.decode([t])) for t in TOK.encode(text)]


def test_response_and_stream_of_a_choice_with_calls() -> None:
    text = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    settings = OutputSettings(None, "", "hermes", (), TOK)

    def state() -> Choice:
        return Choice(0, [1] * 5, SamplingParams(), reader=choice_reader(settings, body()))

    fmt = Formatter("chat", "tiny-moe", TOK, None)
    whole = state()
    for t in tokens(text):
        whole.add(t)
    whole.end(wpb.Finish(finish_reason="stop"))
    msg = fmt.response([whole])["choices"][0]
    assert msg["finish_reason"] == "tool_calls" and msg["message"]["content"] == "Checking."
    call = msg["message"]["tool_calls"][0]
    assert call["type"] == "function" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}

    async def stream() -> list[dict]:
        s, events = state(), asyncio.Queue[Event]()
        for t in tokens(text):
            s.add(t)
            events.put_nowait(TokensEvent(s, t))
        s.end(wpb.Finish(finish_reason="stop"))
        events.put_nowait(DoneEvent(s))
        first = await events.get()
        return [json.loads(e[len("data: "):]) for e in
                [x async for x in sse(fmt, [s], events, first, False, lambda e: {}, lambda: None)]
                if e.strip() != "data: [DONE]"]
    chunks = asyncio.run(stream())
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]
    got = reassemble([c["choices"][0]["delta"] for c in chunks], reasoning=False)
    got["tool_calls"][0]["id"] = call["id"]                  # each reader makes its own ids
    assert got == msg["message"]


# ---- end to end: the shipped model behind a gateway, a named function enforced by the grammar
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}


@pytest.fixture(scope="module")
def client():
    with gateway_cluster(config(), config()) as c:
        yield openai.OpenAI(base_url=c[0].url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.mark.parametrize("seed", [None, 7])
def test_named_tool_choice_gives_a_valid_call_streamed_or_not(client, seed) -> None:
    kw = dict(model="tiny-moe", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
              tools=[{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}],
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=64,
              temperature=0 if seed is None else 1.0, seed=seed)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", f"finished {choice.finish_reason}: {choice.message}"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and choice.message.content is None
    jsonschema.validate(json.loads(call.function.arguments), CITY)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in chunks if c.choices]
    streamed = reassemble(deltas, reasoning=False)
    assert streamed["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": call.function.arguments}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_required_tool_choice_gives_valid_calls_streamed_or_not(client) -> None:
    time_schema = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                   "additionalProperties": False}
    schemas = {"get_weather": CITY, "get_time": time_schema}
    kw = dict(model="tiny-moe", messages=[{"role": "user", "content": "Weather and time in Paris?"}],
              tools=[{"type": "function", "function": {"name": n, "parameters": s}} for n, s in schemas.items()],
              tool_choice="required", parallel_tool_calls=False, max_tokens=96, temperature=0)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", f"finished {choice.finish_reason}: {choice.message}"
    (call,) = choice.message.tool_calls                        # parallel_tool_calls=false: exactly one
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = reassemble([c.choices[0].delta.model_dump(exclude_none=True) for c in chunks if c.choices], False)
    assert [c["function"] for c in streamed["tool_calls"]] == [{"name": call.function.name,
                                                                "arguments": call.function.arguments}]
