"""A Responses request turned into the chat completion request it is served as, so admission,
the tool grammar, the output reader, structured outputs and migration are chat's:

    instructions                       a system message, first
    input "text"                       a user message
    {role, content}                    a message of that role (text parts joined)
    {type: function_call, ...}         a tool call of the assistant message before it (or of a new one)
    {type: function_call_output, ...}  a tool message answering that call
    {type: reasoning, content}         the reasoning_content of the assistant message that follows it
    tools [{type: function, name, ...}]  tools [{type: function, function: {name, ...}}]
    tool_choice {type: function, name}   tool_choice {type: function, function: {name}}
    text.format                        response_format (json_object, json_schema)

Anything else (built-in tools, images, files, other item kinds) is refused with 400 naming its
path, e.g. `input[2].content[0].type`; fields nobody defines are named back."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from gateway.admission import InvalidField
from gateway.errors import shown
from gateway.responses_request import ResponsesChat, ResponsesRequest
from gateway.tool_choice import MAX_TOOLS, TOOL_CHOICES

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
# keys an echoed-back item or part carries that change nothing in the prompt
MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
PART_KEYS = frozenset({"type", "text", "annotations", "logprobs"})
CALL_KEYS = frozenset({"type", "call_id", "name", "arguments", "id", "status"})
OUTPUT_KEYS = frozenset({"type", "call_id", "output", "id", "status"})
REASONING_KEYS = frozenset({"type", "id", "summary", "content", "encrypted_content", "status"})
FUNCTION_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
# a function tool's fields that only a neutral value leaves without effect
FUNCTION_NEUTRAL: dict[str, tuple[Any, ...]] = {"defer_loading": (None, False), "async": (None, False),
                                                "allowed_callers": (None, ["direct"]), "output_schema": (None,)}
JSON_SCHEMA_KEYS = frozenset({"type", "name", "schema", "strict", "description"})
INDEX = re.compile(r"\[\d+\]")          # a path's indices, as the ignored fields name them
BUILT_IN = "this server runs no built-in tools; offer function tools (type function) and run them yourself"


def to_chat(body: ResponsesRequest, max_messages: int) -> ResponsesChat:
    """The chat request `body` is served as.  Raises InvalidField (400) naming the field at
    fault: an item or tool this server cannot take, more items than `max_messages`, a malformed one."""
    body.check()
    unread = body.ignored_fields()
    messages = _messages(body, max_messages, unread)
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "stream": bool(body.stream),
                              "source": body, "unread": unread}
    for name, value in (("max_completion_tokens", body.max_output_tokens), ("temperature", body.temperature),
                        ("top_p", body.top_p), ("parallel_tool_calls", body.parallel_tool_calls),
                        ("reasoning_effort", (body.reasoning or {}).get("effort"))):
        if value is not None:
            fields[name] = value
    if body.tools:
        fields["tools"] = _tools(body.tools, unread)
    if body.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(body.tool_choice)
    if (rf := _response_format(body.text, unread)) is not None:
        fields["response_format"] = rf
    try:
        return ResponsesChat.model_validate(fields)
    except ValidationError as e:      # a value of the right JSON type the chat body still refuses
        first = e.errors()[0]
        raise InvalidField("input", f"the request cannot be served as a chat: {first.get('msg')}",
                           "invalid_request") from None


def _messages(body: ResponsesRequest, max_messages: int, unread: list[str]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]]
    if body.input is None:
        raise InvalidField("input", "input is required: a string, or a list of input items", "invalid_request")
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    if not items:
        raise InvalidField("input", "input is empty: send a string or at least one item", "invalid_request")
    count = len(items) + (body.instructions is not None)
    if count > max_messages:
        raise InvalidField("input", f"the request has {count} input items (instructions count as one); at most "
                           f"{max_messages} are allowed", "out_of_range")
    out = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    Conversation(out, unread).add_all(items)
    return out


class Conversation:
    """Chat messages built item by item: function calls join the assistant message before them,
    a reasoning item waits for the assistant message or call it belongs to."""

    def __init__(self, out: list[dict[str, Any]], unread: list[str]) -> None:
        self.out, self.unread = out, unread
        self.calls: set[str] = set()           # call_ids of the function calls so far
        self.reasoning: str | None = None      # a reasoning item's text, waiting for its message
        self.reasoning_at = ""

    def add_all(self, items: list[dict[str, Any]]) -> None:
        for i, item in enumerate(items):
            self.add(f"input[{i}]", item)
        if self.reasoning is not None:
            raise InvalidField(self.reasoning_at, f"{self.reasoning_at}: a reasoning item must be followed by the "
                               "assistant message or function call it came with", "invalid_request")

    def add(self, at: str, item: dict[str, Any]) -> None:
        kind = item.get("type", "message")
        if kind == "message":
            self._message(at, item)
        elif kind == "function_call":
            self._call(at, item)
        elif kind == "function_call_output":
            self._output(at, item)
        elif kind == "reasoning":
            self._reasoning(at, item)
        else:
            raise InvalidField(f"{at}.type", f"{at}: input items of type {shown(str(kind))} are not supported "
                               f"(message, function_call, function_call_output, reasoning); {BUILT_IN}",
                               "unsupported")

    def _message(self, at: str, item: dict[str, Any]) -> None:
        role = item.get("role")
        if role not in ROLES:
            raise InvalidField(f"{at}.role", f"{at}.role must be one of {', '.join(ROLES)}", "invalid_request")
        self._unread(at, item, MESSAGE_KEYS)
        msg: dict[str, Any] = {"role": role, "content": self._text(f"{at}.content", item.get("content"))}
        if role == "assistant":
            self._take_reasoning(msg)
        elif self.reasoning is not None:
            raise InvalidField(self.reasoning_at, f"{self.reasoning_at}: a reasoning item must be followed by the "
                               "assistant message or function call it came with", "invalid_request")
        self.out.append(msg)

    def _call(self, at: str, item: dict[str, Any]) -> None:
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise InvalidField(f"{at}.{key}", f"{at}: a function_call needs {key} (a string)", "invalid_request")
        self._unread(at, item, CALL_KEYS)
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        self.calls.add(item["call_id"])
        last = self.out[-1] if self.out else None
        if self.reasoning is None and last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
            return
        msg: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        self._take_reasoning(msg)
        self.out.append(msg)

    def _output(self, at: str, item: dict[str, Any]) -> None:
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or call_id not in self.calls:
            raise InvalidField(f"{at}.call_id", f"{at}: a function_call_output answers a function_call item "
                               f"before it in input; none has call_id {shown(str(call_id))}", "invalid_request")
        self._unread(at, item, OUTPUT_KEYS)
        self.out.append({"role": "tool", "tool_call_id": call_id,
                         "content": self._text(f"{at}.output", item.get("output"))})

    def _reasoning(self, at: str, item: dict[str, Any]) -> None:
        if item.get("encrypted_content") is not None:
            raise InvalidField(f"{at}.encrypted_content", f"{at}: encrypted reasoning is not supported: this server "
                               "cannot read it (send the reasoning item's content)", "unsupported")
        self._unread(at, item, REASONING_KEYS)
        parts = item.get("content") or item.get("summary") or []
        self.reasoning = self._text(f"{at}.content", parts, ("reasoning_text", "summary_text"))
        self.reasoning_at = at

    def _take_reasoning(self, msg: dict[str, Any]) -> None:
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
            self.reasoning = None

    def _text(self, at: str, content: Any, kinds: tuple[str, ...] = TEXT_PARTS) -> str:
        """A content string, or its text parts joined; refuses images, files and audio by path."""
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise InvalidField(at, f"{at} must be a string or a list of content parts", "invalid_request")
        texts, where = [], INDEX.sub("[]", at)
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in kinds or not isinstance(part.get("text"), str):
                raise InvalidField(f"{at}[{j}].type", f"{at}[{j}]: only text parts ({', '.join(kinds)}) are "
                                   f"supported, not {shown(str(kind))}: this server reads text only",
                                   "unsupported")
            self.unread += [f"{where}[].{k}" for k in part if k not in PART_KEYS]
            texts.append(part["text"])
        return "".join(texts)

    def _unread(self, at: str, item: dict[str, Any], known: frozenset[str]) -> None:
        self.unread += [f"input[].{k}" for k in item if k not in known]


def _tools(tools: list[dict[str, Any]], unread: list[str]) -> list[dict[str, Any]]:
    if len(tools) > MAX_TOOLS:
        raise InvalidField("tools", f"the request offers {len(tools)} tools; at most {MAX_TOOLS} are allowed",
                           "out_of_range")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type")
        if kind != "function":
            raise InvalidField(f"tools[{i}].type", f"tools[{i}]: the tool type {shown(str(kind))} is not "
                               f"supported: {BUILT_IN}", "unsupported")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise InvalidField(f"tools[{i}].name", f"tools[{i}]: a function tool needs a name", "invalid_request")
        for key, neutral_values in FUNCTION_NEUTRAL.items():
            if key in t and t[key] not in neutral_values:
                raise InvalidField(f"tools[{i}].{key}", f"tools[{i}].{key} is not supported", "unsupported")
        unread += [f"tools[].{k}" for k in t if k not in FUNCTION_KEYS and k not in FUNCTION_NEUTRAL]
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                     if t.get(k) is not None}})
    return out


def _tool_choice(tc: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(tc, str):
        if tc not in TOOL_CHOICES:
            raise InvalidField("tool_choice", f"tool_choice {shown(tc)} is not one of {', '.join(TOOL_CHOICES)} "
                               'or {"type": "function", "name": ...}', "invalid_request")
        return tc
    if tc.get("type") != "function":
        raise InvalidField("tool_choice.type", f"tool_choice of type {shown(str(tc.get('type')))} is not "
                           f'supported (none, auto, required or {{"type": "function", "name": ...}}): {BUILT_IN}',
                           "unsupported")
    if not isinstance(tc.get("name"), str):
        raise InvalidField("tool_choice.name", 'a function tool_choice is {"type": "function", "name": ...}',
                           "invalid_request")
    return {"type": "function", "function": {"name": tc["name"]}}


def _response_format(text: dict[str, Any] | None, unread: list[str]) -> dict[str, Any] | None:
    """text.format as chat's response_format (None: free text)."""
    text = text or {}
    unread += [f"text.{k}" for k in text if k not in ("format", "verbosity")]
    if text.get("verbosity") not in (None, "medium"):
        raise InvalidField("text.verbosity", "text.verbosity other than medium is not supported", "unsupported")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema" or not isinstance(fmt, dict):
        raise InvalidField("text.format.type", f"text.format of type {shown(str(kind))} is not supported (text, "
                           "json_object, json_schema)", "unsupported")
    if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
        raise InvalidField("text.format", 'text.format json_schema needs "name" (a string) and "schema" (an '
                           "object)", "invalid_constraint")
    unread += [f"text.format.{k}" for k in fmt if k not in JSON_SCHEMA_KEYS]
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                   if fmt.get(k) is not None}}
