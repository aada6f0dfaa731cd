"""Answers in the shapes of Anthropic's Messages API, read from a choice (gateway/choice.py): the
message (`MessagesFormatter.response`), its stream of named server-sent events (`message_events`),
and error bodies (`error_body`, whose code, status and message come from gateway/errors.py's table).

    message_start, ping,
      (content_block_start, content_block_delta..., content_block_stop) per block,
    message_delta (stop_reason, stop_sequence, usage), message_stop        -- or, on a failure, error

Blocks: the reasoning the reader split off (gateway/reader.py) as a `thinking` block (its
signature empty: no one can vouch for it but this server), the text, one `tool_use` per call.
usage: input_tokens are the prompt tokens the decode worker computed, cache_read_input_tokens
those its prefix cache held (Finish.cached_tokens), cache_creation_input_tokens 0 (the prefix
cache fills without being asked, and costs nothing more): their sum is the prompt's length."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.tokenizer import Tokenizer
from gateway.choice import Choice
from gateway.errors import ForwardError, public
from gateway.openai_format import Formatter, cached_tokens
from gateway.streaming import DoneEvent, ErrorEvent, Event, TokensEvent

# Anthropic's error types by HTTP status; another 4xx is invalid_request_error, another 5xx api_error
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               504: "timeout_error", 529: "overloaded_error"}
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}
MAX_CUTS = 64                        # where a cut tool input may be closed, tried from its end


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def error_body(code: str | Any, message: str, param: str | None = None, status: int | None = None) -> dict[str, Any]:
    """Anthropic's error body for the error table's `code` (gateway/errors.py), with the table's
    code and the field at fault (`param`) beside Anthropic's type and message."""
    entry = public(code, status)
    return {"type": "error", "error": {"type": error_type(status or entry.status), "message": message,
                                       "code": entry.code, "param": param}}


def stop_reason(c: Choice) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an ended choice: a stop string it matched is one of the
    request's stop_sequences (the only stop strings it sends); a stop token is the end of the turn."""
    reason = c.finish_reason or "stop"
    if reason in STOP_REASONS:
        return STOP_REASONS[reason], None
    matched = c.matched_stop
    return ("stop_sequence", matched) if isinstance(matched, str) and matched else ("end_turn", None)


def usage(c: Choice, cached: int, output: int) -> dict[str, Any]:
    return {"input_tokens": c.prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": output}


class MessagesFormatter(Formatter):
    """The message of one response (n is 1): its id, model, content blocks, stop and usage."""

    def __init__(self, model: str, tok: Tokenizer) -> None:
        super().__init__("chat", model, tok, None)
        self.id = f"msg_{uuid.uuid4().hex}"

    def message(self, c: Choice, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                use: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": use}

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        (c,) = choices
        if c.reader is not None:
            c.reader.finish()
        return self.message(c, blocks(c), stop_reason(c), usage(c, cached_tokens([c]), len(c.token_ids)))


def blocks(c: Choice) -> list[dict[str, Any]]:
    """The content blocks of an ended choice."""
    r = c.reader
    if r is None:
        return [{"type": "text", "text": c.text}] if c.text else []
    out: list[dict[str, Any]] = []
    if r.reasoning and len(r.out.reasoning):
        out.append({"type": "thinking", "thinking": str(r.out.reasoning), "signature": ""})
    if len(r.out.content):
        out.append({"type": "text", "text": str(r.out.content)})
    out += [{"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(str(call.arguments))}
            for call in r.calls]
    return out


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use.input: the object they are, or, for a call cut short by
    max_tokens, the object its complete members make (as the anthropic client's stream
    accumulator reads the same text)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = _closed_prefix(arguments)
    return value if isinstance(value, dict) else {}


def _closed_prefix(text: str) -> Any:
    """The longest prefix of `text` that ends a JSON value and parses once its open objects and
    arrays are closed (None: none does).  One scan; the last MAX_CUTS places are tried."""
    stack: list[str] = []
    cuts: deque[tuple[int, str]] = deque(maxlen=MAX_CUTS)
    in_string = escaped = False
    for k, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                cuts.append((k + 1, "".join(reversed(stack))))
            continue
        if ch == '"':
            in_string = True
            continue
        if ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and stack:
            stack.pop()
        elif not (ch.isalnum() or ch in ".+-"):
            continue
        cuts.append((k + 1, "".join(reversed(stack))))
    for end, closers in reversed(cuts):
        try:
            return json.loads(text[:end] + closers)
        except ValueError:
            continue
    return None


def sse_event(name: str, body: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(body)}\n\n"


class BlockStream:
    """The content blocks of a streamed message, opened and closed in order: `add` a reader's
    delta (reasoning_content, content, tool_calls: gateway/reader.py `take`) or plain text,
    get the events it makes; `close` ends the open block."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None        # "thinking", "text" or "tool:N" (the reader's call index)

    def add(self, delta: dict[str, Any]) -> list[str]:
        pieces: list[tuple[str, dict[str, Any] | None, dict[str, Any] | None]] = []
        if text := delta.get("reasoning_content"):
            pieces.append(("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                           {"type": "thinking_delta", "thinking": text}))
        if text := delta.get("content"):
            pieces.append(("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls", ()):
            fn, key = call["function"], f"tool:{call['index']}"
            start = {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}} if "id" in call else None
            args = fn.get("arguments")
            pieces.append((key, start, {"type": "input_json_delta", "partial_json": args} if args else None))
        pieces.sort(key=lambda p: p[0] != self.open)       # what continues the open block comes first
        out: list[str] = []
        for key, start, piece in pieces:
            # only the reader's last call grows, and nothing comes between its pieces: a piece
            # without a start continues the open block
            assert key == self.open or start is not None, f"{key} continues after {self.open} began"
            if key != self.open:
                out += self.close()
                self.index, self.open = self.index + 1, key
                out.append(sse_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                             "content_block": start}))
            if piece is not None:
                out.append(sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                             "delta": piece}))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]


async def message_events(fmt: MessagesFormatter, c: Choice, events: asyncio.Queue[Event], first: Event,
                         on_error: Callable[[ForwardError], dict[str, object]],
                         on_done: Callable[[], None]) -> AsyncIterator[str]:
    """The named events of one streamed message (module docstring), from its choice's events,
    the first of them `first`.  A failure ends the stream with an `error` event of the body
    `on_error` makes; `on_done` runs when the stream completed."""
    start = fmt.message(c, [], (None, None), usage(c, c.cached_tokens or 0, 0))
    yield sse_event("message_start", {"type": "message_start", "message": start})
    yield sse_event("ping", {"type": "ping"})
    stream, item = BlockStream(), first
    while not isinstance(item, DoneEvent):
        if isinstance(item, ErrorEvent):
            yield sse_event("error", on_error(item.error))
            return
        if isinstance(item, TokensEvent):
            for e in stream.add(c.reader.take() if c.reader is not None else {"content": item.tokens.text}):
                yield e
        item = await events.get()
    if c.reader is not None:
        c.reader.finish()             # what it held back (a call block closed by the end) comes now
        for e in stream.add(c.reader.take()):
            yield e
    for e in stream.close():
        yield e
    reason, sequence = stop_reason(c)
    yield sse_event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                         "stop_sequence": sequence},
                                      "usage": usage(c, cached_tokens([c]), len(c.token_ids))})
    yield sse_event("message_stop", {"type": "message_stop"})
    on_done()
