"""A request's sampling parameters: the one list of their fields, with their checks.

A leaf module with no heavy imports (no torch), so the gateway, the proto conversions and
the workers share one definition.  `engine.sampling` holds the sampler that reads them."""

from __future__ import annotations

from dataclasses import dataclass

import regex

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """Raises ValueError naming the bad parameter and its allowed range."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1          # -1 or 0: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; N: the chosen token plus the top N
    min_tokens: int = 0          # no stop (EOS, stop ids, strings, regexes) before this many tokens
    stop_regex: tuple[str, ...] = ()   # stop where the output first matches any of these
    no_stop_trim: bool = False   # keep the matched stop text (string, regex or stop token)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if isinstance(self.stop_regex, str):
            object.__setattr__(self, "stop_regex", (self.stop_regex,))
        object.__setattr__(self, "stop_regex", tuple(self.stop_regex or ()))
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int) and (self.top_k >= 1 or self.top_k in (0, -1)),
               f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        _check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in 0..max_tokens ({self.max_tokens}), got {self.min_tokens!r}")
        for pattern in self.stop_regex:
            _check(isinstance(pattern, str) and bool(pattern), "stop_regex patterns must be non-empty strings")
            try:
                compiled = regex.compile(pattern)
            except regex.error as e:
                raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from None
            _check(compiled.search("") is None, f"stop_regex {pattern!r} matches the empty string")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
