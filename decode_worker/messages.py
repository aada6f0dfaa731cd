"""Protobuf <-> engine conversions shared by the workers and their clients, and the
worker's coded errors."""

from __future__ import annotations

from engine.sampling import SamplingParams
from engine.validate import RequestError
from engine.validate import check_prompt as engine_check
from proto import worker_pb2 as wpb


class WorkerError(Exception):
    """A request refused or ended by a worker, with a code the caller can act on."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message

    def to_proto(self) -> wpb.Error:
        return wpb.Error(code=self.code, message=self.message)


def params_from_proto(p: wpb.SamplingParams) -> SamplingParams:
    """Raises WorkerError(INVALID_REQUEST) naming the bad parameter."""
    try:
        return SamplingParams(
            max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
            seed=p.seed if p.has_seed else None, stop=tuple(p.stop),
            stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos,
            logprobs=None if p.logprobs < 0 else p.logprobs, min_tokens=p.min_tokens,
            stop_regex=tuple(p.stop_regex), no_stop_trim=p.no_stop_trim)
    except ValueError as e:
        raise WorkerError("INVALID_REQUEST", str(e)) from None


def params_to_proto(p: SamplingParams) -> wpb.SamplingParams:
    return wpb.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
        has_seed=p.seed is not None, seed=p.seed or 0, stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        logprobs=-1 if p.logprobs is None else p.logprobs, min_tokens=p.min_tokens,
        stop_regex=list(p.stop_regex), no_stop_trim=p.no_stop_trim)


def logprobs_to_proto(token: int, entry: dict[int, float] | None) -> wpb.TokenLogprobs | None:
    if entry is None:
        return None
    return wpb.TokenLogprobs(token_id=token, logprob=entry[token],
                             top=[wpb.TopLogprob(token_id=t, logprob=v) for t, v in entry.items()])


def finish_to_proto(reason: str, matched, prompt_tokens: int, completion_tokens: int) -> wpb.Finish:
    f = wpb.Finish(finish_reason=reason, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
    if isinstance(matched, int):
        f.matched_token, f.matched_token_id = True, matched
    elif matched is not None:
        f.matched_stop = matched
    return f


def check_prompt(ids, params: SamplingParams, vocab: int, max_model_len: int, kv_tokens: int,
                 reserve_output: bool = True) -> None:
    """The engine's prompt checks, as a WorkerError with their code."""
    try:
        engine_check(ids, params, vocab, max_model_len, kv_tokens, reserve_output)
    except RequestError as e:
        raise WorkerError(e.code, str(e)) from None


def prefill_request(request_id: str, tenant: str, ids: list[int], params: SamplingParams,
                    res: wpb.Reservation) -> wpb.PrefillRequest:
    """The Prefill call that fills the decode worker's reservation `res`, with the seed the
    reservation chose (prefill's first token and the decode stream continue one sampler)."""
    p = params_to_proto(params)
    p.has_seed, p.seed = True, res.seed
    return wpb.PrefillRequest(request_id=request_id, tenant=tenant, prompt_token_ids=ids, params=p,
                              decode_endpoint=res.transfer_endpoint, transfer_id=res.transfer_id)
