"""A chaos client: one request over raw HTTP/1.1 (asyncio streams, no client library), so it
can hang up at any byte it likes.  It records exactly what the client saw.

    outcome   meaning
    ok        HTTP 200 and a finished choice ([DONE] on a stream)
    error     an explicit error: an HTTP error body, or an error event on the stream
    aborted   the client hung up on purpose before the end
    silent    anything else: a 200 that ended without [DONE] or a finish, a dropped
              connection with no error, a timeout (a violation of I8)
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from chaos.prompts import TEXT_ONLY, Job
from gateway.http_client import post_json


@dataclass
class Outcome:
    job: Job
    outcome: str = "silent"
    status: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    error: str = ""
    finish: str | None = None
    started: float = 0.0
    first: float = 0.0          # when the first token arrived (0: none did)
    ended: float = 0.0
    cached_tokens: int | None = None   # usage.prompt_tokens_details.cached_tokens (when asked for)

    @property
    def ttft(self) -> float | None:
        """Seconds from sending to the first token (a whole response: to its end)."""
        return self.first - self.started if self.first else None


async def send(url: str, api_key: str, model: str, out: Outcome, timeout_s: float) -> Outcome:
    """Run `out.job`, filling `out` as the response arrives (others may watch it live)."""
    job = out.job
    out.started = time.monotonic()
    body = request_body(job, model)
    if job.cache_salt is not None:
        body["cache_salt"] = job.cache_salt
    if job.usage and job.stream:
        body["stream_options"] = {"include_usage": True}
    try:
        await asyncio.wait_for(_exchange(url, api_key, body, out), timeout_s)
    except asyncio.TimeoutError:
        out.outcome, out.error = "silent", f"no end after {timeout_s}s"
    except (OSError, ValueError, asyncio.IncompleteReadError) as e:
        if out.outcome != "aborted":
            out.outcome, out.error = "silent", f"{type(e).__name__}: {e}"
    out.ended = time.monotonic()
    return out


PATHS = {"completions": "/v1/completions", "echo": "/v1/completions", "chat": "/v1/chat/completions",
         "responses": "/v1/responses", "messages": "/v1/messages"}


def request_body(job: Job, model: str) -> dict[str, Any]:
    """The body of `job` in its API's shape (greedy; token ids back where the API has them)."""
    common = {"model": model, "temperature": 0, "stream": job.stream}
    if job.api == "responses":
        return {**common, "input": job.text, "max_output_tokens": job.max_tokens}
    if job.api == "messages":
        return {**common, "messages": [{"role": "user", "content": job.text}], "max_tokens": job.max_tokens}
    if job.api == "chat":
        return {**common, "messages": [{"role": "user", "content": job.text}], "max_tokens": job.max_tokens,
                "return_token_ids": True}
    body = {**common, "prompt": job.ids, "max_tokens": job.max_tokens, "return_token_ids": True}
    if job.api == "echo":
        body.update(echo=True, logprobs=0)
    return body


async def _exchange(url: str, api_key: str, body: dict, out: Outcome) -> None:
    u = urlparse(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    job = out.job
    hung: list[bool] = []          # set when our own hang-up fired

    def hang() -> None:
        hung.append(True)
        writer.close()
    hang_up = asyncio.get_running_loop().call_later(job.disconnect_s, hang) \
        if job.disconnect_s is not None else None
    try:
        out.status, chunks = await post_json(reader, writer, f"{u.hostname}:{u.port}",
                                             f"{u.path.rstrip('/')}{PATHS[job.api]}", body, api_key)
        if out.status == 200 and body["stream"]:
            await (_read_named_events(chunks, out, writer) if job.api in TEXT_ONLY else
                   _read_events(chunks, out, writer))
        else:
            _whole(b"".join([c async for c in chunks]), out)
    except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
        if not hung:
            raise
    finally:
        if hang_up is not None:
            hang_up.cancel()
        if hung and out.outcome == "silent":
            out.outcome = "aborted"
        writer.close()


async def _read_events(chunks: AsyncIterator[bytes], out: Outcome, writer: asyncio.StreamWriter) -> None:
    buf, seen = b"", 0
    async for piece in chunks:
        buf += piece
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = event.decode().removeprefix("data: ")
            if data == "[DONE]":
                out.outcome = "ok" if out.finish else "silent"
                return
            msg = json.loads(data)
            _usage(msg, out)
            if "error" in msg:
                out.outcome, out.error = "error", f"{msg['error'].get('code')}: {msg['error'].get('message')}"
                return
            for choice in msg.get("choices", []):
                if choice.get("token_ids") and not out.first:
                    out.first = time.monotonic()
                out.token_ids += choice.get("token_ids") or []
                out.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                out.finish = choice.get("finish_reason") or out.finish
            seen += 1
            if out.job.disconnect_after is not None and seen > out.job.disconnect_after:
                out.outcome = "aborted"
                writer.close()
                return


def _whole(raw: bytes, out: Outcome) -> None:
    msg = json.loads(raw.decode() or "{}")
    if out.status != 200:
        err = msg.get("error") or {}
        out.outcome = "error" if err.get("message") else "silent"
        out.error = f"HTTP {out.status} {err.get('code')}: {err.get('message')}"
        return
    _usage(msg, out)
    if out.job.api in TEXT_ONLY:
        out.text, out.finish = _answer_text(msg), msg.get("stop_reason") or \
            {"completed": "stop", "incomplete": "length"}.get(msg.get("status") or "")
    else:
        choice = (msg.get("choices") or [{}])[0]
        out.token_ids, out.finish = choice.get("token_ids") or [], choice.get("finish_reason")
        out.text = choice.get("text") or (choice.get("message") or {}).get("content") or ""
    out.outcome = "ok" if out.finish else "silent"
    out.first = time.monotonic() if out.token_ids or out.text else 0.0


def _answer_text(msg: dict) -> str:
    """The text of a Responses API response (its message items) or a Messages API message."""
    parts = [p for item in msg.get("output") or () if isinstance(item, dict) for p in item.get("content") or ()]
    parts += list(msg.get("content") or ())
    return "".join(str(p.get("text") or "") for p in parts if isinstance(p, dict))


async def _read_named_events(chunks: AsyncIterator[bytes], out: Outcome, writer: asyncio.StreamWriter) -> None:
    """A Responses or Messages API stream (`event:` and `data:` lines): its text deltas, its end
    (response.completed / .incomplete, message_delta's stop_reason then message_stop) or its error."""
    buf, seen = b"", 0
    async for piece in chunks:
        buf += piece
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = "".join(line.removeprefix("data: ") for line in event.decode().split("\n")
                           if line.startswith("data: "))
            msg = json.loads(data) if data else {}
            kind = msg.get("type", "")
            delta = msg.get("delta")
            text = delta if kind == "response.output_text.delta" else \
                (delta or {}).get("text") if kind == "content_block_delta" else None
            if isinstance(text, str):
                out.first = out.first or time.monotonic()
                out.text += text
            if kind == "message_delta":
                out.finish = (delta or {}).get("stop_reason") or out.finish
            if kind in ("response.completed", "response.incomplete"):
                out.finish = "stop" if kind == "response.completed" else "length"
            if kind in ("response.completed", "response.incomplete", "message_stop"):
                out.outcome = "ok" if out.finish else "silent"
                return
            if kind in ("error", "response.failed"):
                err = msg.get("error") or (msg.get("response") or {}).get("error") or {}
                out.outcome, out.error = "error", f"{err.get('code') or err.get('type')}: {err.get('message')}"
                return
            seen += 1
            if out.job.disconnect_after is not None and seen > out.job.disconnect_after:
                out.outcome = "aborted"
                writer.close()
                return


def _usage(msg: dict, out: Outcome) -> None:
    """Keep the cached prompt tokens a response's usage states (OpenAI's field)."""
    details = (msg.get("usage") or {}).get("prompt_tokens_details") or {}
    if isinstance(details.get("cached_tokens"), int):
        out.cached_tokens = details["cached_tokens"]
