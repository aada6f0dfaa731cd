"""The checks every component applies to a request's prompt before reserving anything: the
single-process `LLM`, and each worker again (defence in depth behind the gateway)."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from engine.params import SamplingParams


class Problem(enum.StrEnum):
    """What is wrong with a refused prompt (the same words as the worker's error codes)."""
    INVALID_REQUEST = "INVALID_REQUEST"      # empty, or a token id outside the vocabulary
    PROMPT_TOO_LONG = "PROMPT_TOO_LONG"      # prompt + max_tokens over the context or the KV capacity
    # no room now, the request itself is fine: a worker's grammar checkers all busy (the caller
    # waits and retries, as for a full KV cache)
    BUSY = "KV_FULL"


class RequestError(ValueError):
    """A refused request: what is wrong (`code`) and a message with the numbers."""

    def __init__(self, code: Problem, message: str):
        super().__init__(message)
        self.code = code


def check_prompt(ids: list[int], params: SamplingParams, vocab: int, max_model_len: int, kv_tokens: int,
                 reserve_output: bool = True) -> None:
    """Raises RequestError naming what is wrong and the limit.  `reserve_output=False` (prefill)
    needs KV room for the prompt only."""
    if not ids:
        raise RequestError(Problem.INVALID_REQUEST, "empty prompt: at least one token is needed")
    for i, t in enumerate(ids):
        if not isinstance(t, int) or not 0 <= t < vocab:
            raise RequestError(Problem.INVALID_REQUEST, f"prompt token {i} is {t!r}, not a token id in 0..{vocab - 1}")
    total = len(ids) + params.max_tokens
    head = f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total}"
    if total > max_model_len:
        raise RequestError(Problem.PROMPT_TOO_LONG, f"{head} exceeds the model context of {max_model_len} tokens")
    if (total if reserve_output else len(ids)) > kv_tokens:
        raise RequestError(Problem.PROMPT_TOO_LONG, f"{head} exceeds the KV cache capacity of {kv_tokens} tokens")


def check_generated(generated: Sequence[int], params: SamplingParams, vocab: int, handoff: bool) -> None:
    """A migrated request's tokens generated before: token ids of the vocabulary, at most
    max_tokens of them (fewer for a prefill, which must sample one more).  Raises RequestError."""
    for i, t in enumerate(generated):
        if not isinstance(t, int) or not 0 <= t < vocab:
            raise RequestError(Problem.INVALID_REQUEST,
                               f"generated token {i} is {t!r}, not a token id in 0..{vocab - 1}")
    limit = params.max_tokens - 1 if handoff else params.max_tokens
    if len(generated) > limit:
        raise RequestError(Problem.INVALID_REQUEST, f"{len(generated)} generated tokens leave nothing to "
                           f"generate: max_tokens is {params.max_tokens}")
