"""Stop conditions and the output text of one request, also while it streams.

Per request a `StopChecker` keeps the output text (an `IncrementalDetokenizer`) and decides,
after each new token, whether the request stops: a stop token (EOS unless `ignore_eos`,
`stop_token_ids`), a stop string, a stop regex (matched against the text, never searched for
literally), or length.  None of them fires before `min_tokens`.  A matched stop string or
regex match is cut from the text with everything after it; `no_stop_trim` keeps the match (and
a stop token's text).  While streaming, `delta()` holds back text that might still become part
of a stop: a suffix that is a prefix of a stop string, a partial regex match, or an incomplete
UTF-8 character.

Every token's check is bounded, whatever the request asks (issue 16):
- stop strings are searched in the text the token changed plus the longest stop string's
  length before it; the caps on their number and length live in `engine.params`;
- a stop regex is searched in the last `StopLimits.window_chars` characters of the output
  (and one character before them, so `^` and `\\b` see what precedes the window).  A match
  longer than the window is not found, and text further back than the window is streamed even
  if a longer match could still start there;
- the whole check of one token (detokenizing, strings, regexes, hold-back) has a budget of
  `StopLimits.budget_s`: every regex search gets what is left of it as its timeout.  A pattern
  that runs past it ends the request: `append` returns "error" and `error` says which pattern
  and what budget.  The pattern is not retried and nothing waits for it;
- over the request, the checks may cost at most `StopLimits.mean_budget_s` per token on average
  (from the `grace_tokens`-th token on): patterns that stay under the per-token budget but cost
  milliseconds every token, in many requests at once, would otherwise slow every step of the
  worker for everyone.  Such a request ends the same way.
A request with a grammar (`engine.guide.Guide`, structured outputs) has it advanced here, first
thing for every token (so replaying a migrated request's tokens replays its grammar too): a
token the grammar refuses ends the request with "error" (`error` names it); a token after which
the grammar allows nothing but EOS ends it with "stop" (`matched_stop` None), also where the
token reached max_tokens.
`work` counts what the checks examined (characters searched, tokenizer decode calls), so tests
bound the work per token instead of its time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import regex

from engine.guide import Guide
from engine.params import SamplingParams
from engine.tokenizer import REPLACEMENT, IncrementalDetokenizer, Tokenizer

STOP_WINDOW_CHARS = 1024     # a stop_regex sees this many trailing characters of the output
STOP_BUDGET_S = 0.05         # the whole stop check of one token of one request
STOP_MEAN_BUDGET_S = 0.005   # ... and on average over its tokens (a check at the caps costs ~1 ms)
STOP_GRACE_TOKENS = 8        # the average is enforced from this many tokens on


@dataclass(frozen=True)
class StopLimits:
    """How much a request's stop checks may look at and spend per token."""
    window_chars: int = STOP_WINDOW_CHARS
    budget_s: float = STOP_BUDGET_S
    mean_budget_s: float = STOP_MEAN_BUDGET_S
    grace_tokens: int = STOP_GRACE_TOKENS

    def __post_init__(self) -> None:
        if not 0 < self.mean_budget_s < float("inf"):
            raise ValueError(f"stop mean_budget_s={self.mean_budget_s} must be > 0 and finite")
        if self.grace_tokens < 1:
            raise ValueError(f"stop grace_tokens={self.grace_tokens} must be >= 1")
        if self.window_chars < 1:
            raise ValueError(f"stop window_chars={self.window_chars} must be >= 1")
        if not 0 < self.budget_s < float("inf"):
            raise ValueError(f"stop budget_s={self.budget_s} must be > 0 and finite")


@dataclass
class StopWork:
    """What a request's stop checks have examined so far (instrumentation, read by tests and
    `bench.engine`)."""
    tokens: int = 0              # tokens checked
    chars: int = 0               # characters handed to a search (find, regex, hold-back)
    seconds: float = 0.0         # time spent in the checks (by the checker's clock)


class StopBudgetExceeded(Exception):
    """A stop_regex search ran past what was left of the token's budget."""


class StopChecker:
    """One request's stop conditions and output text (see the module docstring).  The token
    path calls `append` once per token; the streaming side reads `delta`; `final_text` at the end."""

    def __init__(self, params: SamplingParams, tokenizer: Tokenizer, eos_ids: frozenset[int],
                 max_model_len: int, limits: StopLimits = StopLimits(),
                 clock: Callable[[], float] = time.perf_counter, guide: Guide | None = None):
        self.params, self.limits, self.clock = params, limits, clock
        self.guide = guide                   # the request's grammar (advanced by `append`)
        self.eos_ids, self.max_model_len = eos_ids, max_model_len
        self._stop_ids = frozenset(params.stop_token_ids)
        self._regexes = [regex.compile(p) for p in params.stop_regex]
        self._watch = bool(params.stop or self._regexes)   # the text is needed at every token
        self._longest = max((len(s) for s in params.stop), default=0)
        # every read reaches back at most the window (regexes) or all stop strings (the hold-back)
        keep = limits.window_chars + sum(len(s) for s in params.stop) + 256
        self.detok = IncrementalDetokenizer(tokenizer, keep)
        self.work = StopWork()
        self.token_ids: list[int] = []
        self.cut: int | None = None          # the final text ends here (a stop string / regex)
        self.drop_last_token = False         # a stop token that is not part of the text
        self.matched_stop: str | int | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None        # why the request ended with finish_reason "error"
        self._emitted = 0
        self._safe = 0                       # text up to here may be streamed (see `_safe_end`)
        self._final: str | None = None

    def append(self, token: int, num_tokens: int) -> str | None:
        """Record a generated token (`num_tokens`: prompt + output so far).  Returns the
        finish reason ("stop", "length"; "error" when a stop_regex ran past the budget, see
        `error`; also when its grammar refuses the token) or None to go on."""
        self.token_ids.append(token)
        self.work.tokens += 1
        if self.guide is not None and not self.guide.accept(token):
            self.error = self.guide.error
            self.finish_reason = "error"
            return "error"
        start = self.clock()
        try:
            reason = self._check(token, num_tokens, start + self.limits.budget_s)
        except StopBudgetExceeded as e:
            reason, self.error = "error", str(e)
        if self._watch:
            self.work.seconds += self.clock() - start
            reason = self._over_mean() or reason
        if reason in (None, "length") and self.guide is not None and self.guide.stopped:
            reason = "stop"                          # the grammar is complete: only EOS could follow
        if reason == "stop" and self.guide is not None and not self.guide.active:
            self.error = (f"the output ended before its reasoning did (no {self.guide.kind} constraint marker "
                          f"was generated), so its constraint never applied")
            reason = "error"
        self.finish_reason = reason
        return reason

    def _over_mean(self) -> str | None:
        """"error" (and why) when the checks have cost more than the mean budget per token."""
        n, lim = self.work.tokens, self.limits
        if n < lim.grace_tokens or self.work.seconds <= lim.mean_budget_s * n or self.error:
            return None
        self.error = (f"the stop checks (stop / stop_regex) cost {self.work.seconds / n * 1000:.1f} ms per token "
                      f"over {n} tokens, over the limit of {lim.mean_budget_s * 1000:g} ms per token on average: "
                      "use fewer or simpler stop strings and patterns")
        return "error"

    def replay(self, tokens: Sequence[int], prompt_len: int) -> None:
        """Check `tokens`, generated before for this request elsewhere (a migrated request), as
        the token path and the stream did there: `append`, then `delta` (that text was streamed
        already and is dropped), token by token.  Held-back text and the emitted offset are then
        as they were, and the token counts of min_tokens and max_tokens include them.  The last
        token may end the request (`finish_reason`); raises ValueError when an earlier one does."""
        for i, token in enumerate(tokens):
            if self.finish_reason == "error" and self.error is not None:
                raise ValueError(self.error)
            if self.finish_reason is not None:
                raise ValueError(f"the generated tokens end the request ({self.finish_reason}) at token {i} "
                                 f"of {len(tokens)}: a resumed request carries only tokens it streamed")
            self.append(token, prompt_len + i + 1)
            self.delta()

    @property
    def text(self) -> str:
        """The decoded output so far (O(output): for tests and the end of a request)."""
        self._sync()
        return self.detok.text()

    def _sync(self) -> int:
        """Decode the ids not decoded yet (without stop strings or regexes nothing needs the text
        until it is streamed or read).  Returns the committed length before them."""
        before = self.detok.committed
        for token in self.token_ids[len(self.detok.ids):]:
            self.detok.push(token)
        return before

    def _check(self, token: int, num_tokens: int, deadline: float) -> str | None:
        p = self.params
        before = self._sync() if self._watch else 0
        if len(self.token_ids) >= p.min_tokens:
            if token in self._stop_ids or (token in self.eos_ids and not p.ignore_eos):
                self.matched_stop = token
                self.drop_last_token = not p.no_stop_trim
                return "stop"
            if self._watch and self._match_text(before, deadline):
                return "stop"
        if len(self.token_ids) >= p.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        if self._watch:
            self._safe = self._safe_end(deadline)
        return None

    def _match_text(self, before: int, deadline: float) -> bool:
        """Earliest stop string or regex match in what the token changed (`before`: the text's
        final length before it); sets cut/matched_stop."""
        best: tuple[int, int, str] | None = None      # (start, end, what matched)
        start = max(0, before - self._longest + 1)
        text = self.detok.slice(start)
        for s in self.params.stop:
            self.work.chars += len(text)
            i = text.find(s)
            if i >= 0 and (best is None or start + i < best[0]):
                best = (start + i, start + i + len(s), s)
        for rx in self._regexes:
            m, offset = self._search(rx, deadline, partial=False)
            if m and offset + m.end() > 0 and (best is None or offset + m.start() < best[0]):
                best = (offset + m.start(), offset + m.end(), rx.pattern)
        if best is None:
            return False
        self.cut = best[1] if self.params.no_stop_trim else best[0]
        self.matched_stop = best[2]
        return True

    def _search(self, rx: regex.Pattern, deadline: float, partial: bool) -> tuple[regex.Match | None, int]:
        """Search the window with what is left of the budget.  Returns the match and the
        window's offset in the text.  Raises StopBudgetExceeded."""
        length = self.detok.length
        window = max(0, length - self.limits.window_chars)
        offset = max(0, window - 1)                  # one character of context before the window
        view = self.detok.slice(offset)
        self.work.chars += len(view)
        left = deadline - self.clock()
        try:
            if left <= 0:
                raise TimeoutError
            return rx.search(view, pos=window - offset, partial=partial, timeout=left), offset
        except TimeoutError:
            budget_ms = self.limits.budget_s * 1000
            raise StopBudgetExceeded(
                f"stop_regex {rx.pattern[:80]!r} exceeded the stop-check budget of {budget_ms:g} ms per token "
                f"(searching the last {len(view)} characters of the output): use a simpler pattern") from None

    def final_text(self) -> str:
        """The whole output text as the client sees it at the end."""
        if self._final is not None:
            return self._final
        if self.drop_last_token:
            final = self.detok.tokenizer.decode(self.token_ids[:-1])
        else:
            final = self.text[:self.cut] if self.cut is not None else self.text
        if self.finish_reason is not None:
            self._final = final                     # decoded once: O(output)
        return final

    def delta(self) -> str:
        """Text that became safe to stream since the last call (all of the rest once finished;
        nothing more once it ended with an error)."""
        if self.finish_reason == "error":
            return ""
        if self.finish_reason is not None:
            final = self.final_text()
            end = max(self._emitted, len(final))
            out = final[self._emitted:end]
        else:
            if not self._watch:
                self._sync()
                self._safe = self._unfinished_end(self.detok.length)
            end = max(self._emitted, self._safe)
            out = self.detok.slice(self._emitted, end)
        self._emitted = end
        return out

    def _unfinished_end(self, end: int) -> int:
        """`end` less the U+FFFD run before it (a character still being decoded)."""
        start = max(0, end - 64)                    # a longer run is not text: it streams at the end
        tail = self.detok.slice(start, end)
        return start + len(tail.rstrip(REPLACEMENT)) if tail.endswith(REPLACEMENT) else end

    def _safe_end(self, deadline: float) -> int:
        """Where the text that may not grow into a stop ends: before a suffix that is a prefix
        of a stop string (each stop string in turn, from where the previous one left it), and
        before a partial regex match."""
        end = self._unfinished_end(self.detok.length)
        for s in self.params.stop:
            end -= self._overlap(end, s)
        for rx in self._regexes:
            m, offset = self._search(rx, deadline, partial=True)
            if m is not None and m.partial:
                end = min(end, offset + m.start())
        return end

    def _overlap(self, end: int, s: str) -> int:
        """The largest k < len(s) with text[end-k:end] == s[:k] (0: none)."""
        tail = self.detok.slice(max(0, end - len(s) + 1), end)
        self.work.chars += len(tail)
        j = tail.find(s[0])
        while j >= 0:                                # longest candidate first
            if s.startswith(tail[j:]):
                return len(tail) - j
            j = tail.find(s[0], j + 1)
        return 0
