"""The checks every component applies to a request's prompt before reserving anything: the
single-process `LLM`, and each worker again (defence in depth behind the gateway)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.errors import ErrorCode, RequestError
from engine.params import MAX_PROMPT_LOGPROB_ENTRIES, SamplingParams


def check_prompt(ids: list[int], params: SamplingParams, vocab: int, max_model_len: int, kv_tokens: int,
                 reserve_output: bool = True) -> None:
    """Raises RequestError naming what is wrong and the limit.  `reserve_output=False` (prefill)
    needs KV room for the prompt only."""
    if not ids:
        raise RequestError(ErrorCode.INVALID_REQUEST, "empty prompt: at least one token is needed")
    for i, t in enumerate(ids):
        if not isinstance(t, int) or not 0 <= t < vocab:
            raise RequestError(ErrorCode.INVALID_REQUEST,
                               f"prompt token {i} is {t!r}, not a token id in 0..{vocab - 1}")
    check_prompt_logprobs(len(ids), params.prompt_logprobs)
    for t, _ in params.logit_bias:
        if not t < vocab:
            raise RequestError(ErrorCode.INVALID_REQUEST,
                               f"logit_bias token {t} is not a token id in 0..{vocab - 1}")
    total = len(ids) + params.max_tokens
    head = f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total}"
    if total > max_model_len:
        raise RequestError(ErrorCode.PROMPT_TOO_LONG, f"{head} exceeds the model context of {max_model_len} tokens")
    if (total if reserve_output else len(ids)) > kv_tokens:
        raise RequestError(ErrorCode.PROMPT_TOO_LONG, f"{head} exceeds the KV cache capacity of {kv_tokens} tokens")


def check_prompt_logprobs(prompt_tokens: int, n: int | None) -> None:
    """Raises RequestError when the prompt logprobs asked for exceed MAX_PROMPT_LOGPROB_ENTRIES."""
    if n is not None and prompt_tokens * (1 + n) > MAX_PROMPT_LOGPROB_ENTRIES:
        raise RequestError(ErrorCode.INVALID_REQUEST,
                           f"prompt logprobs for {prompt_tokens} prompt tokens with {n} alternatives each "
                           f"({prompt_tokens * (1 + n)} entries) exceed the limit of "
                           f"{MAX_PROMPT_LOGPROB_ENTRIES} entries per request")


def check_generated(generated: Sequence[int], params: SamplingParams, vocab: int, handoff: bool) -> None:
    """A migrated request's tokens generated before: token ids of the vocabulary, at most
    max_tokens of them (fewer for a prefill, which must sample one more).  Raises RequestError."""
    for i, t in enumerate(generated):
        if not isinstance(t, int) or not 0 <= t < vocab:
            raise RequestError(ErrorCode.INVALID_REQUEST,
                               f"generated token {i} is {t!r}, not a token id in 0..{vocab - 1}")
    limit = params.max_tokens - 1 if handoff and not params.prefill_only else params.max_tokens
    if len(generated) > limit:
        raise RequestError(ErrorCode.INVALID_REQUEST, f"{len(generated)} generated tokens leave nothing to "
                           f"generate: max_tokens is {params.max_tokens}")
