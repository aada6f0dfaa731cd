"""The KV shape `bench.transfer` moves: a realistic large model's cache, 64 MiB of it.

32 layers x 8 KV heads x head dim 128, bf16, 16-token pages: 2 MiB per page across all
layers, so 64 MiB is a 512-token prompt (32 pages).  Frames carry 4 layers of one page
(256 KiB), sent layer group by layer group as prefill would produce them.
"""

from __future__ import annotations

from typing import TypedDict

import torch
import xxhash

from engine.kv_pool import PagePool
from kv_transfer.frame import prompt_digest
from kv_transfer.pages import block_parts


class KVShape(TypedDict):
    layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: str


SHAPE = KVShape(layers=32, kv_heads=8, head_dim=128, page_size=16, dtype="bfloat16")
PROMPT_TOKENS = 512
LAYER_GROUP = 4
NUM_PAGES = 33


def bench_prompt_digest(prompt_len: int = PROMPT_TOKENS) -> bytes:
    """The prompt digest both ends of the benchmark use (the prompt 0, 1, ..., prompt_len - 1)."""
    return prompt_digest(range(prompt_len))


def make_pool(seed: int, device: str = "cpu") -> PagePool:
    pool = PagePool(NUM_PAGES, SHAPE["page_size"], SHAPE["layers"], SHAPE["kv_heads"],
                    SHAPE["head_dim"], torch.bfloat16, device=device)
    g = torch.Generator().manual_seed(seed)
    pool.kv.view(torch.int16).copy_(torch.randint(-2**15, 2**15, pool.kv.shape, generator=g,
                                                  dtype=torch.int16))
    return pool


def pool_digest(pool: PagePool, table: list[int], prompt_len: int) -> int:
    """xxh3 over the prompt's tokens of every page, all layers, in order."""
    x = xxhash.xxh3_64()
    for i, page in enumerate(table[:pool.pages_for(prompt_len)]):
        n = min(pool.page_size, prompt_len - i * pool.page_size)
        for part in block_parts(pool, page, 0, SHAPE["layers"], n):
            x.update(part)
    return x.intdigest()


def payload_bytes(pool: PagePool, prompt_len: int = PROMPT_TOKENS) -> int:
    return pool.kv[:, :, 0, :1].numel() * pool.kv.element_size() * prompt_len
