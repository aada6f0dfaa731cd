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
from urllib.parse import urlparse

from chaos.prompts import Job
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
    body = {"model": model, "prompt": job.ids, "max_tokens": job.max_tokens, "temperature": 0,
            "stream": job.stream, "return_token_ids": True}
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
                                             f"{u.path.rstrip('/')}/v1/completions", body, api_key)
        if out.status == 200 and body["stream"]:
            await _read_events(chunks, out, writer)
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
                out.text += choice.get("text") or ""
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
    choice = (msg.get("choices") or [{}])[0]
    out.token_ids, out.text, out.finish = choice.get("token_ids") or [], choice.get("text") or "", \
        choice.get("finish_reason")
    out.outcome = "ok" if out.finish else "silent"
    out.first = time.monotonic() if out.token_ids else 0.0


def _usage(msg: dict, out: Outcome) -> None:
    """Keep the cached prompt tokens a response's usage states (OpenAI's field)."""
    details = (msg.get("usage") or {}).get("prompt_tokens_details") or {}
    if isinstance(details.get("cached_tokens"), int):
        out.cached_tokens = details["cached_tokens"]
