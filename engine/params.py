"""A request's sampling parameters: the one list of their fields, with their checks.

A leaf module with no heavy imports (no torch), so the gateway, the proto conversions and
the workers share one definition.  `engine.sampling` holds the sampler that reads them.

Every integer field is refused outside the range its wire field can carry (proto/worker.proto:
max_tokens, min_tokens and stop_token_ids are uint32, top_k int32, seed uint64), so a value
the gateway accepts always reaches a worker unchanged.  The stop lists are capped (see the
MAX_STOP_* constants) and a stop_regex whose compilation alone is unbounded is refused
(`check_stop_regex`): whatever a client sends, the per-token stop check stays bounded."""

from __future__ import annotations

import math
from dataclasses import dataclass

import regex
from regex import _regex_core

from engine.constraint import Constraint

MAX_LOGPROBS = 20
# logit_bias: OpenAI's range of a bias, and how many tokens one request may bias (OpenAI states no
# count; each entry costs one add per sampled token)
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024
# prompt logprobs: prompt tokens x (1 + alternatives) one request may ask for (what the prefill
# worker sends back in one reply: about 25 bytes an entry, well under gRPC's 4 MiB message)
MAX_PROMPT_LOGPROB_ENTRIES = 100_000
UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
# Caps on the stop lists.  OpenAI accepts up to 4 stop strings and no stop_regex; vLLM caps
# neither (its per-token cost then grows with them).  Tandem allows 4x OpenAI's count of stop
# strings (chat templates bring several end markers of their own), strings of at most 256
# characters, and 4 patterns of at most 512 characters; stop_token_ids (vLLM: uncapped, one
# set lookup per token) at most 256 ids.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_REGEXES = 4
MAX_STOP_REGEX_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
# `regex` expands counted repetitions when it compiles: `(?:a{1000}){1000}` (17 characters)
# takes 0.6 s and 270 MB, one more level exhausts memory.  A pattern whose repetition counts
# (nested ones multiplied) exceed this is refused before it is compiled.
MAX_STOP_REGEX_EXPANSION = 16_384
# the one timeout of an admitted request, seconds: the gateway's default (GatewaySettings.request_timeout_s)
# and the longest a worker lets a Generate's reservation wait (worker/config.py MAX_REQUEST_TIMEOUT_S)
REQUEST_TIMEOUT_S = 600.0


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
    constraint: Constraint | None = None   # structured output: the grammar the output follows
    # the log-probabilities of the prompt's own tokens (each given the tokens before it), with the
    # top N alternatives: None for none.  With max_tokens 0 the request only prefills
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias added to its logit) before sampling

    def __post_init__(self) -> None:
        for name in ("stop", "stop_regex"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "logit_bias", tuple((t, b) for t, b in self.logit_bias or ()))
        _check(self.prompt_logprobs is None or _int_in(self.prompt_logprobs, 0, MAX_LOGPROBS),
               f"prompt_logprobs must be in 0..{MAX_LOGPROBS}, got {self.prompt_logprobs!r}")
        _check(_int_in(self.max_tokens, 0 if self.prompt_logprobs is not None else 1, UINT32_MAX),
               f"max_tokens must be an integer >= 1 (0 only with prompt_logprobs: prefill only) and "
               f"<= {UINT32_MAX}, got {self.max_tokens!r}")
        _check(_real(self.temperature) and 0 <= self.temperature < math.inf,
               f"temperature must be >= 0 and finite, got {self.temperature!r}")
        _check(_real(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_int_in(self.top_k, -1, INT32_MAX),
               f"top_k must be -1 (off) or in 1..{INT32_MAX}, got {self.top_k!r}")
        _check(self.seed is None or _int_in(self.seed, 0, UINT64_MAX),
               f"seed must be an integer in 0..{UINT64_MAX} (64 bits), got {self.seed!r}")
        _check(_int_in(self.min_tokens, 0, self.max_tokens),
               f"min_tokens must be an integer in 0..max_tokens ({self.max_tokens}), got {self.min_tokens!r}")
        _check(self.logprobs is None or _int_in(self.logprobs, 0, MAX_LOGPROBS),
               f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs!r}")
        self._check_stops()
        self._check_bias()
        _check(self.constraint is None or isinstance(self.constraint, Constraint),
               f"constraint must be an engine.constraint.Constraint, got {type(self.constraint).__name__}")

    def _check_stops(self) -> None:
        _check(len(self.stop) <= MAX_STOP_STRINGS,
               f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        for s in self.stop:
            _check(isinstance(s, str) and bool(s), "stop strings must be non-empty strings")
            _check(len(s) <= MAX_STOP_STRING_CHARS,
                   f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, got one of {len(s)}")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
               f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        _check(all(_int_in(t, 0, UINT32_MAX) for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers <= {UINT32_MAX}")
        _check(len(self.stop_regex) <= MAX_STOP_REGEXES,
               f"stop_regex has {len(self.stop_regex)} patterns; at most {MAX_STOP_REGEXES} are allowed")
        for pattern in self.stop_regex:
            _check(isinstance(pattern, str) and bool(pattern), "stop_regex patterns must be non-empty strings")
            _check(len(pattern) <= MAX_STOP_REGEX_CHARS,
                   f"stop_regex patterns must be at most {MAX_STOP_REGEX_CHARS} characters, got one of "
                   f"{len(pattern)} ({pattern[:40]!r}...)")
            check_stop_regex(pattern)

    def _check_bias(self) -> None:
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS_TOKENS,
               f"logit_bias has {len(self.logit_bias)} tokens; at most {MAX_LOGIT_BIAS_TOKENS} are allowed")
        seen: set[int] = set()
        for t, b in self.logit_bias:
            _check(_int_in(t, 0, UINT32_MAX) and t not in seen,
                   f"logit_bias keys must be distinct token ids in 0..{UINT32_MAX}, got {t!r}")
            _check(_real(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS,
                   f"logit_bias values must be in -{MAX_LOGIT_BIAS:g}..{MAX_LOGIT_BIAS:g}, got {b!r} for token {t}")
            seen.add(t)

    @property
    def prefill_only(self) -> bool:
        """max_tokens 0: the prompt is computed (for its logprobs) and nothing is generated."""
        return self.max_tokens == 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_stop_regex(pattern: str) -> None:
    """Raises ValueError naming `pattern` when it is not a valid regular expression, matches the
    empty string, or cannot be compiled in bounded time and memory (`MAX_STOP_REGEX_EXPANSION`).
    How long a search may take is bounded where it runs (`engine.stop`)."""
    size = _expansion(pattern)
    _check(size <= MAX_STOP_REGEX_EXPANSION,
           f"stop_regex {pattern[:40]!r} repeats too much: its counted repetitions expand to {size} "
           f"nodes, more than the limit of {MAX_STOP_REGEX_EXPANSION}")
    try:
        compiled = regex.compile(pattern)
    except regex.error as e:
        raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from None
    _check(compiled.search("") is None, f"stop_regex {pattern!r} matches the empty string")


def _expansion(pattern: str) -> int:
    """How many nodes compiling `pattern` may create: every node counts 1, a repetition
    multiplies what it repeats by its largest count.  Read from `regex`'s own parse tree (the
    parser expands nothing; it is what `regex.compile` runs first, global flags included)."""
    flags = 0
    while True:
        source = _regex_core.Source(pattern)
        info = _regex_core.Info(flags, source.char_type, {})
        source.ignore_space = bool(info.flags & regex.VERBOSE)
        try:
            return _weight(_regex_core._parse_pattern(source, info))
        except _regex_core._UnscopedFlagSet:     # a global flag (e.g. (?x)) found late: parse again
            flags = info.global_flags
        except regex.error as e:
            raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from None


def _weight(node: object) -> int:
    children: list[object] = []
    for value in vars(node).values():
        if isinstance(value, _regex_core.RegexBase):
            children.append(value)
        elif isinstance(value, (list, tuple)):
            children.extend(v for v in value if isinstance(v, _regex_core.RegexBase))
    inner = sum(_weight(child) for child in children)
    if hasattr(node, "min_count"):                 # GreedyRepeat, LazyRepeat, PossessiveRepeat
        inner *= max(getattr(node, "min_count") or 0, getattr(node, "max_count", None) or 0, 1)
    return 1 + inner


def _int_in(value: object, low: int, high: int) -> bool:
    """An int (not a bool) in low..high."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
