"""Tool calls in a chat's output: the stages that turn a choice's content into text and
`tool_calls` while it streams, reading calls in the served family's syntax
(gateway/tool_parsers.py) or in the shape a tool_choice's grammar gives the output.

A stage is fed the content text piece by piece (`feed`) and once more at the end (`finish`); it
writes what is final into an `Output`: content text (append-only) and tool calls (a call's
arguments only grow).  Text that might still turn out to be part of a marker is held back.
A block whose call does not parse as strict JSON (RFC 8259: no NaN or Infinity) stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.tool_parsers import SYNTAXES, Schemas, Syntax, call_arguments, decode

TOOL_PARSERS = (*SYNTAXES, "harmony")


class Text:
    """Append-only text: `+=` a piece costs the piece (`+=` on a str attribute copies the whole
    string: a stream of 128k tokens cost 7.3 s of the event loop), `since(n)` the text after
    character n costs the pieces after it, `str()` joins once."""

    __slots__ = ("_pieces", "_starts", "_len")

    def __init__(self, text: str = "") -> None:
        self._pieces: list[str] = []
        self._starts: list[int] = []      # where each piece starts
        self._len = 0
        self += text

    def __iadd__(self, piece: str) -> Text:
        if piece:
            self._starts.append(self._len)
            self._pieces.append(piece)
            self._len += len(piece)
        return self

    def __len__(self) -> int:
        return self._len

    def __str__(self) -> str:
        if len(self._pieces) > 1:
            self._pieces, self._starts = ["".join(self._pieces)], [0]
        return self._pieces[0] if self._pieces else ""

    def since(self, n: int) -> str:
        """The text from character `n` on."""
        if n >= self._len:
            return ""
        i = max(bisect_right(self._starts, n) - 1, 0)
        return self._pieces[i][n - self._starts[i]:] + "".join(self._pieces[i + 1:])

    def __eq__(self, other: object) -> bool:
        return str(self) == (str(other) if isinstance(other, Text) else other)

    def __repr__(self) -> str:
        return f"Text({str(self)!r})"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: Text = field(default_factory=Text)   # a JSON object's text; grows while the call streams

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": str(self.arguments)}}


@dataclass
class Output:
    """What a choice's output has produced so far: only what is final (never taken back)."""
    reasoning: Text = field(default_factory=Text)
    content: Text = field(default_factory=Text)
    calls: list[ToolCall] = field(default_factory=list)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def held_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of `text` that is the start of a marker (it may still become one)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class ContentSink:
    """Content text into `out.content`, trailing whitespace held until more text follows: at the
    end it is dropped when the output made tool calls (whitespace around them is not content),
    kept otherwise; the same however the text was cut into pieces."""

    def __init__(self, out: Output) -> None:
        self.out, self.ws = out, list[str]()      # the held whitespace, in pieces

    def feed(self, text: str) -> None:
        kept = text.rstrip()
        if not kept:
            self.ws.append(text)                  # a whitespace run is not copied per piece
            return
        self.out.content += "".join(self.ws) + kept
        self.ws = [text[len(kept):]]

    def finish(self) -> None:
        if not self.out.calls:
            self.out.content += "".join(self.ws)
        self.ws = []


class BlockCalls:
    """Tool calls in the model's own syntax (tool_choice "auto"): content outside the call
    blocks, each block parsed when it closes.  A block that does not parse stays content."""

    def __init__(self, out: Output, syntax: Syntax, schemas: Schemas) -> None:
        self.out, self.syntax, self.schemas = out, syntax, schemas
        self.content = ContentSink(out)
        self.buf, self.inside = "", False
        self.searched = 0                                 # buf[:searched] holds no whole marker

    def feed(self, text: str) -> None:
        self.buf += text
        while self.buf:
            marker = self.syntax.end if self.inside else self.syntax.start
            if marker is None:                            # inside a block that runs to the end
                return
            i = self.buf.find(marker, max(0, self.searched - len(marker) + 1))
            self.searched = len(self.buf)                 # a long block is scanned once, not per token
            if i >= 0:
                self._done(self.buf[:i], marker)
                self.buf, self.searched = self.buf[i + len(marker):], 0
                continue
            if not self.inside:
                keep = held_suffix(self.buf, [marker])
                self.content.feed(self.buf[:len(self.buf) - keep])
                self.buf, self.searched = self.buf[len(self.buf) - keep:], 0
            return

    def _done(self, text: str, marker: str) -> None:
        if not self.inside:
            self.content.feed(text)
            self.inside = True
            return
        self._block(text, closed=True)
        self.inside = False

    def _block(self, text: str, closed: bool) -> None:
        calls = self.syntax.parse(text.strip(), self.schemas)
        if calls is None:
            end = (self.syntax.end or "") if closed else ""
            self.content.feed(self.syntax.start + text + end)
            return
        taken = {c.id for c in self.out.calls}      # a model-given id (kimi_k2's) once per message
        for name, args, ident in calls:
            ident = ident if ident and ident not in taken else call_id()
            taken.add(ident)
            self.out.calls.append(ToolCall(ident, name, Text(args)))

    def finish(self) -> None:
        if self.inside:
            self._block(self.buf, closed=False)
        else:
            self.content.feed(self.buf)
        self.buf, self.inside, self.searched = "", False, 0
        self.content.finish()


class NamedCall:
    """tool_choice naming a function: the whole content is its arguments (the grammar made it
    that function's parameters object), streamed as it comes."""

    def __init__(self, out: Output, name: str) -> None:
        self.out, self.name = out, name

    def feed(self, text: str) -> None:
        if not text:
            return
        if not self.out.calls:
            self.out.calls.append(ToolCall(call_id(), self.name))
        self.out.calls[0].arguments += text

    def finish(self) -> None:
        pass


class RequiredCalls:
    """tool_choice "required": the content is a JSON array of {"name", "parameters"} (the
    grammar's shape); each element becomes a call when it is complete.  An element cut short
    (max_tokens) becomes a call at the end, as a named function's does: its name (complete, or
    the one tool of `names` its start can be), its parameters' text so far as the arguments;
    one cut before its name is known is dropped; neither is ever content.  What does not have
    the shape stays content.  Each character is scanned once (braces counted outside strings);
    an element is decoded once, when its braces close."""

    def __init__(self, out: Output, names: Sequence[str] = ()) -> None:
        self.out, self.buf, self.names = out, "", tuple(names)
        self.done = 0                     # buf[:done] became calls
        self.depth, self.in_string, self.escaped, self.failed = 0, False, False, False

    def feed(self, text: str) -> None:
        start = len(self.buf)
        self.buf += text
        for k in range(start, len(self.buf)):
            if self.failed:
                return
            c = self.buf[k]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c == "{":
                self.depth += 1
            elif c == "}":
                self.depth -= 1
                if self.depth == 0:
                    self._element(k + 1)

    def _element(self, end: int) -> None:
        i = self.done
        while i < end and (self.buf[i].isspace() or self.buf[i] in "[,"):
            i += 1
        try:
            item, stop = decode(self.buf, i)
        except ValueError:
            item, stop = None, end
        args = call_arguments(item.get("parameters", item.get("arguments", {}))) if isinstance(item, dict) \
            and isinstance(item.get("name"), str) else None
        if args is None or stop != end:
            self.failed = True            # not a call: the rest stays content
            return
        self.out.calls.append(ToolCall(call_id(), item["name"], Text(args)))
        self.done = end

    def finish(self) -> None:
        rest = self.buf[self.done:].strip().lstrip(",").strip()
        if not self.failed and rest != "]":
            ours, cut = partial_call(rest[1:] if rest.startswith("[") else rest, self.names)
            if cut is not None:
                self.out.calls.append(cut)
            rest = "" if ours else rest
        if rest and rest != "]":
            self.out.content += rest
        self.buf, self.done = "", 0


_HEAD = '{"name":"'
_PARAMETERS = re.compile(r'\s*,\s*"(?:parameters|arguments)"\s*:\s*')
_KEYS = (',"parameters":', ',"arguments":')


def partial_call(text: str, names: Sequence[str]) -> tuple[bool, ToolCall | None]:
    """What an element of a required tool_choice's array that was cut short (`text`: from its
    `{`) begins: (whether it is the start of `{"name": N, "parameters": ...`, the call when N
    is known: complete, or the one of `names` its start can be)."""
    text = text.lstrip()
    head = re.match(r'\{\s*"name"\s*:\s*"', text)
    if head is None:                                   # nothing, or cut before the name's first character
        return len(text) < 4 * len(_HEAD) and _HEAD.startswith(re.sub(r"\s+", "", text)), None
    end = _string_end(text, head.end())
    raw = text[head.end():end]
    if end == len(text):                               # cut inside the name
        prefix = _decoded(raw)
        fits = [n for n in names if prefix is not None and n.startswith(prefix)]
        return True, ToolCall(call_id(), fits[0]) if len(fits) == 1 else None
    name, after = _decoded(raw), text[end + 1:]
    params = _PARAMETERS.match(after)
    if name is None:
        return False, None
    if params is not None:
        return True, ToolCall(call_id(), name, Text(after[params.end():]))
    shown = re.sub(r"\s+", "", after) if len(after) < 64 else after
    return (True, ToolCall(call_id(), name)) if any(k.startswith(shown) for k in _KEYS) else (False, None)


def _string_end(text: str, start: int) -> int:
    """Where the JSON string whose characters start at `start` closes (len(text): it does not)."""
    k = start
    while k < len(text):
        if text[k] == "\\":
            k += 2
        elif text[k] == '"':
            return k
        else:
            k += 1
    return len(text)


def _decoded(raw: str) -> str | None:
    """The characters of a JSON string's body (a cut escape at its end dropped); None: not JSON."""
    for cut in range(min(6, len(raw)) + 1):
        try:
            value = json.loads('"' + raw[:len(raw) - cut] + '"')
        except ValueError:
            continue
        return value if isinstance(value, str) else None
    return None
