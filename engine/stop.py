"""Stop conditions of a request: EOS, stop token ids, stop strings, length."""

from __future__ import annotations

from engine.request import Request
from engine.tokenizer import Tokenizer


def check_stop(req: Request, tokenizer: Tokenizer, eos_ids: frozenset[int], max_model_len: int) -> str | None:
    """After a token was appended: the finish reason, or None to go on.

    On a stop string, records where the text is cut (the match and all after it).
    """
    token = req.output_token_ids[-1]
    if token in req.params.stop_token_ids or (token in eos_ids and not req.params.ignore_eos):
        return "stop"
    if req.params.stop:
        text = tokenizer.decode(req.output_token_ids)
        hits = [i for i in (text.find(s) for s in req.params.stop) if i >= 0]
        if hits:
            req.stop_text_end = min(hits)
            return "stop"
    if len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= max_model_len:
        return "length"
    return None


def final_text(req: Request, tokenizer: Tokenizer, eos_ids: frozenset[int]) -> str:
    """The output text: without a final stop/EOS token, cut before a matched stop string."""
    ids = req.output_token_ids
    if req.finish_reason == "stop" and ids and (ids[-1] in req.params.stop_token_ids or ids[-1] in eos_ids):
        ids = ids[:-1]
    text = tokenizer.decode(ids)
    return text[:req.stop_text_end] if req.stop_text_end is not None else text
