"""The grammar compiler (engine/constraint.py `GrammarCompiler`): every request's matcher is its
own, so what one request's output does to its grammar's lexer (the states it builds, the budget
it spends) cannot change another request's outcome; the check computes the first mask under
the compiler's parser limits; the cache keeps checked texts, not matchers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import llguidance
import pytest

from engine.config import SHIPPED_MODEL, ModelConfig
from engine.constraint import INITIAL_LEXER_FUEL, CheckBusy, CheckTimeout, Constraint, GrammarCompiler
from engine.errors import ErrorCode, RequestError
from engine.grammar_check import CheckerPool
from engine.guides import Guides
from engine.tokenizer import Tokenizer

# A pattern whose second branch exhausts llguidance's lexer (it refuses `zz` with "too many
# expressions constructed") while its first is harmless; the check's walk takes the lowest token
# ids ("b" before "z"), so the check passes it and only an output of z's meets the limit.
HOSTILE = Constraint("regex", "b+|(z{1000}){1000}")


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
    first = _walk(compiler.compile(HOSTILE), tokenizer.encode("zzzz"))
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


# ---- the check in a child process (engine/grammar_check.py) ----------------------------------
# ~1 KB of schema that llguidance compiles for minutes (its regex emptiness check of an allOf of
# 30 patterns; 22 took 9 s on this machine), bounded by none of its parser limits
SLOW = Constraint.json_schema({"type": "string", "allOf": [{"pattern": f"^(.*a.{{{i % 30 + 1}}}.*)$"}
                                                           for i in range(30)]})


@pytest.fixture
def pooled(tokenizer: Tokenizer) -> Iterator[tuple[GrammarCompiler, CheckerPool]]:
    config = ModelConfig.from_path(SHIPPED_MODEL)
    eos = sorted(tokenizer.end_ids(config.eos_token_ids))
    pool = CheckerPool(tokenizer.backend.to_str(), config.vocab_size, eos, processes=1,
                       timeout_s=1.0)
    compiler = GrammarCompiler(tokenizer.backend.to_str(), config.vocab_size, eos, checker=pool)
    yield compiler, pool
    compiler.close()
    assert pool._closed and not pool._free


def test_a_check_past_its_budget_is_killed_and_refused_and_remembered(pooled, tokenizer: Tokenizer) -> None:
    compiler, pool = pooled
    with pytest.raises(CheckTimeout, match="json_schema constraint took longer than 1 s to compile"):
        compiler.check(SLOW)
    assert pool.killed == 1 and compiler.compiled == 0
    with pytest.raises(CheckTimeout, match="took longer than 1 s"):           # from memory: nothing runs
        compiler.compile(SLOW)
    assert pool.killed == 1
    matcher = compiler.compile(Constraint.choice(["yes", "no"]))              # a new child checks it
    assert _walk(matcher, tokenizer.encode("yes")) == "ok" and compiler.compiled == 1


def test_the_child_refuses_what_cannot_compile_with_the_engines_message(pooled) -> None:
    compiler, pool = pooled
    for _ in range(2):                 # the second time from the refusals remembered
        with pytest.raises(ValueError, match="regex cannot be used: .*invalid regex") as refused:
            compiler.check(Constraint("regex", "a(b"))
        assert not isinstance(refused.value, CheckTimeout)
    assert pool.killed == 0 and len(pool._free) == 1           # the child answered and is kept


def test_no_free_checker_within_the_budget_is_busy_not_a_refusal(pooled) -> None:
    compiler, pool = pooled
    slow = threading.Thread(target=lambda: pytest.raises(CheckTimeout, pool.check, SLOW, 3.0))
    slow.start()
    try:
        time.sleep(0.2)                # the one child compiles SLOW for 3 s, then is killed
        compiler.checker = lambda c: pool.check(c, 0.5)
        with pytest.raises(CheckBusy, match="no grammar checker was free within 0.5 s"):
            compiler.check(Constraint.choice(["a"]))
    finally:
        slow.join()
        compiler.checker = pool
    compiler.check(Constraint.choice(["a"]))                   # busy was not remembered as a refusal
    assert compiler.compiled == 1


def _children(pool: CheckerPool) -> list[int]:
    with pool._lock:
        return [c.proc.pid for c in (*pool._free, *pool._busy)]


def test_a_child_that_dies_checking_is_a_refusal_and_one_dead_idle_is_replaced(pooled) -> None:
    compiler, pool = pooled
    compiler.checker = lambda c: pool.check(c, 60.0)
    try:
        slow = threading.Thread(target=lambda: pytest.raises(ValueError, compiler.check, SLOW))
        slow.start()
        for _ in range(100):                       # the child has SLOW (at most 10 s)
            if _children(pool):
                break
            time.sleep(0.1)
        os.kill(_children(pool)[0], signal.SIGKILL)
        slow.join(30)
        assert not slow.is_alive()
        with pytest.raises(ValueError, match=r"json_schema constraint crashed the grammar engine \(signal 9\)"):
            compiler.check(SLOW)                   # remembered: the same refusal, nothing runs
        assert pool.killed == 1
        compiler.check(Constraint.choice(["a"]))   # a new child
        (idle,) = _children(pool)
        os.kill(idle, signal.SIGKILL)
        time.sleep(0.2)
        compiler.check(Constraint.choice(["b"]))   # the dead one is dropped, a new child checks
        assert compiler.compiled == 2 and len(_children(pool)) == 1 and _children(pool) != [idle]
    finally:
        compiler.checker = pool


def test_a_child_dies_with_its_parent(tmp_path) -> None:
    """A parent killed (SIGKILL: no cleanup runs) while its child compiles: the child is killed
    too (PR_SET_PDEATHSIG), not left compiling for minutes."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, threading, time\n"
        "from engine.config import SHIPPED_MODEL, ModelConfig\n"
        "from engine.grammar_check import CheckerPool\n"
        "from engine.tokenizer import Tokenizer\n"
        "from tests.test_grammar_compiler import SLOW\n"
        "tok, cfg = Tokenizer(SHIPPED_MODEL), ModelConfig.from_path(SHIPPED_MODEL)\n"
        "pool = CheckerPool(tok.backend.to_str(), cfg.vocab_size, [0], timeout_s=600)\n"
        "threading.Thread(target=pool, args=(SLOW,), daemon=True).start()\n"
        "while not pool._busy: time.sleep(0.05)\n"
        "print(next(iter(pool._busy)).proc.pid, flush=True)\n"
        "time.sleep(600)\n")
    root = Path(__file__).resolve().parent.parent
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=root,
                              env={**os.environ, "PYTHONPATH": str(root)})
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait()
        for _ in range(100):                       # at most 10 s
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the checker child outlived its parent")
    finally:
        parent.kill()


def test_a_grammar_of_too_many_rules_is_refused_before_any_compile() -> None:
    chain = "start: r0\n" + "\n".join(f'r{i}: r{i + 1} | "x"' for i in range(3000)) + '\nr3000: "y"'
    with pytest.raises(ValueError, match="the grammar defines 3002 rules; at most 1000 are allowed"):
        Constraint("grammar", chain)
    gbnf = "root ::= r0\n" + "\n".join(f'r{i} ::= r{i + 1} | "x"' for i in range(1200)) + '\nr1200 ::= "y"'
    with pytest.raises(ValueError, match="the grammar defines 1202 rules"):
        Constraint("grammar", gbnf)


def test_a_busy_checker_is_a_retryable_refusal_on_a_worker(tokenizer: Tokenizer) -> None:
    """A worker's guide maps no free checker to KV_FULL (no room now: the gateway waits and
    retries), a constraint's own refusal to INVALID_REQUEST."""
    config = ModelConfig.from_path(SHIPPED_MODEL)
    guides = Guides(tokenizer, config.vocab_size, tokenizer.end_ids(config.eos_token_ids), None)

    def busy(c: Constraint) -> str:
        raise CheckBusy("no grammar checker was free within 1 s (all busy compiling); try again")
    guides.compiler.checker = busy
    with pytest.raises(RequestError, match="no grammar checker was free") as e:
        guides.guide(Constraint.choice(["a"]))
    assert e.value.code == ErrorCode.KV_FULL
    guides.compiler.checker = None
    with pytest.raises(RequestError, match="regex cannot be used") as e:
        guides.guide(Constraint("regex", "a(b"))
    assert e.value.code == ErrorCode.INVALID_REQUEST
    assert guides.guide(Constraint.choice(["a"])) is not None               # busy was not remembered
