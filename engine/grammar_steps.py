"""The steps a constraint's matcher takes in a worker, and the same steps taken by its check,
so that what the check passes is what the workers can run (torch-free: the gateway uses it).

A worker builds a request's matcher, computes its first mask, and then, for every token it
generates, consumes the token (`Guide.accept`) and computes the next mask (`TokenMasker`).
llguidance does real work in the consume too: it computes the bytes the grammar forces next
(its "ff_tokens" pass), and a schema whose recursion cannot end (`{"properties": {"a": {"$ref":
"#"}}, "required": ["a"]}`: every `{` forces `"a":{` again) makes that pass exceed the parser's
item limit at the output's first token.  A check that only built the matcher and its first
mask passed such a schema, and the worker failed the request (a 500).

So the check also walks: `walk` takes the worker's steps -- `step` (consume, then mask) -- over
a short output the grammar allows (the forced tokens, else the lowest allowed token id that is
not an end token), under the same parser limits, which travel to the checker children whole
(`limits_setup` / `limits_from`).  A walk cannot visit every output, so a worker that still
meets a limit ends the request as the constraint's fault (`grammar_fault`: INVALID_REQUEST, a
400), never as the server's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import llguidance

WALK_TOKENS = 16              # tokens of output a check walks past the first mask
MAX_REF_WALKS = 16            # a JSON schema's $ref targets walked as roots of their own, at most
# ... and fewer for a large schema: each walk compiles what its target reaches (up to the whole
# schema: 70 ms for 26 KB here), so the walks compile at most about this many characters in all
REF_WALK_CHARS = 128 << 10
# how llguidance words a token its grammar does not allow (every other error is the grammar's own:
# a parser or lexer limit, or a grammar that cannot go on); its stop reason is "InternalError" for both
REFUSED_TOKEN = "doesn't satisfy the grammar"
LIMIT_FIELDS = ("max_items_in_row", "initial_lexer_fuel", "step_lexer_fuel", "step_max_items",
                "max_lexer_states", "max_grammar_size", "precompute_large_lexemes", "verbose_errors")


def limits_setup(limits: llguidance.LLParserLimits) -> dict[str, Any]:
    """Every field of `limits`, as JSON (a checker child's setup)."""
    return {name: getattr(limits, name) for name in LIMIT_FIELDS}


def limits_from(setup: dict[str, Any]) -> llguidance.LLParserLimits:
    """The limits `limits_setup` described."""
    return llguidance.LLParserLimits(**{name: setup[name] for name in LIMIT_FIELDS})


def step(matcher: llguidance.LLMatcher, token: int) -> bool:
    """One generated token: consumed, then the next mask computed (what a worker does per
    token).  Returns False when the matcher is then in its error state."""
    if not matcher.consume_token(token):
        return False
    matcher.compute_bitmask()
    return not matcher.is_error()


def grammar_fault(matcher: llguidance.LLMatcher) -> bool:
    """Whether the matcher's error is the grammar's own (a parser or lexer limit, a grammar that
    cannot go on), not a token it was refused: a worker samples only tokens its mask allowed,
    so a refused token is the serving side's fault."""
    return matcher.is_error() and REFUSED_TOKEN not in _first_line(matcher)


def walk(matcher: llguidance.LLMatcher, eos_ids: Iterable[int], limits: llguidance.LLParserLimits,
         tokens: int = WALK_TOKENS) -> str | None:
    """Take up to `tokens` worker steps from the matcher's state (its first mask computed) and
    return it to that state.  Returns None, or why the grammar cannot be used (its limit named)
    when a step failed (the matcher then stays in its error state)."""
    ends = set(eos_ids)
    taken = 0
    while taken < tokens and not matcher.is_stopped():
        forced = matcher.compute_ff_tokens()
        token = forced[0] if forced else _lowest_allowed(matcher.compute_bitmask(), ends)
        if matcher.is_error():
            return _why(matcher, taken, limits)
        if token is None:                     # only an end may follow
            break
        taken += 1
        if not step(matcher, token):
            return _why(matcher, taken, limits)
    matcher.rollback(taken)
    return None


def ref_roots(schema_text: str) -> list[str]:
    """JSON schemas that start where each local `$ref` of `schema_text` points (the first
    `ref_walks` of them), every reference still valid: the schema moves whole under
    `$defs/__root`, and its references with it.  An output that can never end forces bytes only
    inside a cycle of references, so walking from each target meets what a walk from the root
    may pass by (an optional property whose schema recurses without end)."""
    root = json.loads(schema_text)
    most = ref_walks(len(schema_text))
    targets: dict[str, None] = {}
    stack = [root]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            ref = v.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/") and len(targets) < most:
                targets[ref] = None
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    if not targets:
        return []
    moved = _moved(root)
    return [json.dumps({"$defs": {"__root": moved}, "$ref": "#/$defs/__root" + t[1:]}, separators=(",", ":"))
            for t in targets]


def ref_walks(schema_chars: int) -> int:
    """How many $ref targets of a schema this long are walked."""
    return max(1, min(MAX_REF_WALKS, REF_WALK_CHARS // max(schema_chars, 1)))


def _moved(root: Any) -> Any:
    """A copy of `root` whose local references point into `#/$defs/__root`."""
    def move(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: ("#/$defs/__root" + x[1:] if k == "$ref" and isinstance(x, str) and
                        (x == "#" or x.startswith("#/")) else move(x)) for k, x in v.items()}
        return [move(x) for x in v] if isinstance(v, list) else v
    return move(root)


def _lowest_allowed(mask: bytes, ends: set[int]) -> int | None:
    bits = int.from_bytes(mask, "little")
    for t in ends:
        bits &= ~(1 << t)
    return (bits & -bits).bit_length() - 1 if bits else None


def _first_line(matcher: llguidance.LLMatcher) -> str:
    """The error's first line (llguidance's verbose errors go on with its state and grammar)."""
    lines = matcher.get_error().splitlines()
    return lines[0] if lines else str(matcher.stop_reason())


def _why(matcher: llguidance.LLMatcher, taken: int, limits: llguidance.LLParserLimits) -> str:
    first = _first_line(matcher)
    where = f"at output token {taken}" if taken else "before its first output token"
    if "Too many items" in first:
        hint = (f" (over the parser's limit of {limits.step_max_items} items for one token, step_max_items: "
                f"a recursion that cannot end, a $ref that every branch requires, does this)")
    elif first.startswith("lexer error"):
        hint = f" (over the lexer's limit of {limits.step_lexer_fuel} fuel for one token, step_lexer_fuel)"
    else:
        hint = ""
    return f"{where}: {first}{hint}"
