"""A core's structured outputs: the one owner of its grammar compiler (built at the first
constraint, with the checker processes of `engine.grammar_check` when the engine has a check
budget) and the maker of each request's `Guide`.  Torch-free."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from engine.constraint import CheckBusy, Constraint, GrammarCompiler
from engine.errors import ErrorCode, RequestError
from engine.grammar_check import checker_for
from engine.guide import Guide
from engine.tokenizer import Tokenizer


class Guides:
    """`tokenizer`, `vocab_size` (the logits' width) and `eos_ids` of the served model;
    `check_timeout_s`: the checker's budget for a constraint not seen before (None: compiled
    in-process without one)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: frozenset[int],
                 check_timeout_s: float | None):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self.check_timeout_s = check_timeout_s
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        """The grammar compiler, with its caches of checked and refused constraints."""
        with self._lock:
            if self._compiler is None:
                tok, eos = self.tokenizer.backend.to_str(), sorted(self.eos_ids)
                self._compiler = GrammarCompiler(tok, self.vocab_size, eos, checker=checker_for(
                    tok, self.vocab_size, eos, self.check_timeout_s))
            return self._compiler

    def guide(self, constraint: Constraint | None, replay: Sequence[int] = ()) -> Guide | None:
        """A fresh grammar state for `constraint` (None without one), fed the tokens `replay`.
        Raises RequestError (INVALID_REQUEST) with the grammar engine's message when it cannot
        be compiled or refuses one of those tokens, or (KV_FULL) when no checker was free."""
        if constraint is None:
            return None
        gate = self.tokenizer.encode(constraint.after) if constraint.after else []
        try:
            guide = Guide(self.compiler.compile(constraint), constraint.kind, gate)
            guide.replay(replay)
        except CheckBusy as e:         # the checkers' load, not the constraint: retryable
            raise RequestError(ErrorCode.KV_FULL, str(e)) from None
        except ValueError as e:
            raise RequestError(ErrorCode.INVALID_REQUEST, str(e)) from None
        return guide

    def close(self) -> None:
        """Stop the compiler's checker processes (a worker's stop)."""
        with self._lock:
            compiler = self._compiler
        if compiler is not None:
            compiler.close()
