"""The KV shape `bench.transfer` moves, and the pools at both ends of it.

The default is a large model's cache, 64 MiB of it: 32 layers x 8 KV heads x head dim 128,
bf16, 16-token pages: 2 MiB per page across all layers, so 64 MiB is a 512-token prompt (32
pages).  `KVShape.from_published(name, tokens)` takes the geometry of a published model
instead (models/published/NAME/config.json, read as the engine reads it).  Frames carry
`LAYER_GROUP` layers of one page (256 KiB by default), sent layer group by layer group as
prefill would produce them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from engine.config import ModelConfig
from engine.kv_pool import PagePool
from kv_transfer.frame import prompt_digest
from kv_transfer.pages import DTYPES, block_parts

LAYER_GROUP = 4
PUBLISHED = Path(__file__).resolve().parents[1] / "models" / "published"


@dataclass(frozen=True)
class KVShape:
    """K and V of `tokens` prompt tokens over `layers` layers, in pages of `page_size` tokens."""
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    tokens: int = 512
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "page_size", "tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {sorted(DTYPES)}")

    @classmethod
    def from_published(cls, name: str, tokens: int) -> KVShape:
        """The KV geometry of models/published/NAME/config.json (bf16, 16-token pages), for a
        prompt of `tokens`.  Raises ValueError for an unknown name or an MLA model."""
        path = PUBLISHED / name
        if not (path / "config.json").is_file():
            known = sorted(p.name for p in PUBLISHED.iterdir() if (p / "config.json").is_file())
            raise ValueError(f"no published config {name!r} (models/published/{name}/config.json); "
                             f"known: {', '.join(known)}")
        model = ModelConfig.from_path(path)
        if model.is_mla:
            raise ValueError(f"{name}: its attention is MLA (config.json has kv_lora_rank="
                             f"{model.raw['kv_lora_rank']}), whose pages hold one latent row per token, "
                             f"not K and V per KV head; bench.transfer moves K and V pages only")
        return cls(layers=model.num_hidden_layers, kv_heads=model.num_key_value_heads,
                   head_dim=model.head_dim, tokens=tokens)

    @classmethod
    def from_json(cls, text: str) -> KVShape:
        return cls(**json.loads(text))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def prompt_pages(self) -> int:
        return -(-self.tokens // self.page_size)

    @property
    def layer_token_bytes(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.torch_dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return self.layers * self.layer_token_bytes

    @property
    def payload_bytes(self) -> int:
        """The bytes one transfer moves: every layer of every prompt token."""
        return self.bytes_per_token * self.tokens

    def layer_groups(self) -> Iterator[tuple[int, int]]:
        """[l0, l1) of each layer group, in the order prefill computes them."""
        for l0 in range(0, self.layers, LAYER_GROUP):
            yield l0, min(l0 + LAYER_GROUP, self.layers)

    def tokens_in_page(self, index: int) -> int:
        return min(self.page_size, self.tokens - index * self.page_size)

    def frames(self) -> Iterator[tuple[int, int, int, int]]:
        """(l0, l1, page index, tokens) of each frame, in the order the sender sends them:
        layer group by layer group, every prompt page in each."""
        for l0, l1 in self.layer_groups():
            for i in range(self.prompt_pages):
                yield l0, l1, i, self.tokens_in_page(i)

    def frame_nbytes(self, l0: int, l1: int, n: int) -> int:
        return (l1 - l0) * n * self.layer_token_bytes

    def bench_prompt_digest(self) -> bytes:
        """The prompt digest both ends of the benchmark use (the prompt 0, 1, ..., tokens - 1)."""
        return prompt_digest(range(self.tokens))

    def make_pool(self, seed: int, device: str = "cpu") -> PagePool:
        """A pool of the prompt's pages and one spare, filled with random bytes (layer by layer,
        so the fill never holds a second copy of the pool)."""
        pool = PagePool(self.prompt_pages + 1, self.page_size, self.layers, self.kv_heads,
                        self.head_dim, self.torch_dtype, device=device)
        g = torch.Generator().manual_seed(seed)
        for layer in pool.kv.view(torch.int16):      # [C, P, S, H, D * itemsize / 2]
            layer.copy_(torch.randint(-2**15, 2**15, layer.shape, generator=g, dtype=torch.int16))
        return pool

    def pool_digest(self, pool: PagePool, table: list[int]) -> int:
        """xxh3 over the prompt's tokens of every page, all layers, in order."""
        x = xxhash.xxh3_64()
        for i, page in enumerate(table[:self.prompt_pages]):
            for part in block_parts(pool, page, 0, self.layers, self.tokens_in_page(i)):
                x.update(part)
        return x.intdigest()
