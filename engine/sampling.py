"""Sampling parameters and the batched sampler (greedy, temperature, top-k, top-p,
per-request seeds, logprobs of the chosen token plus the top N)."""

from __future__ import annotations

from dataclasses import dataclass

import regex
import torch

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
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
            _check(isinstance(pattern, str) and pattern, "stop_regex patterns must be non-empty strings")
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


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[dict[int, float] | None]


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator]) -> SampleOutput:
    """Pick one token per row.  logits: [B, V] fp32 (raw model output).

    Logprobs are those of the raw model distribution (before temperature and cuts).
    Each row's random draw comes from its own generator, so a seeded request samples
    the same tokens whatever else is in the batch.
    """
    b = logits.shape[0]
    tokens = logits.argmax(dim=-1)  # [B]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        tokens[rows] = _sample_rows(logits[rows], [params[i] for i in sampled],
                                    [generators[i] for i in sampled])
    token_list = tokens.tolist()
    want = [p.logprobs for p in params]
    if all(w is None for w in want):
        return SampleOutput(token_list, [None] * b)
    logp = torch.log_softmax(logits, dim=-1)
    top_n = max(w for w in want if w is not None)
    top_vals, top_ids = logp.topk(top_n, dim=-1) if top_n else (None, None)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1).tolist()
    out: list[dict[int, float] | None] = []
    for i, n in enumerate(want):
        if n is None:
            out.append(None)
            continue
        entry = {token_list[i]: chosen[i]}
        if n:
            for tid, val in zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist()):
                entry.setdefault(tid, val)
        out.append(entry)
    return SampleOutput(token_list, out)


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator]) -> torch.Tensor:
    """Temperature, top-k and top-p over sorted logits, then an inverse-CDF draw."""
    temp = torch.tensor([p.temperature for p in params], device=logits.device)
    scaled = logits / temp[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [R, V]
    rank = torch.arange(logits.shape[1], device=logits.device)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else logits.shape[1] for p in params],
                         device=logits.device)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=probs.dtype)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    probs = probs.masked_fill((before >= top_p[:, None]) & (rank > 0), 0.0)
    cdf = probs.cumsum(dim=-1)
    u = torch.stack([torch.rand((), generator=g) for g in generators]).to(logits.device)
    u = u * cdf[:, -1]
    pick = torch.searchsorted(cdf, u[:, None]).clamp_(max=logits.shape[1] - 1)  # [R, 1]
    return order.gather(1, pick).squeeze(1)
