"""A request's output constraint (structured outputs): what it is, its limits, and its grammar.

A leaf module without torch (the gateway imports it): a `Constraint` names a kind and its spec,
and checks the caps below when it is made; `grammar_text` turns it into llguidance's grammar
text; `GrammarCompiler` compiles that text against one tokenizer, once per distinct constraint
(an LRU cache of pristine matchers, each request gets a deep copy), and refuses what the
grammar engine cannot compile with a message that names the problem.

The grammar engine is llguidance (PyPI `llguidance`): it imports no torch, so the gateway can
compile and refuse a bad schema itself, before any worker is contacted; its matchers compute
a token mask in tens of microseconds without precomputation, and a matcher copies cheaply,
which is how the workers start each request from a cached compilation.

`after`: the constraint applies only once the output has produced this text's tokens (the end
of a reasoning section, e.g. "</think>"): before that the output is free.  The marker is
matched as the token ids `Tokenizer.encode(after)` gives (one added token for the families'
reasoning markers)."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# Caps on what one request may ask for (every per-request cost is bounded, I10).  vLLM and
# SGLang cap none of them; llguidance's own limits (LLParserLimits) bound the compilation's work.
MAX_SPEC_CHARS = 64 << 10          # a schema, pattern, grammar or choice list, as text
MAX_SCHEMA_DEPTH = 32              # nesting of JSON values in a schema (objects, arrays)
MAX_CHOICES = 256                  # guided_choice alternatives
MAX_CHOICE_CHARS = 1024            # one alternative
MAX_AFTER_CHARS = 64               # the reasoning end marker
DEFAULT_CACHE_SIZE = 256           # compiled grammars kept per compiler
# JSON is generated compact (no whitespace between tokens, as OpenAI's structured outputs):
# with llguidance's default (whitespace allowed anywhere) a model may emit whitespace forever
# and never finish; a schema's own "x-guidance" options still win over these.
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Constraint:
    """kind: one of KINDS.  spec: json_schema: the schema as JSON text; json_object: "" (any
    JSON object); regex: the pattern (Rust `regex` syntax, anchored at both ends); choice: a
    JSON list of strings; grammar: a Lark grammar (llguidance's dialect) or a GBNF one.
    after: see the module docstring ("" : from the first token).
    Raises ValueError naming what is wrong and the limit."""
    kind: str
    spec: str = ""
    after: str = ""

    def __post_init__(self) -> None:
        _check(self.kind in KINDS, f"constraint kind {self.kind!r} is not one of {', '.join(KINDS)}")
        _check(isinstance(self.spec, str) and isinstance(self.after, str), "constraint spec and after must be strings")
        _check(len(self.spec) <= MAX_SPEC_CHARS,
               f"the {self.kind} constraint is {len(self.spec)} characters; at most {MAX_SPEC_CHARS} are allowed")
        _check(len(self.after) <= MAX_AFTER_CHARS,
               f"the constraint's reasoning end marker is {len(self.after)} characters; at most "
               f"{MAX_AFTER_CHARS} are allowed")
        if self.kind == "json_object":
            _check(not self.spec, "a json_object constraint takes no spec")
        elif self.kind == "json_schema":
            schema = _json(self.spec, "the json_schema")
            _check(isinstance(schema, (dict, bool)), "a JSON schema must be an object (or true/false)")
            depth = _depth(schema)
            _check(depth <= MAX_SCHEMA_DEPTH,
                   f"the JSON schema nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed")
        elif self.kind == "choice":
            choices = _json(self.spec, "the choice list")
            _check(isinstance(choices, list) and bool(choices) and all(isinstance(c, str) for c in choices),
                   "choice must be a non-empty list of strings")
            _check(len(choices) <= MAX_CHOICES,
                   f"choice has {len(choices)} alternatives; at most {MAX_CHOICES} are allowed")
            _check(all(0 < len(c) <= MAX_CHOICE_CHARS for c in choices),
                   f"every choice must be a non-empty string of at most {MAX_CHOICE_CHARS} characters")
        else:
            _check(bool(self.spec), f"a {self.kind} constraint needs a non-empty spec")

    @staticmethod
    def json_schema(schema: dict[str, Any] | bool, after: str = "") -> Constraint:
        # the schema's key order is kept: the output's properties come in that order
        return Constraint("json_schema", json.dumps(schema, separators=(",", ":")), after)

    @staticmethod
    def choice(choices: list[str], after: str = "") -> Constraint:
        return Constraint("choice", json.dumps(choices), after)


def grammar_text(c: Constraint) -> str:
    """llguidance's grammar text for `c` (not yet checked: `GrammarCompiler.compile` does).
    Raises ValueError when the spec cannot even be read (a GBNF grammar that does not convert)."""
    if c.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if c.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(c.spec, defaults=JSON_DEFAULTS)
    if c.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(c.spec)
    if c.kind == "choice":
        return llguidance.grammar_from("choice", c.spec)
    try:
        return llguidance.grammar_from("grammar", c.spec)
    except ValueError as e:
        raise ValueError(f"the grammar cannot be read: {e}") from None


class GrammarCompiler:
    """Compiles constraints against one tokenizer and caches the result (thread-safe).

    tokenizer_json: the tokenizer's `tokenizers` JSON (`Tokenizer.backend.to_str()`);
    vocab_size: the model's (the logits' width, which may exceed the tokenizer's);
    eos_ids: the tokens that end a request (allowed where the grammar may end)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int],
                 cache_size: int = DEFAULT_CACHE_SIZE, limits: llguidance.LLParserLimits | None = None):
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        self.vocab_size = vocab_size
        self.limits = limits
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiled = 0             # compilations made (cache misses), read by tests and metrics

    def compile(self, c: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `c`'s grammar (a copy of the cached compilation).
        Raises ValueError with the grammar engine's message when it cannot compile."""
        return self._pristine(c).deep_copy()

    def check(self, c: Constraint) -> None:
        """Compile `c` into the cache (no copy); raises ValueError as `compile`."""
        self._pristine(c)

    def _pristine(self, c: Constraint) -> llguidance.LLMatcher:
        """The cached compilation of `c` (compiled now when it is not cached); never consumed."""
        key = (c.kind, c.spec)
        with self._lock:
            pristine = self._cache.get(key)
            if pristine is not None:
                self._cache.move_to_end(key)
                return pristine
        matcher = llguidance.LLMatcher(self.tokenizer, grammar_text(c), log_level=0, limits=self.limits)
        if matcher.is_error():
            raise ValueError(f"the {_what(c.kind)} cannot be used: {matcher.get_error()}")
        with self._lock:
            self.compiled += 1
            self._cache[key] = matcher
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return matcher


def _what(kind: str) -> str:
    return {"json_schema": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
            "choice": "choice list", "grammar": "grammar"}[kind]


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} nests too deeply (at most {MAX_SCHEMA_DEPTH} levels are allowed)") from None
    except ValueError as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None


def _depth(value: Any) -> int:
    """How deeply JSON containers nest in `value` (iteratively: a hostile schema cannot
    exhaust the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            deepest = max(deepest, d)
            stack.extend((x, d + 1) for x in v)
    return deepest


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
