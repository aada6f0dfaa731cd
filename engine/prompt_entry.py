"""One prompt token's logprob entry (computed by engine/prompt_logprobs.py): a leaf module
without torch, so the proto conversions and the gateway's side share it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's entry: its logprob given the tokens before it, its rank in that
    distribution (1: the most likely), and the top alternatives (token, logprob), best first."""
    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()
