"""Stop conditions and the output text of one request, also while it streams.

Per request a `StopChecker` keeps the decoded output text and decides, after each new
token, whether the request stops: a stop token (EOS unless `ignore_eos`, `stop_token_ids`),
a stop string, a stop regex (matched against the text, never searched for literally), or
length.  None of them fires before `min_tokens`.  A matched stop string or regex match is
cut from the text with everything after it; `no_stop_trim` keeps the match (and a stop
token's text).  While streaming, `delta()` holds back text that might still become part of
a stop: a suffix that is a prefix of a stop string, a partial regex match, or an
incomplete UTF-8 character.
"""

from __future__ import annotations

import regex

from engine.params import SamplingParams
from engine.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"   # what decoding shows for an incomplete UTF-8 sequence


class StopChecker:
    def __init__(self, params: SamplingParams, tokenizer: Tokenizer, eos_ids: frozenset[int],
                 max_model_len: int):
        self.params, self.tokenizer = params, tokenizer
        self.eos_ids, self.max_model_len = eos_ids, max_model_len
        self._regexes = [regex.compile(p) for p in params.stop_regex]
        self._watch = bool(params.stop or self._regexes)   # the text is needed at every token
        self._longest = max((len(s) for s in params.stop), default=0)
        self.token_ids: list[int] = []
        self._text, self._decoded = "", 0    # the output text, decoded from the first _decoded ids
        self.cut: int | None = None          # the final text ends here (a stop string / regex)
        self.drop_last_token = False         # a stop token that is not part of the text
        self.matched_stop: str | int | None = None
        self.finish_reason: str | None = None
        self._emitted = 0

    def append(self, token: int, num_tokens: int) -> str | None:
        """Record a generated token (`num_tokens`: prompt + output so far).  Returns the
        finish reason ("stop", "length") or None to go on."""
        before = len(self.text) if self._watch else 0
        self.token_ids.append(token)
        reason = self._check(token, before, num_tokens)
        self.finish_reason = reason
        return reason

    @property
    def text(self) -> str:
        """The decoded output so far (decoded on demand: without stop strings or regexes,
        nothing needs it until the text is streamed or read)."""
        if self._decoded != len(self.token_ids):
            self._text, self._decoded = self.tokenizer.decode(self.token_ids), len(self.token_ids)
        return self._text

    def _check(self, token: int, before: int, num_tokens: int) -> str | None:
        p = self.params
        if len(self.token_ids) >= p.min_tokens:
            if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
                self.matched_stop = token
                self.drop_last_token = not p.no_stop_trim
                return "stop"
            if self._watch and self._match_text(before):
                return "stop"
        if len(self.token_ids) >= p.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None

    def _match_text(self, before: int) -> bool:
        """Earliest stop string or regex match ending in the new text; sets cut/matched_stop."""
        best: tuple[int, int, str] | None = None      # (start, end, what matched)
        start_from = max(0, before - self._longest + 1)
        for s in self.params.stop:
            i = self.text.find(s, start_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, i + len(s), s)
        for rx in self._regexes:
            m = rx.search(self.text)
            if m and m.end() > 0 and (best is None or m.start() < best[0]):
                best = (m.start(), m.end(), rx.pattern)
        if best is None:
            return False
        self.cut = best[1] if self.params.no_stop_trim else best[0]
        self.matched_stop = best[2]
        return True

    def final_text(self) -> str:
        """The whole output text as the client sees it at the end."""
        if self.cut is not None:
            return self.text[:self.cut]
        if self.drop_last_token:
            return self.tokenizer.decode(self.token_ids[:-1])
        return self.text

    def delta(self) -> str:
        """Text that became safe to stream since the last call (all of the rest once finished)."""
        if self.finish_reason is not None:
            final = self.final_text()
            end = max(self._emitted, len(final))
            out = final[self._emitted:end]
        else:
            end = max(self._emitted, self._safe_end())
            out = self.text[self._emitted:end]
        self._emitted = end
        return out

    def _safe_end(self) -> int:
        text = self.text
        end = len(text.rstrip(REPLACEMENT))
        for s in self.params.stop:                 # a suffix that may grow into a stop string
            for k in range(min(len(s) - 1, end), 0, -1):
                if text.endswith(s[:k], 0, end):
                    end -= k
                    break
        for rx in self._regexes:                   # a match that may still complete
            m = rx.search(text, partial=True)
            if m is not None and m.partial:
                end = min(end, m.start())
        return end
