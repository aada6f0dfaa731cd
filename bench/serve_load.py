"""Running load against an OpenAI-compatible endpoint: one concurrency level of one shape,
and the interference test (short decodes while long prompts keep arriving)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Protocol

from bench.http_stream import StreamResult, post_stream

Prompt = str | list[int]     # text, or token ids (/v1/completions only: exact lengths)


class Progress(Protocol):
    """What the load loops report finished requests to (a tqdm bar)."""

    def update(self, n: int) -> object: ...


class Target:
    def __init__(self, url: str, model: str, api_key: str | None, chat: bool, timeout_s: float) -> None:
        self.url, self.model, self.api_key, self.chat, self.timeout_s = url, model, api_key, chat, timeout_s

    def body(self, prompt: Prompt, output_len: int, token_ids: bool = False) -> dict:
        """The request body; `token_ids`: ask for the generated ids (vLLM's return_token_ids)."""
        b: dict = {"model": self.model, "max_tokens": output_len, "min_tokens": output_len, "ignore_eos": True,
                   "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        if self.chat:
            if not isinstance(prompt, str):
                raise ValueError("a token-id prompt needs /v1/completions (drop --chat)")
            b["messages"] = [{"role": "user", "content": prompt}]
        else:
            b["prompt"] = prompt
        if token_ids:
            b["return_token_ids"] = True
        return b

    async def one(self, prompt: Prompt, output_len: int, token_ids: bool = False) -> StreamResult:
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        return await post_stream(self.url, path, self.body(prompt, output_len, token_ids), self.api_key,
                               self.timeout_s)


async def run_level(target: Target, prompts: Sequence[Prompt], output_len: int, concurrency: int,
                    progress: Progress | None = None) -> tuple[list[StreamResult], float]:
    """Send every prompt, at most `concurrency` at a time, in order.  Returns results (in
    completion order) and wall time."""
    queue: asyncio.Queue[Prompt] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[StreamResult] = []

    async def worker() -> None:
        while not queue.empty():
            r = await target.one(queue.get_nowait(), output_len)
            results.append(r)
            if progress is not None:
                progress.update(1)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start


async def interference(target: Target, short: list[str], short_out: int, long: list[str],
                       decode_concurrency: int, long_concurrency: int,
                       progress: Progress | None = None) -> tuple[list[StreamResult], float]:
    """Keep `decode_concurrency` short-prompt / long-output requests going while
    `long_concurrency` long-prompt / one-token requests keep arriving; returns the short
    requests' results (their ITL is what long prefills disturb) and the wall time."""
    stop = asyncio.Event()

    async def long_stream() -> None:
        i = 0
        while not stop.is_set():
            await target.one(long[i % len(long)], 1)
            i += 1

    loaders = [asyncio.create_task(long_stream()) for _ in range(long_concurrency)]
    try:
        results, wall = await run_level(target, short, short_out, decode_concurrency, progress)
    finally:
        stop.set()
        await asyncio.gather(*loaders, return_exceptions=True)
    return results, wall
