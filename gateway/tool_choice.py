"""What a chat request's `tool_choice` asks for: its mode ("none", "auto", "required" or a
named function), the checks of `tools` and `tool_choice` (400 naming the field), and the JSON
schema a required or named tool_choice puts on the output (gateway/structured.py compiles it):

    {"type": "function", "function": {"name": N}}   the output is N's arguments object
    "required"                                      a JSON array of calls [{"name": N, "parameters": {...}}, ...]
                                                    (one item at most when parallel_tool_calls is false)

gateway/reader.py turns those outputs into `tool_calls`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.constraint import MAX_SCHEMA_DEPTH, schema_depth
from gateway.admission import InvalidField
from gateway.chat import OutputSettings
from gateway.protocol import ChatCompletionRequest

if TYPE_CHECKING:
    from gateway.protocol import CompletionRequest

    Body = ChatCompletionRequest | CompletionRequest

TOOL_CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128                     # tools one request may offer (OpenAI's limit)
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# how far down the required schema puts each tool's parameters, as engine/constraint.py
# schema_depth counts: the array's schema, its items' (the anyOf adds none), the call object's
# (its properties map adds none), then the parameters: 3 levels above the tool's own
CALLS_DEPTH = 3


def tool_mode(body: Body) -> str:
    """"none", "auto", "required" or "named" (OpenAI's default: auto with tools, none without).
    "auto" without tools (absent or []) is "none": there is nothing to call.  Tools are a chat
    request's: a text completion's `tools`/`tool_choice` are unknown fields (ignored, and named
    in X-Tandem-Ignored-Fields), so its mode is "none"."""
    if not isinstance(body, ChatCompletionRequest):
        return "none"
    tc = body.tool_choice
    if tc is None or tc == "auto":
        return "auto" if body.tools else "none"
    return tc if isinstance(tc, str) else "named"


def named_tool(body: Body) -> str | None:
    """The function a named tool_choice asks for (None: not named)."""
    tc = body.tool_choice if isinstance(body, ChatCompletionRequest) else None
    return tc["function"]["name"] if isinstance(tc, dict) else None


def check_tools(body: ChatCompletionRequest, settings: OutputSettings) -> None:
    """tools and tool_choice make sense together.  Raises InvalidField (400) naming the problem."""
    tc, names = body.tool_choice, [t.function.name for t in body.tools or ()]
    if isinstance(tc, str) and tc not in TOOL_CHOICES:
        raise InvalidField("tool_choice", f"tool_choice {tc[:40]!r} is not one of {', '.join(TOOL_CHOICES)} "
                           f'or {{"type": "function", "function": {{"name": ...}}}}', "invalid_request")
    if isinstance(tc, dict):
        fn = tc.get("function")
        if tc.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidField("tool_choice", 'a named tool_choice is {"type": "function", "function": '
                               '{"name": ...}}', "invalid_request")
    if len(names) > MAX_TOOLS:
        raise InvalidField("tools", f"the request offers {len(names)} tools; at most {MAX_TOOLS} are allowed",
                           "invalid_request")
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise InvalidField("tools", f"two tools are named {n[:64]!r}", "invalid_request")
        seen.add(n)
    mode = tool_mode(body)
    if mode in ("required", "named") and not names:
        raise InvalidField("tool_choice", f"tool_choice={_show_choice(tc)} needs tools", "invalid_request")
    if mode == "named" and named_tool(body) not in names:
        raise InvalidField("tool_choice", f"tool_choice names the function {named_tool(body)!r:.64}, which is "
                           f"not among the tools ({', '.join(names)[:200]})", "invalid_request")
    if mode == "auto" and names and settings.tool_parser is None:
        raise InvalidField("tool_choice", "this model has no tool-call parser, so tool calls in its own syntax "
                           "cannot be read (tool_choice auto): send tool_choice required or a named function, "
                           "or start the gateway with --tool-call-parser", "unsupported")


def tool_schema(body: ChatCompletionRequest) -> dict[str, Any]:
    """The JSON schema a required or named tool_choice puts on the output (module docstring).
    Raises InvalidField when the tools' schemas cannot be combined into one."""
    params = {t.function.name: t.function.parameters or NO_PARAMETERS for t in body.tools or ()}
    name = named_tool(body)
    if name is not None:
        _check_depth(name, params[name], MAX_SCHEMA_DEPTH, "")
        return params[name]
    defs: dict[str, dict[str, Any]] = {}
    items = []
    for n, schema in params.items():
        _check_depth(n, schema, MAX_SCHEMA_DEPTH - CALLS_DEPTH,
                     f"; tool_choice=required puts them {CALLS_DEPTH} levels down in a list of calls, whose "
                     f"schema may nest {MAX_SCHEMA_DEPTH} (a named tool_choice allows {MAX_SCHEMA_DEPTH})")
        schema = _hoist_defs(n, schema, defs)
        items.append({"type": "object", "properties": {"name": {"enum": [n]}, "parameters": schema},
                      "required": ["name", "parameters"], "additionalProperties": False})
    out: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if not body.parallel_tool_calls:
        out["maxItems"] = 1
    for key, table in defs.items():
        out[key] = table
    return out


def _hoist_defs(name: str, schema: dict[str, Any], defs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`schema` without its $defs/definitions, which move to `defs` (the array's root, where its
    `#/$defs/...` references point once it is nested).  Refuses a reference to anything else of
    the tool's own root, and two tools defining one name differently."""
    for ref in _refs(schema):
        if ref.startswith("#") and not ref.startswith(("#/$defs/", "#/definitions/")):
            raise InvalidField("tools", f"tool {name!r}: the reference {ref[:80]!r} points into the tool's own "
                               f"schema, which tool_choice=required nests in a list of calls; use $defs",
                               "invalid_constraint")
    schema = dict(schema)
    for key in ("$defs", "definitions"):
        table = schema.pop(key, None)
        if not isinstance(table, dict):
            continue
        root = defs.setdefault(key, {})
        for k, v in table.items():
            if k in root and root[k] != v:
                raise InvalidField("tools", f"tools define {key}/{k[:64]} differently; tool_choice=required "
                                   f"puts them in one schema", "invalid_constraint")
            root[k] = v
    return schema


def _check_depth(name: str, schema: dict[str, Any], limit: int, why: str) -> None:
    """Refuses a tool whose own parameters nest deeper than `limit`, naming it (engine/constraint.py
    counts the depth of the whole schema, where a required tool_choice adds its wrapper's)."""
    depth = schema_depth(schema)
    if depth > limit:
        raise InvalidField("tools", f"tool {name[:64]!r}: its parameters nest {depth} levels deep; at most {limit} "
                           f"are allowed{why}", "invalid_constraint")


def _refs(value: Any) -> list[str]:
    """Every "$ref" string in a schema (iteratively)."""
    out, stack = [], [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            ref = v.get("$ref")
            if isinstance(ref, str):
                out.append(ref)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return out


def _show_choice(tc: Any) -> str:
    return repr(tc) if isinstance(tc, str) else "a named function"
