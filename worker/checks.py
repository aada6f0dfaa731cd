"""A worker's own check of a request's prompt (defence in depth behind the gateway)."""

from __future__ import annotations

from engine.params import SamplingParams
from engine.validate import RequestError
from engine.validate import check_prompt as engine_check
from worker.types import ErrorCode, WorkerError


def check_prompt(ids: list[int], params: SamplingParams, vocab: int, max_model_len: int, kv_tokens: int,
                 reserve_output: bool = True) -> None:
    """The engine's prompt checks, as a WorkerError with their code."""
    try:
        engine_check(ids, params, vocab, max_model_len, kv_tokens, reserve_output)
    except RequestError as e:
        raise WorkerError(ErrorCode(e.code.value), str(e)) from None
