"""A request's output constraint (structured outputs): what it is, its limits, and its grammar.

A leaf module without torch (the gateway imports it): a `Constraint` names a kind and its spec,
and checks the caps below when it is made; `grammar_text` turns it into llguidance's grammar
text; `GrammarCompiler` checks that text against one tokenizer (once per distinct constraint:
an LRU cache of the checked texts), refuses what the grammar engine cannot use with a message
that names the problem, and gives every request a matcher of its own.

The grammar engine is llguidance (PyPI `llguidance`): it imports no torch, so the gateway can
compile and refuse a bad schema itself, before any worker is contacted, and its matchers
compute a token mask in tens of microseconds without precomputation.

Two of llguidance's properties shape the compiler:
- **Matchers build their lexer lazily.**  `LLMatcher(...)` returns in about a millisecond even
  for a regex whose lexer would take seconds and hundreds of MB; the work happens at the first
  mask.  So the compiler computes every matcher's first mask itself (a check's, and each
  request's on the thread that makes the request, not in the step that first masks it), and
  `INITIAL_LEXER_FUEL` caps the lexer's initial work: the worst pattern found costs about
  0.3 s there, and one that exhausts the lexer later ends its request with an explicit error.
- **A matcher's copies share its lexer** (`LLMatcher.deep_copy`): the states one request's
  output walks, and the lexer's budget they use, would be every later copy's.  One request
  could exhaust the budget for every request of the same constraint, and whether a request
  fails would depend on the worker's history.  So every request gets a fresh matcher, built
  from the cached text (about 0.2-1 ms for the schemas of the tests; at most a few hundred ms
  for a schema at `MAX_SPEC_CHARS`, with the GIL released).

`after`: the constraint applies only once the output has produced this text's tokens (the end
of a reasoning section, e.g. "</think>"): before that the output is free.  The marker is
matched as the token ids `Tokenizer.encode(after)` gives (one added token for the families'
reasoning markers)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance

from engine.grammar_steps import grammar_fault, ref_roots, walk

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
# rules of a Lark or GBNF grammar: llguidance overflowed its stack (SIGSEGV) on a chain of ~2,800
# rules (55 KB), which MAX_SPEC_CHARS admits; 2,500 passed
MAX_GRAMMAR_RULES = 1000
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*(?:\{[^}\n]*\})?(?:\.-?\d+)?[ \t]*(?::|::=)", re.MULTILINE)
DEFAULT_CACHE_SIZE = 256           # checked grammar texts kept per compiler (each at most ~MAX_SPEC_CHARS)
# llguidance's parser limits for every matcher (its defaults but the lexer's initial work: 1e6 fuel,
# at which `(a{1000}){1000}` took 1.35 s and 170 MB at its first mask here; 2e5 takes 0.1-0.2 s
# and no memory that outlives the request).  The per-step fuel stays llguidance's (200k, ~14 ms).
INITIAL_LEXER_FUEL = 200_000
REFUSED_TIMEOUT_TTL_S = 60.0       # a constraint refused for its check's time is refused again this long
# the time a constraint not seen before may take to compile (llguidance's check, in a child process:
# engine/grammar_check.py): the gateway's default budget (GatewaySettings.grammar_compile_timeout_s,
# past it 400 grammar_timeout); a worker allows twice this (worker/config.py GRAMMAR_CHECK_TIMEOUT_S),
# so what the gateway passed passes there
GRAMMAR_COMPILE_TIMEOUT_S = 5.0
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
            depth = schema_depth(schema)
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
            if self.kind == "grammar":
                rules = len(_RULE.findall(self.spec))
                _check(rules <= MAX_GRAMMAR_RULES,
                       f"the grammar defines {rules} rules; at most {MAX_GRAMMAR_RULES} are allowed")

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


class CheckTimeout(ValueError):
    """A constraint's check ran past its time budget (`engine.grammar_check`)."""


class CheckBusy(ValueError):
    """No checker was free within the budget: the load's doing, not the constraint's (never
    remembered as a refusal)."""


def default_limits() -> llguidance.LLParserLimits:
    """The parser limits every compiler uses unless given others."""
    return llguidance.LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL)


class GrammarCompiler:
    """Checks constraints against one tokenizer, caches what passed, and makes each request's
    matcher (thread-safe).

    tokenizer_json: the tokenizer's `tokenizers` JSON (`Tokenizer.backend.to_str()`);
    vocab_size: the model's (the logits' width, which may exceed the tokenizer's);
    eos_ids: the tokens that end a request (allowed where the grammar may end);
    limits: llguidance's parser limits (`default_limits()` when None);
    checker: checks a constraint not seen before and returns its grammar text, or raises
    ValueError to refuse it (`engine.grammar_check.CheckerPool`: in a child process, under a
    time budget), so that only a constraint that passed is compiled in this process.  Refusals are remembered too (the
    latest `cache_size`), so a refused constraint sent again costs nothing."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int],
                 cache_size: int = DEFAULT_CACHE_SIZE, limits: llguidance.LLParserLimits | None = None,
                 checker: Callable[[Constraint], str] | None = None):
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        self.vocab_size, self.eos_ids = vocab_size, sorted(eos_ids)
        self.limits = limits if limits is not None else default_limits()
        self.checker = checker
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()   # (kind, spec) -> grammar text
        self._refused: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()  # -> why, until
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiled = 0             # constraints checked (cache misses), read by tests and metrics

    def compile(self, c: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher of its own at the start of `c`'s grammar, its first mask computed
        (the lazy lexer's initial work, done here, on the caller's thread, rather than in the
        first step that masks the request).  Raises ValueError with the grammar engine's
        message when `c` cannot be used (see `check`)."""
        text = self._checked(c)
        if text is not None:
            return self._ready(c, text)
        text, matcher = self._check_new(c)
        return matcher if matcher is not None else self._ready(c, text)

    def check(self, c: Constraint) -> None:
        """Raise ValueError, naming the problem, unless `c` compiles, its first mask can be
        computed and a worker's first steps taken (`engine.grammar_steps.walk`) within the
        limits (by the checker when there is one: then nothing of `c` is compiled in this
        process); remembers the outcome."""
        if self._checked(c) is None:
            self._check_new(c)

    def prepare(self, c: Constraint) -> str:
        """`c`'s grammar text once it compiled here, its first mask was computed and the
        walk passed (nothing cached: what a checker process runs).  Raises ValueError as `check`."""
        return self._prepared(c)[0]

    def _prepared(self, c: Constraint) -> tuple[str, llguidance.LLMatcher]:
        """The check: a matcher as a request gets it (`_ready`), walked and put back at its start."""
        text = grammar_text(c)
        matcher = self._ready(c, text)
        why = walk(matcher, self.eos_ids, self.limits)
        if why is None and c.kind == "json_schema":
            why = self._walk_refs(c)
        if why is not None:
            raise ValueError(f"the {_what(c.kind)} cannot be used: {why}")
        return text, matcher

    def _walk_refs(self, c: Constraint) -> str | None:
        """Walk from each $ref target of `c`'s schema (`engine.grammar_steps.ref_roots`), each
        a matcher made as a request's is; why one met a limit, or None.  A target that is no
        schema of its own is not the walk's business (the root's grammar is what a request runs)."""
        for probe in ref_roots(c.spec):
            try:
                m = self._ready(c, llguidance.LLMatcher.grammar_from_json_schema(probe, defaults=JSON_DEFAULTS))
            except ValueError:
                continue
            why = walk(m, self.eos_ids, self.limits)
            if why is not None and grammar_fault(m):
                return f"where it refers to {_target(probe)!r}, {why}"
        return None

    def close(self) -> None:
        """Stop the checker's children (when it has any)."""
        close = getattr(self.checker, "close", None)
        if close is not None:
            close()

    def _checked(self, c: Constraint) -> str | None:
        """`c`'s grammar text when it passed a check before (then it is the most recent).
        Raises ValueError, as the first time, when it was refused before."""
        key = (c.kind, c.spec)
        with self._lock:
            text = self._cache.get(key)
            if text is not None:
                self._cache.move_to_end(key)
            elif (refused := self._refused.get(key)) is not None:
                why, until = refused
                if time.monotonic() < until:
                    raise CheckTimeout(why) if until < float("inf") else ValueError(why)
                del self._refused[key]
            return text

    def _check_new(self, c: Constraint) -> tuple[str, llguidance.LLMatcher | None]:
        """Check `c` (not cached): by the checker, or here (then with the matcher it made).
        Caches and returns its grammar text, or remembers and raises its refusal (a busy
        checker is not `c`'s fault: raised, not remembered)."""
        key = (c.kind, c.spec)
        matcher = None
        try:
            if self.checker is not None:
                text = self.checker(c)
            else:
                text, matcher = self._prepared(c)
        except CheckBusy:
            raise
        except ValueError as e:
            # a timeout may be the machine's load: remembered for a while only
            ttl = REFUSED_TIMEOUT_TTL_S if isinstance(e, CheckTimeout) else float("inf")
            self._remember(self._refused, key, (str(e), time.monotonic() + ttl))
            raise
        self._remember(self._cache, key, text)
        with self._lock:
            self.compiled += 1
        return text, matcher

    def _remember(self, cache: OrderedDict, key: tuple[str, str], value: object) -> None:
        with self._lock:
            cache[key] = value
            while len(cache) > self._cache_size:
                cache.popitem(last=False)

    def _ready(self, c: Constraint, text: str) -> llguidance.LLMatcher:
        """A new matcher of `text` with its first mask computed, still at the start (a mask
        consumes nothing).  The first mask does the lexer's initial work, bounded by the limits."""
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=self.limits)
        if not matcher.is_error():
            matcher.compute_bitmask()
        if matcher.is_error():
            raise ValueError(f"the {_what(c.kind)} cannot be used: {matcher.get_error()}")
        return matcher


def _target(probe: str) -> str:
    """The reference a `ref_roots` schema starts at, as the client wrote it."""
    return "#" + json.loads(probe)["$ref"][len("#/$defs/__root"):]


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


# keywords whose value holds subschemas by name or position: that map or list is no level of
# its own (a property's schema sits one level below the object's schema, as its value does)
SUBSCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
SUBSCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})


def schema_depth(schema: Any) -> int:
    """How many levels a JSON schema nests, as the values it describes do: the root schema is
    level 1 and each subschema (a property's, `items`, `additionalProperties`, each branch of an
    `anyOf`, ...) one level below its parent, so 31 nested objects are 31 levels.  The maps and
    lists that hold subschemas (`properties`, `anyOf`, ...) add none; any other container
    (an `enum`'s or `const`'s value, an unknown keyword's) counts one level each.  Iterative:
    a hostile schema cannot exhaust the stack."""
    deepest, stack = 0, [(schema, 1, True)]        # (value, its level, whether it is a schema)
    while stack:
        v, d, is_schema = stack.pop()
        if not isinstance(v, (dict, list)):
            continue
        deepest = max(deepest, d)
        if not is_schema:
            stack.extend((x, d + 1, False) for x in (v.values() if isinstance(v, dict) else v))
            continue
        if isinstance(v, list):                    # a schema where one was expected is data
            stack.extend((x, d + 1, False) for x in v)
            continue
        for key, x in v.items():
            if key in SUBSCHEMA_MAPS and isinstance(x, dict):
                stack.extend((s, d + 1, True) for s in x.values())
            elif key in SUBSCHEMA_LISTS and isinstance(x, list):
                stack.extend((s, d + 1, True) for s in x)
            else:
                stack.append((x, d + 1, isinstance(x, dict)))
    return deepest


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
