"""The grammar compiler (engine/constraint.py `GrammarCompiler`): every request's matcher is its
own, so what one request's output does to its grammar's lexer (the states it builds, the budget
it spends) cannot change another request's outcome; the check computes the first mask under
the compiler's parser limits; the cache keeps checked texts, not matchers."""

from __future__ import annotations

import llguidance
import pytest

from engine.config import SHIPPED_MODEL, ModelConfig
from engine.constraint import INITIAL_LEXER_FUEL, Constraint, GrammarCompiler
from engine.tokenizer import Tokenizer

# A pattern whose first branch exhausts llguidance's lexer (it refuses `aa` with "too many
# expressions constructed") while its second is harmless.
HOSTILE = Constraint("regex", "(a{1000}){1000}|b+")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(SHIPPED_MODEL)


def _compiler(tokenizer: Tokenizer, **kw: object) -> GrammarCompiler:
    config = ModelConfig.from_path(SHIPPED_MODEL)
    return GrammarCompiler(tokenizer.backend.to_str(), config.vocab_size,
                           sorted(tokenizer.end_ids(config.eos_token_ids)), **kw)  # type: ignore[arg-type]


def _walk(matcher: llguidance.LLMatcher, ids: list[int]) -> str:
    """Mask then consume each token, as the engine does; "ok" or why the grammar stopped."""
    for i, token in enumerate(ids):
        matcher.compute_bitmask()
        if matcher.is_error():
            return f"error before token {i}"
        if not matcher.consume_token(token):
            return f"refused token {i}: {matcher.get_error().splitlines()[0]}"
    return "ok"


def test_one_requests_lexer_failure_does_not_reach_the_next(tokenizer: Tokenizer) -> None:
    compiler = _compiler(tokenizer)
    first = _walk(compiler.compile(HOSTILE), tokenizer.encode("aaaa"))
    assert first.startswith("refused token"), first                     # the lexer's limit, for this request
    for _ in range(2):                                                   # the same constraint, from the cache
        assert _walk(compiler.compile(HOSTILE), tokenizer.encode("bbbb")) == "ok"
    assert compiler.compiled == 1


def test_each_request_gets_a_matcher_of_its_own(tokenizer: Tokenizer) -> None:
    compiler = _compiler(tokenizer)
    c = Constraint.choice(["alpha", "beta"])
    one, two = compiler.compile(c), compiler.compile(c)
    assert one is not two
    assert _walk(one, tokenizer.encode("alpha")) == "ok" and one.is_stopped()
    assert not two.is_stopped() and _walk(two, tokenizer.encode("beta")) == "ok"


def test_check_refuses_what_cannot_compile_and_caches_only_what_passed(tokenizer: Tokenizer) -> None:
    compiler = _compiler(tokenizer, cache_size=2)
    with pytest.raises(ValueError, match="regex cannot be used"):
        compiler.check(Constraint("regex", "a(b"))
    assert compiler.compiled == 0 and not compiler._cache
    kinds = [Constraint("regex", "[0-9]+"), Constraint.choice(["x", "y"]), Constraint("json_object")]
    for c in kinds:
        compiler.check(c)
    assert compiler.compiled == 3
    assert list(compiler._cache) == [(c.kind, c.spec) for c in kinds[1:]]          # the oldest left
    assert all(isinstance(text, str) for text in compiler._cache.values())        # texts, no matcher
    compiler.check(kinds[1])                                                       # a hit: no new check
    assert compiler.compiled == 3


def test_matchers_run_under_the_compilers_limits(tokenizer: Tokenizer) -> None:
    assert _compiler(tokenizer).limits.initial_lexer_fuel == INITIAL_LEXER_FUEL
    tight = llguidance.LLParserLimits(max_grammar_size=10)
    compiler = _compiler(tokenizer, limits=tight)
    with pytest.raises(ValueError, match="grammar cannot be used"):
        compiler.check(Constraint("grammar", "start: " + " ".join(f'"w{i}"' for i in range(50))))
