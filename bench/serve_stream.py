"""One streaming OpenAI request, timed, with what the prefix workloads read besides the text:
the prompt tokens and the cached prompt tokens of the usage chunk
(`usage.prompt_tokens_details.cached_tokens`, sent when `stream_options.include_usage` is set)
and the generated token ids (`token_ids` in each chunk when the body asks `return_token_ids`).

Timing and text come from bench.http_stream's reading of each event (one path for TTFT/ITL)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

from bench.http_stream import StreamResult, _event
from gateway.http_client import post_json


@dataclass
class TurnResult(StreamResult):
    prompt_tokens: int = 0                 # usage.prompt_tokens
    cached_tokens: int | None = None       # usage.prompt_tokens_details.cached_tokens; None: not reported
    token_ids: list[int] = field(default_factory=list)   # generated ids, when the server sends them
    sent_token_ids: bool = False           # whether any chunk carried token_ids


async def post_turn(url: str, path: str, body: dict, api_key: str | None, timeout_s: float) -> TurnResult:
    """POST `body` (with "stream": true) and read the SSE stream to the end; errors are recorded
    in the result (`error`), never raised."""
    u = urlparse(url)
    res = TurnResult(start=time.perf_counter())
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
                    res: TurnResult) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        status, pieces = await post_json(reader, writer, f"{host}:{port}", path, body, api_key)
        buf = b""
        async for piece in pieces:
            buf += piece
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if status == 200:
                    text = event.decode()
                    _event(text, res)
                    read_extras(text, res)
        if status != 200:
            res.error = f"HTTP {status}: {buf.decode(errors='replace')[:200]}"
    finally:
        writer.close()


def read_extras(event: str, res: TurnResult) -> None:
    """Usage (prompt and cached tokens) and generated token ids of one server-sent event."""
    for line in event.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        msg = json.loads(line[len("data: "):])
        if "error" in msg:
            return
        if usage := msg.get("usage"):
            res.prompt_tokens = usage.get("prompt_tokens", 0)
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                res.cached_tokens = int(details["cached_tokens"])
        for choice in msg.get("choices", []):
            if "token_ids" in choice:
                res.sent_token_ids = True
                res.token_ids += choice["token_ids"] or []
