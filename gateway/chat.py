"""Chat messages, tools and what the gateway reads of a chat's output: the message and tool
models of a chat request, the conversation rendered through the chat template (tools, tool
calls and tool results too), the output settings of the served model (reasoning parser,
tool-call parser: named by flag, or "auto" from the chat template's markers), and the
`ChoiceReader` that splits one choice's output into reasoning, content and tool calls
(gateway/reasoning.py, gateway/tools.py) for the response and its stream chunks."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from engine.tokenizer import Tokenizer
from gateway.reasoning import (
    HARMONY_FINAL,
    HARMONY_MARKERS,
    THINK_CLOSE,
    THINK_OPEN,
    HarmonySplitter,
    Stage,
    ThinkSplitter,
)
from gateway.tools import (
    SYNTAXES,
    BlockCalls,
    ContentSink,
    NamedCall,
    Output,
    RequiredCalls,
    ToolCall,
)

if TYPE_CHECKING:
    from gateway.config import GatewayConfig
    from gateway.protocol import ChatCompletionRequest

# chat template markers -> parser ("auto"), the first found wins
TOOL_MARKERS = (("<|channel|>", "harmony"), ("<arg_key>", "glm45"), ("<tool_call>", "hermes"),
                ("[TOOL_CALLS]", "mistral"), ("tool▁calls▁begin", "deepseek_v3"),
                ("<|tool_calls_section_begin|>", "kimi_k2"))
REASONING_MARKERS = (("<|channel|>", "harmony"), (THINK_CLOSE, "think"))
# the text of each parser's markers: those that are special tokens (dropped when the worker
# decodes its text) are put back from the token ids
PARSER_MARKERS = {
    "think": (THINK_OPEN, THINK_CLOSE),
    "harmony": HARMONY_MARKERS,
    "hermes": ("<tool_call>", "</tool_call>"),
    "glm45": ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    "mistral": ("[TOOL_CALLS]", "[ARGS]"),
    "deepseek_v3": ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"),
    "kimi_k2": ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
}


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDef


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None      # an assistant's earlier calls
    tool_call_id: str | None = None                     # a tool result: the call it answers
    reasoning_content: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
            if len(parts) != len(self.content):
                raise ValueError("only text content parts are supported")
            return "".join(parts)
        return self.content or ""



@dataclass(frozen=True)
class OutputSettings:
    """How the served model's output is read: `reasoning` names the reasoning parser (None:
    off), `reasoning_end` the text that ends a reasoning section ("" when off; a constraint's
    `after`), `tool_parser` the tool-call syntax parser (None: tools are refused in auto mode),
    `markers` the special tokens (id -> text) of those parsers' markers, `tokenizer` the one
    whose chat template tells whether a request's prompt opens (or closes) the reasoning."""
    reasoning: str | None = None
    reasoning_end: str = ""
    tool_parser: str | None = None
    markers: tuple[tuple[int, str], ...] = ()
    tokenizer: Tokenizer | None = field(default=None, compare=False, repr=False)
    _opens: dict[str, str] = field(default_factory=dict, compare=False, repr=False)   # probe cache


def _pick(flag: str, template: str, table: tuple[tuple[str, str], ...]) -> str | None:
    if flag == "none":
        return None
    if flag != "auto":
        return flag
    return next((name for marker, name in table if marker in template), None)


def output_settings(config: GatewayConfig, tok: Tokenizer) -> OutputSettings:
    """The served model's settings from the gateway's flags (`reasoning_parser`,
    `tool_call_parser`: a parser's name, "none", or "auto": from the chat template's markers)."""
    template = tok.chat_template or ""
    reasoning = _pick(config.reasoning_parser, template, REASONING_MARKERS)
    tools = _pick(config.tool_call_parser, template, TOOL_MARKERS)
    end = {"think": THINK_CLOSE, "harmony": HARMONY_FINAL}.get(reasoning or "", "")
    markers: dict[int, str] = {}
    for name in (reasoning, tools):
        for text in PARSER_MARKERS.get(name or "", ()):
            tid = tok.token_to_id(text)
            if tid is not None and tok.decode([tid]) == "":
                markers[tid] = text
    return OutputSettings(reasoning, end, tools, tuple(sorted(markers.items())), tok)


def render_chat(tok: Tokenizer, body: ChatCompletionRequest) -> str:
    """The conversation as the chat template renders it, with the generation prompt: tools
    (unless tool_choice is "none"), earlier tool calls and tool results, and the request's
    chat_template_kwargs (and reasoning_effort) as template variables.  Raises ValueError."""
    messages = [_message(m) for m in body.messages]
    tools = offered_tools(body)
    return tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools or None,
                                   **template_kwargs(body))


def _message(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role,
                           "content": None if m.content is None and m.tool_calls else m.text()}
    for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
        if (value := getattr(m, key)) is not None:
            out[key] = value
    return out


def offered_tools(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The tools the model is shown: none when tool_choice is "none" (as OpenAI)."""
    if not body.tools or body.tool_choice == "none":
        return []
    out = []
    for t in body.tools:            # the named fields only (extras are reported, not rendered)
        fn = {k: v for k in ("name", "description", "parameters", "strict")
              if (v := getattr(t.function, k)) is not None}
        out.append({"type": "function", "function": fn})
    return out


MAX_PROBES = 256              # distinct chat_template_kwargs whose generation prompt is remembered
TEMPLATE_OWN = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"})


def template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    """The request's extra chat template variables; raises ValueError for one the gateway sets."""
    kwargs = dict(body.chat_template_kwargs or {})
    if clash := sorted(TEMPLATE_OWN & set(kwargs)):
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(clash)}")
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    return kwargs


def reasoning_mode(settings: OutputSettings, body: ChatCompletionRequest) -> str:
    """"off", "start" (the output may open a reasoning section) or "inside" (the prompt opened
    it): off without a reasoning parser, or when the request's chat template variables make the
    generation prompt close the section already (Qwen3's enable_thinking=false, DeepSeek's
    thinking=false)."""
    if settings.reasoning is None:
        return "off"
    if settings.reasoning != "think" or settings.tokenizer is None:
        return "start"
    try:
        kwargs = template_kwargs(body)
    except ValueError:      # refused where the prompt is rendered (render_chat)
        return "start"
    key = json.dumps(kwargs, sort_keys=True, default=str)
    if key not in settings._opens:
        if len(settings._opens) >= MAX_PROBES:      # clients choose the kwargs: keep it bounded
            settings._opens.clear()
        try:
            tail = settings.tokenizer.apply_chat_template([{"role": "user", "content": "?"}], True, **kwargs)
        except Exception:   # a template that refuses the probe: read the output as it comes
            tail = ""
        tail = tail.rstrip()
        settings._opens[key] = "off" if tail.endswith(THINK_CLOSE) else \
            "inside" if tail.endswith(THINK_OPEN) else "start"
    return settings._opens[key]


def reasoning_end(settings: OutputSettings, body: ChatCompletionRequest) -> str:
    """The marker after which this request's constraint applies ("" : from the first token)."""
    return settings.reasoning_end if reasoning_mode(settings, body) != "off" else ""


class ChoiceReader:
    """One choice's output read as it streams: `feed` each Tokens message (its text and token
    ids), `finish` once at the end; `take` returns what became final since the last take (a
    stream delta), `message` the whole (the response's message)."""

    def __init__(self, first: Stage, out: Output, tok: Tokenizer, markers: dict[int, str], reasoning: bool,
                 max_calls: int | None = None):
        self.first, self.out, self.tok, self.markers = first, out, tok, markers
        self.reasoning = reasoning
        self.max_calls = max_calls        # parallel_tool_calls=false: the first call only
        self.finished = False
        self._sent_reasoning = self._sent_content = 0
        self._sent_args: list[int] = []

    def feed(self, text: str, ids: Sequence[int]) -> None:
        self.first.feed(self._with_markers(text, ids))

    def _with_markers(self, text: str, ids: Sequence[int]) -> str:
        """The message's text with its marker tokens put back (the worker's text skips special
        tokens).  A worker message carries one token (its text may include text held back from
        earlier tokens, which precedes it); one with several is decoded again around the markers."""
        if not any(t in self.markers for t in ids):
            return text
        if len(ids) == 1:
            return text + self.markers[ids[0]]
        parts: list[str] = []
        run: list[int] = []
        for t in ids:
            if t in self.markers:
                parts += [self.tok.decode(run), self.markers[t]]
                run = []
            else:
                run.append(t)
        return "".join(parts) + self.tok.decode(run)

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.first.finish()

    def take(self) -> dict[str, Any]:
        """The delta since the last take: reasoning_content, content, tool_calls (OpenAI's
        stream shape: a call's first delta has its index, id, type and name)."""
        out, delta = self.out, dict[str, Any]()
        if len(out.reasoning) > self._sent_reasoning:
            delta["reasoning_content"] = out.reasoning[self._sent_reasoning:]
            self._sent_reasoning = len(out.reasoning)
        if len(out.content) > self._sent_content:
            delta["content"] = out.content[self._sent_content:]
            self._sent_content = len(out.content)
        calls = []
        for i, call in enumerate(self.calls):
            if i == len(self._sent_args):
                calls.append({"index": i, "id": call.id, "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
                self._sent_args.append(len(call.arguments))
            elif len(call.arguments) > self._sent_args[i]:
                calls.append({"index": i, "function": {"arguments": call.arguments[self._sent_args[i]:]}})
                self._sent_args[i] = len(call.arguments)
        if calls:
            delta["tool_calls"] = calls
        return delta

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.out.content or None}
        if self.reasoning:
            msg["reasoning_content"] = self.out.reasoning or None
        if self.calls:
            msg["tool_calls"] = [c.as_openai() for c in self.calls]
        return msg

    @property
    def calls(self) -> list[ToolCall]:
        """The calls the client gets: with parallel_tool_calls=false only the first one the
        model made (tool_choice auto; "required" enforces it in the grammar)."""
        return self.out.calls[:self.max_calls] if self.max_calls is not None else self.out.calls

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" for a choice that stopped having made calls."""
        return "tool_calls" if reason == "stop" and self.calls else reason


def choice_reader(settings: OutputSettings, body: ChatCompletionRequest) -> ChoiceReader | None:
    """A fresh reader for one choice of `body`, or None when its output is plain content (no
    reasoning parser on, no tools): then the response is built as before."""
    out, tok = Output(), settings.tokenizer
    if tok is None:
        return None
    mode = reasoning_mode(settings, body)
    tail: Stage = _tool_stage(settings, body, out)
    harmony = "harmony" in (settings.reasoning, settings.tool_parser)
    if harmony:
        first: Stage = HarmonySplitter(out, tail, calls=_tool_mode(body) == "auto")
    elif mode != "off":
        first = ThinkSplitter(out, tail, inside=mode == "inside")
    elif isinstance(tail, ContentSink):
        return None
    else:
        first = tail
    return ChoiceReader(first, out, tok, dict(settings.markers), reasoning=harmony or mode != "off",
                        max_calls=None if body.parallel_tool_calls else 1)


def _tool_mode(body: ChatCompletionRequest) -> str | None:
    if not offered_tools(body):
        return None
    if isinstance(body.tool_choice, dict):
        return "named"
    return "required" if body.tool_choice == "required" else "auto"


def _tool_stage(settings: OutputSettings, body: ChatCompletionRequest, out: Output) -> Stage:
    mode = _tool_mode(body)
    if mode == "named":
        assert isinstance(body.tool_choice, dict)
        return NamedCall(out, str((body.tool_choice.get("function") or {}).get("name", "")))
    if mode == "required":
        return RequiredCalls(out)
    if mode == "auto" and settings.tool_parser in SYNTAXES:
        schemas = {t.function.name: t.function.parameters or {} for t in body.tools or ()}
        return BlockCalls(out, SYNTAXES[settings.tool_parser], schemas)
    return ContentSink(out)
