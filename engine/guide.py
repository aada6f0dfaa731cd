"""A request's grammar in the token path (structured outputs): its `Guide`.

A guide is a compiled constraint's matcher (llguidance, `engine.constraint.GrammarCompiler`)
behind the constraint's `after` gate:

    gate closed  the output is free; each token is remembered until the output's ids END WITH
                 the gate's ids (`Tokenizer.encode(after)`), which opens it for good
    gate open    every later token is masked (`engine.guided_mask`) to what the grammar allows,
                 EOS where the grammar may end; `accept` consumes it into the matcher

`accept` is called once per generated token, in order, by the request's stop checks
(`StopChecker.append`, also when a migrated request's tokens are replayed) or, for a hand-off
request that has no stop checks, by `replay`.  So a guide built on another worker from the
same constraint and fed the same tokens is in the same state: the grammar crosses the
prefill/decode split and migrations by replay, exactly.

Torch-free: the mask itself is computed and applied by `engine.guided_mask.TokenMasker`.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance

from engine.grammar_steps import grammar_fault


class Guide:
    """One request's grammar state.  `kind`: the constraint's kind (for messages); `gate`: the
    token ids after which the grammar applies (empty: from the first token)."""

    def __init__(self, matcher: llguidance.LLMatcher, kind: str, gate: Sequence[int] = ()):
        self.matcher = matcher
        self.kind = kind
        self.gate = tuple(gate)
        self.active = not self.gate           # the gate is open: tokens are masked and consumed
        self._tail: list[int] = []            # the last len(gate) tokens while the gate is closed
        self.consumed = 0                     # tokens the matcher consumed
        self.seen = 0                         # tokens accepted in all (gate closed or open)
        self.error: str | None = None         # why a token was refused (then nothing more is accepted)
        # the refusal was the grammar's own (a parser limit: the constraint's fault), not the token's
        self.grammar_fault = False

    @property
    def masks(self) -> bool:
        """Whether the next token is masked: the gate is open and the grammar has not failed."""
        return self.active and self.error is None

    @property
    def stopped(self) -> bool:
        """The gate is open and nothing but EOS may follow: the output is complete."""
        return self.active and self.error is None and self.matcher.is_stopped()

    def accept(self, token: int) -> bool:
        """Advance over the next generated token.  Returns False, setting `error` (naming the
        token, its position and the constraint), when the grammar refuses it; the guide then
        refuses every later token too."""
        if self.error is not None:
            return False
        position = self.seen
        self.seen += 1
        if not self.active:
            self._tail.append(token)
            if len(self._tail) > len(self.gate):
                del self._tail[0]
            self.active = tuple(self._tail) == self.gate
            return True
        if self.matcher.consume_token(token):
            self.consumed += 1
            return True
        reason = self.matcher.get_error().splitlines()
        self.grammar_fault = grammar_fault(self.matcher)
        self.error = (f"output token {position} (id {token}) is not allowed by the request's {self.kind} "
                      f"constraint" + (f": {reason[0]}" if reason and reason[0] else ""))
        return False

    def replay(self, tokens: Sequence[int]) -> None:
        """Accept `tokens` (generated before, elsewhere).  Raises ValueError (the refusal's
        `error`) at the first token the grammar refuses."""
        for token in tokens:
            if not self.accept(token):
                assert self.error is not None
                raise ValueError(self.error)
