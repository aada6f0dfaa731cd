"""Running the prefix workloads (bench.serve_workloads) against an OpenAI-compatible endpoint:
shared-prefix requests through run_level; multi-turn conversations, each turn sent only once the
previous answer is back and resending the whole history with it."""

from __future__ import annotations

import asyncio
import sys
import time

from tqdm import tqdm

from bench.http_stream import StreamResult
from bench.serve_load import Progress, Target, run_level
from bench.serve_prompts import PromptMaker
from bench.serve_stats import cache_share, summarize
from bench.serve_workloads import MultiTurn, SharedPrefix
from engine.tokenizer import Tokenizer


async def run_conversations(target: Target, conversations: list[list[list[int]]], output_len: int,
                            concurrency: int, tok: Tokenizer,
                            progress: Progress | None = None) -> tuple[list[StreamResult], float]:
    """At most `concurrency` conversations at a time, each turn's prompt being the previous
    prompt, its answer (the server's token ids when it sends them, else the answer text encoded)
    and the turn's new message.  A failed turn ends its conversation (the next one would have no
    answer to resend).  Returns every turn's result and the wall time."""
    queue: asyncio.Queue[list[list[int]]] = asyncio.Queue()
    for c in conversations:
        queue.put_nowait(c)
    results: list[StreamResult] = []

    async def worker() -> None:
        while not queue.empty():
            history: list[int] = []
            for message in queue.get_nowait():
                prompt = history + message
                r = await target.one(prompt, output_len, token_ids=True)
                results.append(r)
                if progress is not None:
                    progress.update(1)
                if r.error is not None:
                    break
                history = prompt + (r.token_ids if r.sent_token_ids else tok.encode(r.text))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start


def run_workload(target: Target, workload: SharedPrefix | MultiTurn, inputs: list, tok: Tokenizer, mode: str,
                 slo: tuple[float, float]) -> dict:
    """One level of a prefix workload, its `inputs` made by the workload (`prompts` of a
    SharedPrefix, `messages` of a MultiTurn): statistics and cached-token share, as a run row."""
    name = "shared-prefix" if isinstance(workload, SharedPrefix) else "multi-turn"
    with tqdm(total=workload.requests, desc=f"{mode} {name} c={workload.concurrency}", unit="req",
              file=sys.stderr) as bar:
        if isinstance(workload, SharedPrefix):
            results, wall = asyncio.run(run_level(target, inputs, workload.output_len, workload.concurrency, bar))
            input_len = workload.prompt_len
        else:
            results, wall = asyncio.run(run_conversations(target, inputs, workload.output_len,
                                                          workload.concurrency, tok, bar))
            input_len = workload.prompt_len(workload.turns - 1)       # the last turn's
    return {"mode": mode, "workload": name, "concurrency": workload.concurrency, "input_len": input_len,
            "output_len": workload.output_len, **summarize(results, wall, *slo), **cache_share(results)}


def sweep_workload(target: Target, maker: PromptMaker, workload: SharedPrefix | MultiTurn, mode: str,
                   slo: tuple[float, float]) -> dict:
    """`run_workload` on fresh inputs (new prefixes: no level reuses an earlier one's cache)."""
    inputs = workload.prompts(maker) if isinstance(workload, SharedPrefix) else workload.messages(maker)
    return run_workload(target, workload, inputs, maker.tok, mode, slo)
