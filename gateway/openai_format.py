"""Response bodies in the OpenAI shapes: chat and text completions and their stream chunks,
with logprobs and usage, read from the choices (gateway/choice.py).  Error bodies are
gateway/errors.py's."""

from __future__ import annotations

import time
import uuid
from typing import Any

from engine.tokenizer import Tokenizer
from gateway.choice import Choice
from proto import worker_pb2 as wpb


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


def completion_logprobs(tok: Tokenizer, entries: list[wpb.TokenLogprobs], n: int, offset: int,
                        prompt: tuple[list[int], list[wpb.PromptLogprob]] | None = None) -> dict[str, Any]:
    """The legacy completions' logprobs of `entries` from text offset `offset`; with `prompt`
    (echo: the prompt's ids and their entries) the prompt's tokens come first, from offset 0, the
    first of them with null logprobs (nothing precedes it)."""
    tokens, logprobs, tops = [], [], []
    if prompt is not None:
        ids, scored = prompt
        tokens = [_token(tok, t) for t in ids]
        logprobs = [None] + [e.logprob for e in scored]
        tops = [None] + [{_token(tok, t): lp for t, lp in _top(e, n)} for e in scored]
        offset = 0
    tokens += [_token(tok, e.token_id) for e in entries]
    logprobs += [e.logprob for e in entries]
    tops += [{_token(tok, t): lp for t, lp in _top(e, n)} for e in entries]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(tok: Tokenizer, entries: list[wpb.PromptLogprob]) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: per prompt token (null for the first), {token id: {logprob, rank,
    decoded_token}} for the token itself and its top alternatives."""
    out: list[dict[str, Any] | None] = [None]
    for e in entries:
        entry = {str(t.token_id): {"logprob": t.logprob, "rank": r, "decoded_token": _token(tok, t.token_id)}
                 for r, t in enumerate(e.top, 1)}
        entry.setdefault(str(e.token_id), {"logprob": e.logprob, "rank": e.rank,
                                           "decoded_token": _token(tok, e.token_id)})
        out.append(entry)
    return out


class Formatter:
    """Builds the bodies of one response (one id, one created time, one model name)."""

    def __init__(self, kind: str, model: str, tok: Tokenizer, logprobs_n: int | None,
                 token_ids: bool = False, continuous_usage: bool = False, prompt_logprobs: bool = False):
        self.kind, self.model, self.tok, self.logprobs_n = kind, model, tok, logprobs_n
        self.prompt_logprobs = prompt_logprobs     # vLLM's prompt_logprobs field: each choice carries them
        self.token_ids = token_ids
        # vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so
        # far (the prompt, and the tokens of this and the earlier chunks of that choice)
        self.continuous_usage = continuous_usage
        self._streamed: dict[int, int] = {}  # choice index -> tokens in its chunks so far
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = int(time.time())

    def _logprobs(self, entries: list[wpb.TokenLogprobs], offset: int = 0,
                  echo: Choice | None = None) -> dict[str, Any] | None:
        """The logprobs of `entries` (from text offset `offset`); `echo`: the choice whose prompt
        comes first (its echo)."""
        if self.logprobs_n is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(self.tok, entries, self.logprobs_n)
        prompt = (echo.prompt_ids, echo.prompt_logprobs or []) if echo is not None else None
        return completion_logprobs(self.tok, entries, self.logprobs_n, offset, prompt)

    def _prompt_fields(self, c: Choice, body: dict[str, Any]) -> None:
        """vLLM's prompt_logprobs (and its prompt_token_ids with return_token_ids), when asked."""
        if self.prompt_logprobs:
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.tok, c.prompt_logprobs or [])

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        out = []
        for c in choices:
            if c.reader is not None:
                c.reader.finish()
            echo = c if c.echo is not None else None
            body: dict[str, Any] = {"index": c.index, "logprobs": self._logprobs(c.logprobs, echo=echo),
                                    "finish_reason": c.finish_reason, "matched_stop": c.matched_stop}
            if self.kind == "chat":
                body["message"] = c.reader.message() if c.reader is not None else \
                    {"role": "assistant", "content": c.text}
            else:
                body["text"] = (c.echo or "") + c.text
                self._prompt_fields(c, body)
            if self.token_ids:
                body["token_ids"] = c.token_ids
            out.append(body)
        prompt = prompt_tokens(choices)
        return {"id": self.id, "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": out,
                "usage": usage(prompt, sum(len(c.token_ids) for c in choices), cached_tokens(choices))}

    def chunk(self, c: Choice, text: str, entries: list[wpb.TokenLogprobs], first: bool = False,
              offset: int = 0, ids: list[int] | None = None, delta: dict[str, Any] | None = None,
              last: bool = False) -> dict[str, Any]:
        """One stream chunk of choice `c`: its `text` (or, for a choice with a reader, the
        reader's `delta`), the logprobs `entries` and token `ids` it came with; the `last` one
        carries the finish reason (a choice may have ended before its earlier chunks are sent)."""
        finish = c.finish if last else None
        echo = c if first and c.echo is not None and self.kind == "text" else None
        if c.echo is not None:
            offset += len(c.echo)           # the echoed prompt came first
        body: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason if finish is not None else None,
                                "logprobs": self._logprobs(entries, offset, echo) if entries or echo else None}
        if finish is not None:
            body["matched_stop"] = c.matched_stop
        if self.kind == "chat" and delta is not None:
            body["delta"] = {"role": "assistant", **delta} if first else delta
        elif self.kind == "chat":
            body["delta"] = ({"role": "assistant", "content": text} if first else {"content": text}) \
                if (text or first) else {}
        else:
            body["text"] = (echo.echo or "") + text if echo is not None else text
            if first:
                self._prompt_fields(c, body)
        if self.token_ids:
            body["token_ids"] = ids or []
        kind = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        chunk: dict[str, Any] = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                                 "choices": [body]}
        self._streamed[c.index] = self._streamed.get(c.index, 0) + len(ids or [])
        if self.continuous_usage:
            # the choice's cached tokens come with its Finish: in its last chunk
            chunk["usage"] = usage(c.prompt_tokens, self._streamed[c.index],
                                   finish.cached_tokens if finish is not None else None)
        return chunk

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "choices": [],
                "usage": usage(prompt_tokens(choices), sum(len(c.token_ids) for c in choices),
                               cached_tokens(choices))}


def prompt_tokens(choices: list[Choice]) -> int:
    """Prompt tokens counted once per prompt (n choices of one prompt share it)."""
    seen: dict[int, int] = {}
    for c in choices:
        seen[c.prompt_group] = c.prompt_tokens
    return sum(seen.values())


def cached_tokens(choices: list[Choice]) -> int:
    """Prompt tokens served from the decode workers' prefix caches (Finish.cached_tokens),
    counted once per prompt like `prompt_tokens`: of a prompt's n choices, the fewest any of
    them got (each choice's prompt is matched on its own)."""
    seen: dict[int, int] = {}
    for c in choices:
        got = c.finish.cached_tokens if c.finish is not None else 0
        seen[c.prompt_group] = min(seen.get(c.prompt_group, got), got)
    return sum(seen.values())
