"""Structured outputs at the gateway: which field of a request asks for a constraint (one at
most), the grammar a `tool_choice` implies, and the compilation that refuses what the grammar
engine cannot use -- off the event loop, within a time budget, cached per constraint -- so that
a bad schema answers 400 before admission and before any worker is contacted.

The fields, each a way to ask for one constraint (engine/constraint.py kinds):

    response_format      {"type": "json_object"} | {"type": "json_schema", "json_schema": {schema, ...}}
    structured_outputs   {"json": S} | {"regex": R} | {"choice": [..]} | {"grammar": G} | {"json_object": true}
    guided_json / guided_regex / guided_choice / guided_grammar     (vLLM's older spelling)
    json_schema / regex / ebnf                                       (SGLang's)
    tool_choice          "required" or {"type": "function", "function": {"name": N}}

The schema a tool_choice puts on the output is gateway/tool_choice.py's.  The constraint
starts after the reasoning section when the served model reasons (`after`: gateway/chat.py
`reasoning_end`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from engine.config import ModelConfig
from engine.constraint import MAX_SPEC_CHARS, CheckBusy, CheckTimeout, Constraint, GrammarCompiler
from engine.grammar_check import checker_for
from engine.tokenizer import Tokenizer
from gateway.admission import InvalidField, Rejected
from gateway.chat import OutputSettings, reasoning_end
from gateway.compile_queue import DEFAULT_MAX_PENDING, DEFAULT_TENANT_MAX_PENDING, Busy, CompileQueue
from gateway.protocol import ChatCompletionRequest
from gateway.tool_choice import tool_mode, tool_schema

if TYPE_CHECKING:
    from gateway.protocol import CompletionRequest

    Body = ChatCompletionRequest | CompletionRequest

log = logging.getLogger("tandem.gateway")
# vLLM's structured_outputs: the keys that each ask for a constraint, and the options Tandem
# cannot honour when set (the properties follow the schema; no whitespace pattern or tags)
SO_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
            "json_object": "json_object"}
SO_UNHONOURED = {"disable_additional_properties": False, "whitespace_pattern": None, "structural_tag": None}
# accepted, changing nothing: Tandem never falls back to unconstrained output, and its JSON has
# no whitespace between tokens, which disable_any_whitespace=true asks for and false permits
SO_NO_EFFECT = ("disable_fallback", "disable_any_whitespace")
JSON_SCHEMA_FIELDS = ("name", "schema", "strict", "description")


# ---- the request's constraint ----------------------------------------------------------------
def sources(body: Body) -> list[tuple[str, str, Any]]:
    """Each (field, kind, spec) the request asks for a constraint with: spec is a schema (dict,
    or JSON text), a pattern, a grammar, a list of choices, or None for json_object and for
    tool_choice (whose schema `request_constraint` builds from the tools).  Cheap: it reads the
    fields' presence and shape only, so it runs on the event loop."""
    out: list[tuple[str, str, Any]] = []
    rf = body.response_format
    if rf is not None:
        out += _response_format(rf)
    so = body.structured_outputs
    if so is not None:
        for key, value in so.items():
            if key in SO_UNHONOURED and value != SO_UNHONOURED[key]:
                raise InvalidField(f"structured_outputs.{key}", f"structured_outputs.{key} is not supported",
                                   "unsupported")
            if key in SO_KINDS and value is not None and not (key == "json_object" and value is False):
                out.append((f"structured_outputs.{key}", SO_KINDS[key], None if key == "json_object" else value))
    for field, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar"), ("json_schema", "json_schema"), ("regex", "regex"),
                        ("ebnf", "grammar")):
        value = getattr(body, field)
        if value is not None:
            out.append((field, kind, value))
    if tool_mode(body) in ("required", "named"):
        out.append(("tool_choice", "json_schema", None))     # its schema: request_constraint builds it
    return out


def _response_format(rf: dict[str, Any]) -> list[tuple[str, str, Any]]:
    kind = rf.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", "json_object", None)]
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise InvalidField("response_format.json_schema", "response_format json_schema needs "
                               '"json_schema": {"name": ..., "schema": {...}}', "invalid_constraint")
        return [("response_format", "json_schema", js["schema"])]
    raise InvalidField("response_format.type", f"response_format type {str(kind)[:40]!r} is not supported "
                       "(text, json_object, json_schema)", "unsupported")


def ignored_fields(body: Body) -> list[str]:
    """Keys of response_format, structured_outputs and a named tool_choice that no one Tandem
    follows defines."""
    out: list[str] = []
    rf, so = body.response_format, body.structured_outputs
    if rf is not None:
        out += [f"response_format.{k}" for k in rf if k not in ("type", "json_schema")]
        js = rf.get("json_schema")
        if isinstance(js, dict):
            out += [f"response_format.json_schema.{k}" for k in js if k not in JSON_SCHEMA_FIELDS]
    if so is not None:
        out += [f"structured_outputs.{k}" for k in so if k not in SO_KINDS and k not in SO_UNHONOURED
                and k not in SO_NO_EFFECT]
    tc = getattr(body, "tool_choice", None)
    if isinstance(tc, dict):
        out += [f"tool_choice.{k}" for k in tc if k not in ("type", "function")]
        if isinstance(tc.get("function"), dict):
            out += [f"tool_choice.function.{k}" for k in tc["function"] if k != "name"]
    return out


def request_constraint(body: Body, settings: OutputSettings) -> tuple[str, Constraint] | None:
    """The field that asks for a constraint and the constraint (None: free output).  Raises
    InvalidField (400) when two fields ask for one, when tools are offered for the model to call
    in its own syntax as well, or when the spec is malformed or past a cap (engine/constraint.py)."""
    found = sources(body)
    if not found:
        return None
    if len(found) > 1:
        raise InvalidField(found[1][0], f"{found[0][0]} and {found[1][0]} both ask for a structured output; "
                           f"send one", "invalid_request")
    field, kind, spec = found[0]
    if field == "tool_choice":
        spec = tool_schema(body)    # type: ignore[arg-type]
    elif tool_mode(body) == "auto":
        raise InvalidField(field, f"{field} cannot be enforced while the model may call tools in its own "
                           f"syntax (tool_choice auto with tools): one of the two would be dropped. Send "
                           f"tool_choice none to answer in this format without tools, required or a named "
                           f"function to call one, or leave the tools out", "unsupported")
    after = reasoning_end(settings, body) if isinstance(body, ChatCompletionRequest) else ""
    try:
        return field, _constraint(kind, spec, after)
    except ValueError as e:
        raise InvalidField(field, f"{field}: {e}", "invalid_constraint") from None


def _constraint(kind: str, spec: Any, after: str) -> Constraint:
    if isinstance(spec, str) and len(spec) > MAX_SPEC_CHARS:
        raise ValueError(f"the {kind} is {len(spec)} characters; at most {MAX_SPEC_CHARS} are allowed")
    if kind == "json_object":
        return Constraint("json_object", "", after)
    if kind == "json_schema":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(spec, (dict, bool)):
            raise ValueError("a JSON schema must be an object")
        return Constraint.json_schema(spec, after)
    if kind == "choice":
        if not isinstance(spec, list) or not all(isinstance(c, str) for c in spec):
            raise ValueError("choice must be a list of strings")
        return Constraint.choice(spec, after)
    if not isinstance(spec, str):
        raise ValueError(f"the {kind} must be a string")
    return Constraint(kind, spec, after)


class StructuredOutputs:
    """The gateway's grammar compiler (one, built from the served model's tokenizer) and the
    threads it compiles on, apart from the tokenizing ones, behind a bounded queue that takes
    tenants in turn (gateway/compile_queue.py): slow schemas delay only schemas, and a request
    that asks for no constraint never waits for a thread."""

    def __init__(self, tokenizer: Tokenizer, model_config: ModelConfig, timeout_s: float,
                 observe: Callable[[float], None] = lambda seconds: None, threads: int = 2,
                 max_pending: int = DEFAULT_MAX_PENDING, tenant_max_pending: int = DEFAULT_TENANT_MAX_PENDING):
        self.timeout_s, self.observe = timeout_s, observe
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="gateway-grammar")
        self.queue = CompileQueue(self.executor, threads, max_pending, tenant_max_pending)
        eos = tokenizer.end_ids(model_config.eos_token_ids)     # the engine's (engine/core.py)
        self.compiler: GrammarCompiler | None = None
        self.unavailable = ""
        try:
            text = tokenizer.backend.to_str()
            # a constraint not seen before is checked first in a child process, killed past the budget:
            # some small schemas compile for minutes, and a thread cannot be stopped (engine/grammar_check.py)
            checker = checker_for(text, model_config.vocab_size, sorted(eos), timeout_s, processes=threads)
            self.compiler = GrammarCompiler(text, model_config.vocab_size, sorted(eos), checker=checker)
        except Exception as e:  # the model still serves free output; constraints are refused by name
            self.unavailable = f"structured outputs are not available for this model's tokenizer: {e}"
            log.warning("%s", self.unavailable)

    async def constraint(self, body: Body, settings: OutputSettings, tenant: str = "default") -> Constraint | None:
        """The request's constraint, compiled (cached) within the time budget, which starts
        when its compilation does.  None at once, on the event loop, when the request asks for
        none.  Raises InvalidField/Rejected (400) naming the problem, Busy (429) when `tenant`
        (whom the request counts against) or everyone has too many compilations pending;
        contacts no worker."""
        if not sources(body):
            return None
        try:
            c, seconds = await self.queue.run(tenant, lambda: self._prepare(body, settings), self.timeout_s)
        except TimeoutError:
            raise Rejected("grammar_timeout", self._too_slow) from None
        if c is not None:
            self.observe(seconds)
        return c

    def _prepare(self, body: Body, settings: OutputSettings) -> Constraint | None:
        found = request_constraint(body, settings)
        if found is None:
            return None
        field, c = found
        if self.compiler is None:
            raise Rejected("unsupported", self.unavailable)
        try:
            self.compiler.check(c)
        except CheckTimeout:
            raise Rejected("grammar_timeout", self._too_slow) from None
        except CheckBusy as e:      # not expected: the queue runs at most `threads` checks, one per child
            raise Busy("grammar_queue_full", str(e)) from None
        except ValueError as e:
            raise InvalidField(field, f"{field}: {e}", "invalid_constraint") from None
        return c

    @property
    def _too_slow(self) -> str:
        return f"the structured output took longer than {self.timeout_s:g} s to compile; simplify the schema"

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.compiler is not None:
            self.compiler.close()           # the checker's children
