"""Response bodies in the OpenAI shapes: chat and text completions, their stream chunks,
logprobs, usage and errors."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.errors import ErrorCode
from engine.tokenizer import Tokenizer
from proto import worker_pb2 as wpb

if TYPE_CHECKING:
    from gateway.reader import ChoiceReader

# What a client is told of a request that failed past the gateway, by code: never a worker's
# address, a gRPC status or another request's id (those stay in the gateway's log, under the
# request id the client is given).  A refusal of the request itself (INVALID_REQUEST,
# PROMPT_TOO_LONG) is about what the client sent and keeps the worker's words.
PUBLIC_MESSAGES = {
    ErrorCode.KV_FULL: "the decode workers have no room for this request now; retry later",
    ErrorCode.UNAVAILABLE: "the worker was shutting down; retry",
    ErrorCode.NO_WORKER: "no worker can take this request now; retry later",
    ErrorCode.PREFILL_UNAVAILABLE: "no prefill worker could be reached; retry later",
    ErrorCode.DECODE_UNAVAILABLE: "no decode worker could be reached; retry later",
    ErrorCode.DECODE_FAILED: "the decode worker failed while generating",
    ErrorCode.DRAINING: "the workers were draining; retry later",
    ErrorCode.MIGRATION_FAILED: "the decode worker failed while generating and the stream could not be "
                                "continued on another; retry",
    ErrorCode.TRANSFER_FAILED: "the prompt's KV cache could not be moved between the workers",
    ErrorCode.UNKNOWN_PEER: "the prompt's KV cache could not be moved between the workers",
    ErrorCode.TIMEOUT: "the request ran past its timeout",
    ErrorCode.CANCELLED: "the request was cancelled",
    ErrorCode.ABORTED: "the request was aborted",
    ErrorCode.INTERNAL: "internal error",
}
CLIENT_CODES = frozenset({ErrorCode.INVALID_REQUEST, ErrorCode.PROMPT_TOO_LONG})


@dataclass
class ChoiceState:
    """What one choice has produced so far."""
    index: int
    prompt_tokens: int
    prompt_group: int = 0             # which prompt of the request (n choices share one)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[wpb.TokenLogprobs] = field(default_factory=list)
    finish: wpb.Finish | None = None
    # a chat choice whose output is read for reasoning and tool calls (gateway/reader.py); None:
    # its text is the message's content
    reader: ChoiceReader | None = None

    def add(self, tokens: wpb.Tokens) -> None:
        self.text += tokens.text
        self.token_ids += list(tokens.token_ids)
        self.logprobs += list(tokens.logprobs)
        if self.reader is not None:
            self.reader.feed(tokens.text, tokens.token_ids)

    @property
    def finish_reason(self) -> str | None:
        """The Finish's reason; "tool_calls" for a choice that stopped having made calls."""
        reason = self.finish.finish_reason if self.finish else None
        return self.reader.finish_reason(reason) if self.reader is not None else reason

    @property
    def matched_stop(self) -> str | int | None:
        """The stop string or regex that ended the choice, or the stop token's id (None: none)."""
        f = self.finish
        if f is None:
            return None
        matched: str | int | None = f.matched_token_id if f.matched_token else (f.matched_stop or None)
        return matched


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; with `cached` (prompt tokens the decode workers' prefix caches
    held) also its prompt_tokens_details.cached_tokens."""
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def public_message(code: ErrorCode, detail: str, request_id: str) -> str:
    """What the client is told of a failed request (see PUBLIC_MESSAGES), with its request id."""
    if code in CLIENT_CODES:
        return detail
    return f"{PUBLIC_MESSAGES.get(code, 'internal error')} (request id {request_id})"


def _token(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def _top(entry: wpb.TokenLogprobs, n: int) -> list[tuple[int, float]]:
    pairs = sorted(((t.token_id, t.logprob) for t in entry.top), key=lambda p: -p[1])
    return pairs[:n]


def chat_logprobs(tok: Tokenizer, entries: list[wpb.TokenLogprobs], n: int) -> dict[str, Any]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        s = _token(tok, token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode())}
    return {"content": [{**one(e.token_id, e.logprob),
                         "top_logprobs": [one(t, lp) for t, lp in _top(e, n)]} for e in entries]}


def completion_logprobs(tok: Tokenizer, entries: list[wpb.TokenLogprobs], n: int, offset: int) -> dict[str, Any]:
    tokens = [_token(tok, e.token_id) for e in entries]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_token(tok, t): lp for t, lp in _top(e, n)} for e in entries],
            "text_offset": offsets}


class Formatter:
    """Builds the bodies of one response (one id, one created time, one model name)."""

    def __init__(self, kind: str, model: str, tok: Tokenizer, logprobs_n: int | None,
                 token_ids: bool = False, continuous_usage: bool = False):
        self.kind, self.model, self.tok, self.logprobs_n = kind, model, tok, logprobs_n
        self.token_ids = token_ids
        # vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so
        # far (the prompt, and the tokens of this and the earlier chunks of that choice)
        self.continuous_usage = continuous_usage
        self._streamed: dict[int, int] = {}  # choice index -> tokens in its chunks so far
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = int(time.time())

    def _logprobs(self, entries: list[wpb.TokenLogprobs], offset: int = 0) -> dict[str, Any] | None:
        if self.logprobs_n is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(self.tok, entries, self.logprobs_n)
        return completion_logprobs(self.tok, entries, self.logprobs_n, offset)

    def response(self, choices: list[ChoiceState]) -> dict[str, Any]:
        out = []
        for c in choices:
            if c.reader is not None:
                c.reader.finish()
            body: dict[str, Any] = {"index": c.index, "logprobs": self._logprobs(c.logprobs),
                                    "finish_reason": c.finish_reason, "matched_stop": c.matched_stop}
            if self.kind == "chat":
                body["message"] = c.reader.message() if c.reader is not None else \
                    {"role": "assistant", "content": c.text}
            else:
                body["text"] = c.text
            if self.token_ids:
                body["token_ids"] = c.token_ids
            out.append(body)
        prompt = prompt_tokens(choices)
        return {"id": self.id, "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": out,
                "usage": usage(prompt, sum(len(c.token_ids) for c in choices), cached_tokens(choices))}

    def chunk(self, c: ChoiceState, text: str, entries: list[wpb.TokenLogprobs], first: bool = False,
              offset: int = 0, ids: list[int] | None = None, delta: dict[str, Any] | None = None) -> dict[str, Any]:
        """One stream chunk of choice `c`: its `text` (or, for a choice with a reader, the
        reader's `delta`), the logprobs `entries` and token `ids` it came with."""
        body: dict[str, Any] = {"index": c.index, "logprobs": self._logprobs(entries, offset) if entries else None,
                                "finish_reason": c.finish_reason}
        if c.finish is not None:
            body["matched_stop"] = c.matched_stop
        if self.kind == "chat" and delta is not None:
            body["delta"] = {"role": "assistant", **delta} if first else delta
        elif self.kind == "chat":
            body["delta"] = ({"role": "assistant", "content": text} if first else {"content": text}) \
                if (text or first) else {}
        else:
            body["text"] = text
        if self.token_ids:
            body["token_ids"] = ids or []
        kind = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        chunk: dict[str, Any] = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                                 "choices": [body]}
        self._streamed[c.index] = self._streamed.get(c.index, 0) + len(ids or [])
        if self.continuous_usage:
            # the choice's cached tokens come with its Finish: in its last chunk
            chunk["usage"] = usage(c.prompt_tokens, self._streamed[c.index],
                                   c.finish.cached_tokens if c.finish is not None else None)
        return chunk

    def usage_chunk(self, choices: list[ChoiceState]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": [],
                "usage": usage(prompt_tokens(choices), sum(len(c.token_ids) for c in choices),
                               cached_tokens(choices))}


def prompt_tokens(choices: list[ChoiceState]) -> int:
    """Prompt tokens counted once per prompt (n choices of one prompt share it)."""
    seen: dict[int, int] = {}
    for c in choices:
        seen[c.prompt_group] = c.prompt_tokens
    return sum(seen.values())


def cached_tokens(choices: list[ChoiceState]) -> int:
    """Prompt tokens served from the decode workers' prefix caches (Finish.cached_tokens),
    counted once per prompt like `prompt_tokens`: of a prompt's n choices, the fewest any of
    them got (each choice's prompt is matched on its own)."""
    seen: dict[int, int] = {}
    for c in choices:
        got = c.finish.cached_tokens if c.finish is not None else 0
        seen[c.prompt_group] = min(seen.get(c.prompt_group, got), got)
    return sum(seen.values())
