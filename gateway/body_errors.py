"""What a client is told of a request body the framework could not take (FastAPI's
RequestValidationError): all 400, as OpenAI and vLLM answer them (never 422).

- not a JSON object sent as JSON (no body, another Content-Type, an array): `invalid_body`,
  "expected a JSON object with Content-Type: application/json" and what came instead.  A body
  sent under another Content-Type is not read as JSON even when it parses: a browser page may
  send text/plain or a form to the gateway from any site without asking first (no CORS
  preflight), and a generation must not start that way;
- JSON that does not parse: `invalid_json` with the position in words;
- a field of the wrong type or missing: `schema`, `param` naming the field.

Client-supplied names in a field's path (a dict key) are cut (gateway/errors.py `shown`).
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from gateway.errors import MAX_SHOWN_CHARS, shown

EXPECTED = "expected a JSON object with Content-Type: application/json"
JSON_TYPES = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", dict: "an object",
              list: "an array", type(None): "null"}


def refusal(errors: Sequence[Any], body: Any, content_type: str | None,
            unions: frozenset[str] = frozenset()) -> tuple[str, str, str | None]:
    """(code, message, param) of pydantic's `errors` of a request; `body`: the body as FastAPI
    had it (the JSON text for a decode error), `content_type`: the request's, `unions`: the
    model's fields whose type is a union (their errors name the members in the path)."""
    first = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return "invalid_json", _json_position(body, loc[1] if len(loc) > 1 else None, first), None
    path = loc[1:] if loc[:1] == ("body",) else loc
    if not path:
        return "invalid_body", f"{EXPECTED}: {_what_came(first, body, content_type)}", None
    field = _path(path[:1])
    if path[0] in unions and len(path) > 1:
        # one error per member of the union, each under the member's name: say which were tried
        # and, of the deepest, what the value held where it failed
        mine = [tuple(e.get("loc", ()))[len(loc) - len(path):] for e in errors]
        mine = [m for m in mine if m[:1] == path[:1] and len(m) > 1]
        members = list(dict.fromkeys(str(m[1]) for m in mine))
        deepest = max((e for e in errors if tuple(e.get("loc", ()))[len(loc) - len(path):][:1] == path[:1]),
                      key=lambda e: len(e.get("loc", ())))
        rest = tuple(deepest["loc"])[len(loc) - len(path) + 2:]
        inner = f"; {_path(rest, field)} is {_got(deepest)}" if rest else ""
        return "schema", f"{field}: {_got(first)} fits none of its types ({', '.join(members)}){inner}", field
    where = _path(path)
    return "schema", f"{where}: {first.get('msg', 'invalid value')}{_got_suffix(first)}", where


def _json_position(body: Any, pos: Any, error: Any) -> str:
    why = (error.get("ctx") or {}).get("error", "not valid JSON")
    text = body.decode("utf-8", "replace") if isinstance(body, bytes | bytearray) else body
    if not isinstance(pos, int) or not isinstance(text, str):
        return f"invalid JSON: {why}"
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return f"invalid JSON at line {line}, column {column} (character {pos}): {why}"


def _what_came(error: Any, body: Any, content_type: str | None) -> str:
    kind = (content_type or "").split(";")[0].strip().lower()
    if error.get("type") == "missing" or body in (None, b"", ""):
        return "the request has no body"
    if not kind:
        return "the request has no Content-Type (curl -d needs -H 'Content-Type: application/json')"
    if kind != "application/json" and not kind.endswith("+json"):
        return (f"its Content-Type is {shown(kind)} (curl -d sends application/x-www-form-urlencoded: "
                f"add -H 'Content-Type: application/json')")
    return f"the body is {JSON_TYPES.get(type(error.get('input')), 'something else')}"


def _path(path: Sequence[Any], out: str = "") -> str:
    """A field's path as a client writes it: messages[0].content, logit_bias['...'] (a key
    cut to MAX_SHOWN_CHARS)."""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and len(part) <= MAX_SHOWN_CHARS:
            out += f".{part}" if out else part
        else:
            out += f"[{shown(str(part))}]"
    return out


def _got(error: Any) -> str:
    """What the client sent, by its JSON type."""
    return JSON_TYPES.get(type(error.get("input")), "the value")


def _got_suffix(error: Any) -> str:
    if error.get("type") == "missing" or "input" not in error:
        return ""
    return f" (got {_got(error)})"


@functools.cache
def union_fields(model: type[BaseModel]) -> frozenset[str]:
    """The fields of `model` whose type is a union of more than one type besides None."""
    def members(annotation: Any) -> list[Any]:
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            return [a for a in typing.get_args(annotation) if a is not type(None)]
        return [annotation]
    return frozenset(name for name, f in model.model_fields.items() if len(members(f.annotation)) > 1)
