"""One streaming OpenAI request, timed: POST a JSON body (gateway.http_client), read the
server-sent events, time every chunk that carries text.

The arrival time of each content chunk is what TTFT and inter-token latency come from.  Besides
the text it reads the usage chunk's prompt and cached prompt tokens
(`usage.prompt_tokens_details.cached_tokens`, sent when `stream_options.include_usage` is set)
and the generated token ids (`token_ids` in each chunk when the body asks `return_token_ids`)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

from gateway.http_client import post_json


@dataclass
class StreamResult:
    start: float
    chunk_times: list[float] = field(default_factory=list)   # arrival of each chunk with text
    end: float = 0.0
    output_tokens: int = 0          # from the usage chunk when the server sends one
    text: str = ""
    error: str | None = None
    prompt_tokens: int = 0                 # usage.prompt_tokens
    cached_tokens: int | None = None       # usage.prompt_tokens_details.cached_tokens; None: not reported
    token_ids: list[int] = field(default_factory=list)   # generated ids, when the server sends them
    sent_token_ids: bool = False           # whether any chunk carried token_ids

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


async def post_stream(url: str, path: str, body: dict, api_key: str | None, timeout_s: float) -> StreamResult:
    """POST `body` (with "stream": true) and read the SSE stream to the end; errors are recorded
    in the result (`error`), never raised."""
    u = urlparse(url)
    res = StreamResult(start=time.perf_counter())
    try:
        await asyncio.wait_for(_exchange(u.hostname, u.port or 80, u.path.rstrip("/") + path, body,
                                         api_key, res), timeout_s)
    except asyncio.TimeoutError:
        res.error = f"timeout after {timeout_s}s"
    except (OSError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.end = time.perf_counter()
    return res


async def _exchange(host: str | None, port: int, path: str, body: dict, api_key: str | None,
                    res: StreamResult) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        status, pieces = await post_json(reader, writer, f"{host}:{port}", path, body, api_key)
        buf = b""
        async for piece in pieces:
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if status != 200:
                    continue
                _event(event.decode(), res)
        if status != 200:
            res.error = f"HTTP {status}: {buf.decode(errors='replace')[:200]}"
    finally:
        writer.close()


def _event(event: str, res: StreamResult) -> None:
    for line in event.splitlines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        msg = json.loads(data)
        if "error" in msg:
            res.error = f"{msg['error'].get('code')}: {msg['error'].get('message')}"
            return
        if usage := msg.get("usage"):
            res.output_tokens = usage.get("completion_tokens", 0)
            res.prompt_tokens = usage.get("prompt_tokens", 0)
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                res.cached_tokens = int(details["cached_tokens"])
        for choice in msg.get("choices", []):
            if "token_ids" in choice:
                res.sent_token_ids = True
                res.token_ids += choice["token_ids"] or []
            text = choice.get("text")
            if text is None:
                text = (choice.get("delta") or {}).get("content")
            if text:
                res.chunk_times.append(time.perf_counter())
                res.text += text
