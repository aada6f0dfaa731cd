"""Chat messages, tools and how the served model's chat is read: the message and tool models
of a chat request, the conversation rendered through the chat template (tools, tool calls and
tool results too), and the output settings of the served model (reasoning parser, tool-call
parser: named by flag, or "auto" from the chat template's markers).  gateway/reader.py reads
each choice's output with them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from engine.chat_tokens import RenderedChat
from engine.tokenizer import Tokenizer
from gateway.reasoning import (
    HARMONY_FINAL,
    HARMONY_MARKERS,
    THINK_CLOSE,
    THINK_OPEN,
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


def chat_prompt(tok: Tokenizer, body: ChatCompletionRequest) -> RenderedChat:
    """`render_chat`'s text with the spans of the client's text in it, for encoding it as text
    (engine/chat_tokens.py).  Raises ValueError, also for a control token's text in client text
    that the template cannot keep apart from its own structure."""
    messages = [_message(m) for m in body.messages]
    tools = offered_tools(body)
    return tok.render_chat(messages, add_generation_prompt=True, tools=tools or None, **template_kwargs(body))


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
        mode = "off" if tail.endswith(THINK_CLOSE) else "inside" if tail.endswith(THINK_OPEN) else "start"
        settings._opens[key] = mode     # another thread may clear the cache: return our own
        return mode
    return settings._opens.get(key, "start")


def reasoning_end(settings: OutputSettings, body: ChatCompletionRequest) -> str:
    """The marker after which this request's constraint applies ("" : from the first token).

    With `think` the grammar waits only when the prompt has opened the reasoning ("inside"):
    where the output may or may not open it ("start"), a model that answers without thinking
    would never write the marker and its output would go unconstrained, so the grammar applies
    from the first token (a constrained request gets no reasoning section there).  Harmony's
    marker is the final channel's header, which every answer of the model writes.  A request
    that ends before its marker ends with an error (engine/stop.py), never unconstrained."""
    mode = reasoning_mode(settings, body)
    if mode == "off" or (settings.reasoning == "think" and mode != "inside"):
        return ""
    return settings.reasoning_end
