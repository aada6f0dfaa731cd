"""A Messages API conversation (`system` and `messages` of content blocks) as the chat messages
the chat template renders (gateway/chat.py `ChatMessage`), checked block by block:

    system (a string or text blocks)      -> a system message
    user:      text blocks                -> a user message
               tool_result blocks         -> one tool message each (tool_call_id = tool_use_id)
    assistant: text blocks                -> the message's content
               tool_use blocks            -> its tool_calls (the same ids; input as JSON arguments)
               thinking blocks            -> its reasoning_content (the template decides whether it shows)

Consecutive turns of one role are combined into one, as Anthropic does.  Image, document and
every other kind of block are refused with 400 naming the block; so is a final assistant turn
(Anthropic's prefill: the answer would continue it, which the chat template cannot render).
Text blocks of one message join with nothing between them, as a chat message's text parts do."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from gateway.admission import InvalidField
from gateway.chat import ChatMessage
from gateway.errors import shown
from gateway.fields import neutral

if TYPE_CHECKING:
    from gateway.messages_request import MessagesRequest

# the fields of each kind of block read here; others are named back (`ignored_block_fields`)
BLOCK_FIELDS = {
    "text": ("type", "text", "cache_control", "citations"),
    "tool_use": ("type", "id", "name", "input", "cache_control", "caller", "toolset_name"),
    "tool_result": ("type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"),
    "thinking": ("type", "thinking", "signature", "cache_control"),
}
# blocks of a turn, by role
ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking"), "system": ("text",)}
MEDIA = ("image", "document", "search_result", "container_upload")
ERROR_PREFIX = "Error: "            # a tool_result with is_error=true reaches the model so marked
Block = tuple[str, dict[str, Any]]  # (where it is in the request, the block)


def count_blocks(body: MessagesRequest) -> int:
    """Content blocks in the whole request (system, messages, and inside tool results), without
    reading any of them."""
    n = len(body.system) if isinstance(body.system, list) else 0
    for m in body.messages:
        blocks = m.content if isinstance(m.content, list) else [m.content]
        n += len(blocks)
        n += sum(len(b["content"]) for b in blocks if isinstance(b, dict) and isinstance(b.get("content"), list))
    return n


def conversation(body: MessagesRequest) -> list[ChatMessage]:
    """The chat messages of the request; raises Rejected/InvalidField (400) naming the block."""
    out: list[ChatMessage] = []
    if body.system is not None:
        out.append(ChatMessage(role="system", content=_text(list(_blocks(body.system, "system")), "system")))
    turns = list(_turns(body))
    if turns and turns[-1][0] == "assistant":
        last = f"messages[{len(body.messages) - 1}]"
        raise InvalidField(last, f"{last}: the conversation ends with an assistant turn; continuing it (prefill) "
                           "is not supported: end with a user turn", "unsupported")
    for role, blocks in turns:
        out += _user(blocks) if role == "user" else [_assistant(blocks) if role == "assistant"
                                                      else ChatMessage(role="system", content=_text(blocks, role))]
    return out


def _turns(body: MessagesRequest) -> Iterator[tuple[str, list[Block]]]:
    """(role, its blocks) with consecutive turns of one role combined."""
    role: str | None = None
    blocks: list[Block] = []
    for i, m in enumerate(body.messages):
        if m.role != role and role is not None:
            yield role, blocks
            blocks = []
        role = m.role
        blocks += _blocks(m.content, f"messages[{i}].content")
    if role is not None:
        yield role, blocks


def _blocks(content: str | list[Any], where: str) -> list[Block]:
    if isinstance(content, str):
        return [(where, {"type": "text", "text": content})]
    return [(f"{where}[{j}]", b) for j, b in enumerate(content)]


def _kind(where: str, block: dict[str, Any], allowed: tuple[str, ...]) -> str:
    """The block's type, once it is one `allowed` here; raises for any other."""
    if not isinstance(block, dict):         # a tool result's blocks are not typed by the model
        raise InvalidField(where, f"{where} must be a content block (an object)", "schema")
    kind = block.get("type")
    if not isinstance(kind, str):
        raise InvalidField(f"{where}.type", f"{where}: a content block needs a type (a string)", "schema")
    if kind in MEDIA:
        raise InvalidField(where, f"{where}: {kind} blocks are not supported: this server's model reads text only",
                           "unsupported")
    if kind not in allowed:
        raise InvalidField(where, f"{where}: {shown(kind)} blocks are not supported here (this turn takes "
                           f"{', '.join(allowed)} blocks)", "unsupported")
    if not neutral(block.get("citations"), (None, [])):
        raise InvalidField(f"{where}.citations", f"{where}.citations is not supported", "unsupported")
    if not neutral(block.get("toolset_name"), (None,)):
        raise InvalidField(f"{where}.toolset_name", f"{where}.toolset_name is not supported: this server has no "
                           "toolsets", "unsupported")
    return kind


def _string(where: str, block: dict[str, Any], key: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise InvalidField(f"{where}.{key}", f"{where}.{key} must be a string", "schema")
    return value


def _text(blocks: list[Block], role: str) -> str:
    for where, b in blocks:
        _kind(where, b, ROLE_BLOCKS[role] if role in ROLE_BLOCKS else ("text",))
    return "".join(_string(where, b, "text") for where, b in blocks)


def _user(blocks: list[Block]) -> list[ChatMessage]:
    """A user turn: its text as a user message, each tool result as a tool message, in order."""
    out: list[ChatMessage] = []
    text: list[str] = []
    for where, b in blocks:
        if _kind(where, b, ROLE_BLOCKS["user"]) == "text":
            text.append(_string(where, b, "text"))
            continue
        if text:
            out.append(ChatMessage(role="user", content="".join(text)))
            text = []
        out.append(ChatMessage(role="tool", tool_call_id=_string(where, b, "tool_use_id"),
                               content=_result(where, b)))
    if text or not out:
        out.append(ChatMessage(role="user", content="".join(text)))
    return out


def _result(where: str, block: dict[str, Any]) -> str:
    """A tool result's text: its content (a string or text blocks), marked when it is an error."""
    content = block.get("content", "")
    if isinstance(content, list):
        content = _text(_blocks(content, f"{where}.content"), "tool_result")
    elif not isinstance(content, str):
        raise InvalidField(f"{where}.content", f"{where}.content must be a string or text blocks", "schema")
    error = block.get("is_error", False)
    if not isinstance(error, bool):
        raise InvalidField(f"{where}.is_error", f"{where}.is_error must be a boolean", "schema")
    return ERROR_PREFIX + content if error else content


def _assistant(blocks: list[Block]) -> ChatMessage:
    text, thinking, calls = [], [], []
    for where, b in blocks:
        kind = _kind(where, b, ROLE_BLOCKS["assistant"])
        if kind == "text":
            text.append(_string(where, b, "text"))
        elif kind == "thinking":
            thinking.append(_string(where, b, "thinking"))
        else:
            calls.append(_call(where, b))
    return ChatMessage(role="assistant", content="".join(text) or None, tool_calls=calls or None,
                       reasoning_content="".join(thinking) or None)


def _call(where: str, block: dict[str, Any]) -> dict[str, Any]:
    """A tool_use block as an OpenAI tool call (the same id)."""
    arguments = block.get("input")
    if not isinstance(arguments, dict):
        raise InvalidField(f"{where}.input", f"{where}.input must be an object", "schema")
    if not neutral(block.get("caller"), (None, {"type": "direct"})):
        raise InvalidField(f"{where}.caller", f"{where}.caller other than direct is not supported: this server "
                           "runs no tools", "unsupported")
    return {"id": _string(where, block, "id"), "type": "function",
            "function": {"name": _string(where, block, "name"), "arguments": json.dumps(arguments, ensure_ascii=False)}}


def ignored_block_fields(body: MessagesRequest) -> list[str]:
    """The fields of the request's content blocks that no one defines, as paths."""
    out: list[str] = []
    for path, content in [("system[]", body.system)] + [("messages[].content[]", m.content) for m in body.messages]:
        for b in content if isinstance(content, list) else ():
            kind = b.get("type")
            known = BLOCK_FIELDS.get(kind, ()) if isinstance(kind, str) else ()
            out += [f"{path}.{k}" for k in b if known and k not in known]
            inner = b.get("content") if kind == "tool_result" else None
            for part in inner if isinstance(inner, list) else ():
                if isinstance(part, dict) and part.get("type") == "text":
                    out += [f"{path}.content[].{k}" for k in part if k not in BLOCK_FIELDS["text"]]
    return out
