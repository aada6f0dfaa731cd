"""Reading one choice's output as it streams: the `ChoiceReader` that splits it into
reasoning (gateway/reasoning.py), content and tool calls (gateway/tools.py) for the response
message and its stream deltas, and `choice_reader`, which builds one for a choice of a chat
request from the served model's `OutputSettings` (gateway/chat.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.tokenizer import Tokenizer
from gateway.chat import OutputSettings, offered_tools, reasoning_mode
from gateway.reasoning import HarmonySplitter, Stage, ThinkSplitter
from gateway.structured import sources
from gateway.tool_choice import named_tool, tool_mode
from gateway.tool_parsers import SYNTAXES
from gateway.tools import BlockCalls, ContentSink, NamedCall, Output, RequiredCalls, ToolCall

if TYPE_CHECKING:
    from gateway.protocol import ChatCompletionRequest


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
            delta["reasoning_content"] = out.reasoning.since(self._sent_reasoning)
            self._sent_reasoning = len(out.reasoning)
        if len(out.content) > self._sent_content:
            delta["content"] = out.content.since(self._sent_content)
            self._sent_content = len(out.content)
        calls, made = [], self.calls
        # only the last call sent may still grow (the stages add calls whole, or grow the last):
        # starting there keeps a take O(new text), not O(calls so far)
        for i in range(max(0, len(self._sent_args) - 1), len(made)):
            call = made[i]
            if i == len(self._sent_args):
                calls.append({"index": i, "id": call.id, "type": "function",
                              "function": {"name": call.name, "arguments": str(call.arguments)}})
                self._sent_args.append(len(call.arguments))
            elif len(call.arguments) > self._sent_args[i]:
                calls.append({"index": i, "function": {"arguments": call.arguments.since(self._sent_args[i])}})
                self._sent_args[i] = len(call.arguments)
        if calls:
            delta["tool_calls"] = calls
        return delta

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": str(self.out.content) or None}
        if self.reasoning:
            msg["reasoning_content"] = str(self.out.reasoning) or None
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
        tools = _tool_mode(body)
        # named, required, or a response_format: the grammar constrains the final channel alone, so
        # nothing else reaches the call or the answer (commentary preambles are content beside a
        # call, reasoning beside a constrained answer, which must stay what the grammar allowed)
        aside = "content" if tools in ("named", "required") else "reasoning" if sources(body) else None
        first: Stage = HarmonySplitter(out, tail, calls=tools == "auto", aside=aside)
    elif mode != "off":
        first = ThinkSplitter(out, tail, inside=mode == "inside")
    elif isinstance(tail, ContentSink):
        return None
    else:
        first = tail
    return ChoiceReader(first, out, tok, dict(settings.markers), reasoning=harmony or mode != "off",
                        max_calls=None if body.parallel_tool_calls else 1)


def _tool_mode(body: ChatCompletionRequest) -> str:
    """The request's tool_choice mode ("none" when no tool is offered to the model)."""
    return tool_mode(body) if offered_tools(body) else "none"


def _tool_stage(settings: OutputSettings, body: ChatCompletionRequest, out: Output) -> Stage:
    mode = _tool_mode(body)
    if mode == "named":
        return NamedCall(out, named_tool(body) or "")
    if mode == "required":
        return RequiredCalls(out, [t.function.name for t in body.tools or ()])
    if mode == "auto" and settings.tool_parser in SYNTAXES:
        schemas = {t.function.name: t.function.parameters or {} for t in body.tools or ()}
        return BlockCalls(out, SYNTAXES[settings.tool_parser], schemas)
    return ContentSink(out)
