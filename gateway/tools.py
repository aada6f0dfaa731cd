"""Tool calls in a chat's output: the syntaxes of the model families (parsers chosen by name),
and the stages that turn a choice's content into text and `tool_calls` while it streams.

A stage is fed the content text piece by piece (`feed`) and once more at the end (`finish`); it
writes what is final into an `Output`: content text (append-only) and tool calls (a call's
arguments only grow).  Text that might still turn out to be part of a marker is held back.
A block whose call does not parse as strict JSON (RFC 8259: no NaN or Infinity) stays content.

The syntaxes (facts from the families' chat templates and vLLM's parsers):
- hermes (Qwen2.5/Qwen3, Tandem's own): `<tool_call>{"name": N, "arguments": {...}}</tool_call>`
- mistral: `[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]`, or (newer tokenizers)
  `[TOOL_CALLS]N[ARGS]{...}` per call; it runs to the end of the output
- deepseek_v3: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N\\n```json\\n{...}
  \\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; V3.1 puts N before the separator and the bare
  JSON after it
- glm45: `<tool_call>N\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>` (V is
  JSON unless the parameter's schema says string)
- kimi_k2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.N:0
  <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>`
- harmony (gpt-oss): commentary messages addressed `to=functions.N` (gateway/reasoning.py)
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

TOOL_PARSERS = ("hermes", "mistral", "deepseek_v3", "glm45", "kimi_k2", "harmony")


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""               # a JSON object's text; grows while the call streams

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Output:
    """What a choice's output has produced so far: only what is final (never taken back)."""
    reasoning: str = ""
    content: str = ""
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


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_not_json)    # strict: RFC 8259 has no NaN, Infinity


def decode(text: str, at: int | None = None) -> tuple[Any, int]:
    """The JSON value in `text` (all of it, whitespace aside; or the one starting at index `at`,
    with where it ends).  Raises ValueError for text that is not JSON (RFC 8259): also for NaN
    and ±Infinity, which Python's json takes (clients' parsers do not), and for nesting past the
    interpreter's recursion limit (json raises RecursionError for it: a model can be steered into
    `[[[[…`, and "does not parse" is what a reader does with such a block)."""
    try:
        return (_DECODER.decode(text), len(text)) if at is None else _DECODER.raw_decode(text, at)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def encode(value: Any) -> str | None:
    """`value` as JSON text, or None when it cannot be written as JSON: a number that decoded
    to infinity (`1e999`), or nesting too deep to write."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        return None


def call_arguments(value: Any) -> str | None:
    """A call's arguments as JSON text (a model may give the object or its text)."""
    if isinstance(value, str):
        try:
            value, _ = decode(value)
        except ValueError:
            return None
    return encode(value) if isinstance(value, dict) else None


Parsed = list[tuple[str, str, str | None]]        # (name, arguments JSON, id or None)
Schemas = dict[str, dict[str, Any]]               # tool name -> its parameters schema


def parse_hermes(block: str, schemas: Schemas) -> Parsed | None:
    try:
        obj, _ = decode(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = call_arguments(obj.get("arguments", obj.get("parameters", {})))
    return None if args is None else [(obj["name"], args, None)]


def parse_mistral(block: str, schemas: Schemas) -> Parsed | None:
    block = block.strip()
    if block.startswith("["):
        try:
            items, _ = decode(block)
        except ValueError:
            return None
        if not isinstance(items, list):
            return None
        out: Parsed = []
        for it in items:
            if not isinstance(it, dict) or not isinstance(it.get("name"), str):
                return None
            if (args := call_arguments(it.get("arguments", {}))) is None:
                return None
            out.append((it["name"], args, None))
        return out
    out = []
    for part in block.split("[TOOL_CALLS]"):
        name, sep, rest = part.partition("[ARGS]")
        if not sep or (args := call_arguments(rest.strip())) is None or not name.strip():
            return None
        out.append((name.strip(), args, None))
    return out


DS_BEGIN, DS_SEP, DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def spans(text: str, begin: str, end: str) -> Iterator[tuple[str, int]]:
    """Each text between `begin` and the next `end`, in order, with where that `end` is (found
    with str.find: linear in the text, whatever it holds; a regex with lazy groups and
    whitespace runs backtracks without bound on hostile output)."""
    i = 0
    while (start := text.find(begin, i)) >= 0:
        stop = text.find(end, start + len(begin))
        if stop < 0:
            return
        yield text[start + len(begin):stop], stop
        i = stop + len(end)


def _fenced(body: str) -> tuple[str, str] | None:
    """DeepSeek-V3's call body: a name, then its arguments in a ``` (or ```json) fence and
    nothing but whitespace after it."""
    head, fence, rest = body.partition("```")
    name = head.strip()
    if not fence or not name or any(c.isspace() for c in name):
        return None
    inner, close, tail = rest.removeprefix("json").rpartition("```")
    if not close or tail.strip():
        return None
    return name, inner.strip()


def parse_deepseek(block: str, schemas: Schemas) -> Parsed | None:
    out: Parsed = []
    for call, _ in spans(block, DS_BEGIN, DS_END):
        head, sep, body = call.partition(DS_SEP)
        if not sep:
            return None
        if head.strip() == "function":                    # V3: the name and a fenced JSON block
            fenced = _fenced(body)
            if fenced is None:
                return None
            name, raw = fenced
        else:                                             # V3.1: the name, then bare JSON
            name, raw = head.strip(), body
        if (args := call_arguments(raw)) is None:
            return None
        out.append((name, args, None))
    return out or None


def parse_glm45(block: str, schemas: Schemas) -> Parsed | None:
    cut = block.find("<arg_key>")
    name = (block if cut < 0 else block[:cut]).strip()
    if not name or "\n" in name:
        return None
    props = (schemas.get(name) or {}).get("properties") or {}
    args: dict[str, Any] = {}
    for key, raw in _glm_pairs(block):
        key = key.strip()
        if (props.get(key) or {}).get("type") == "string":
            args[key] = raw
            continue
        try:
            args[key], _ = decode(raw)
        except ValueError:
            args[key] = raw
    text = encode(args)
    return None if text is None else [(name, text, None)]


def _glm_pairs(block: str) -> Iterator[tuple[str, str]]:
    """Each <arg_key>k</arg_key> directly followed (whitespace aside) by <arg_value>v</arg_value>,
    in order and not overlapping (a value is all the text up to its close, as the families' own
    parsers read it).  Each search starts where the last one stopped: one pass over the block,
    whatever it holds (a value never closed ends the pairs; no later key can have one)."""
    i = 0
    while (start := block.find("<arg_key>", i)) >= 0:
        stop = block.find("</arg_key>", start)
        if stop < 0:
            return
        j = stop + len("</arg_key>")
        while j < len(block) and block[j].isspace():
            j += 1
        if not block.startswith("<arg_value>", j):
            i = j
            continue
        end = block.find("</arg_value>", j)
        if end < 0:
            return
        yield block[start + len("<arg_key>"):stop], block[j + len("<arg_value>"):end]
        i = end + len("</arg_value>")


KIMI_BEGIN, KIMI_ARGS, KIMI_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def parse_kimi(block: str, schemas: Schemas) -> Parsed | None:
    out: Parsed = []
    for call, _ in spans(block, KIMI_BEGIN, KIMI_END):
        ident, sep, raw = call.partition(KIMI_ARGS)
        ident = ident.strip()
        if not sep or not ident:
            return None
        name = ident.rsplit(":", 1)[0]
        name = name.split(".", 1)[1] if name.startswith("functions.") else name
        if (args := call_arguments(raw)) is None or not name:
            return None
        out.append((name, args, ident))
    return out or None


@dataclass(frozen=True)
class Syntax:
    start: str
    end: str | None                   # None: the calls run to the end of the output
    parse: Callable[[str, Schemas], Parsed | None]


SYNTAXES = {
    "hermes": Syntax("<tool_call>", "</tool_call>", parse_hermes),
    "mistral": Syntax("[TOOL_CALLS]", None, parse_mistral),
    "deepseek_v3": Syntax("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", parse_deepseek),
    "glm45": Syntax("<tool_call>", "</tool_call>", parse_glm45),
    "kimi_k2": Syntax("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", parse_kimi),
}


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
        self.out.calls += [ToolCall(ident or call_id(), name, args) for name, args, ident in calls]

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
    grammar's shape); each element becomes a call when it is complete.  What does not parse
    (an output cut short) stays content.  Each character is scanned once (braces counted
    outside strings); an element is decoded once, when its braces close."""

    def __init__(self, out: Output) -> None:
        self.out, self.buf = out, ""
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
        self.out.calls.append(ToolCall(call_id(), item["name"], args))
        self.done = end

    def finish(self) -> None:
        rest = self.buf[self.done:].strip().lstrip(",").strip()
        if rest and rest != "]":
            self.out.content += rest
        self.buf, self.done = "", 0
