"""The tool-call syntaxes of the model families, each a parser chosen by name: a call block's
text into (name, arguments, id) calls, or None when the block is not a call (it then stays
content).  A call's arguments are strict JSON (RFC 8259): text that Python's json would take
but a client's parser would not (NaN, Infinity), or that nests too deeply to decode, is not a
call.  Every parser finds its markers with str.find, in one pass over the block.

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


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
    to infinity (`1e999`), nesting too deep to write, or a string with a lone surrogate
    (`"\\ud800"` decodes to one; UTF-8 cannot carry it, and the response would fail to encode)."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except (ValueError, RecursionError):       # UnicodeEncodeError is a ValueError
        return None
    return text


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
