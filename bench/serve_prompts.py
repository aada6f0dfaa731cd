"""Prompts for the serving benchmark: held-out standard-library text (never random ids), cut
to an exact token count with the model's tokenizer, each with a unique prefix so no prefix
cache can serve one request from another (unless a workload shares one on purpose)."""

from __future__ import annotations

import random

from engine import corpus
from engine.tokenizer import Tokenizer


class PromptMaker:
    def __init__(self, tokenizer: Tokenizer, seed: int, run: str = ""):
        """`seed` draws the prompts' text; `run` (bench.serve: a fresh one per invocation) marks
        every prompt's first tokens, so invocations against one server never share a page."""
        _, held = corpus.read_split()
        self.tok = tokenizer
        self.ids = tokenizer.encode("\n".join(held))       # one long stream of real text
        self.rng = random.Random(seed)
        self.run = f"{run} " if run else ""
        self.n = 0

    def make(self, input_len: int) -> str:
        """A prompt of `input_len` tokens (the unique prefix included)."""
        self.n += 1
        prefix = self.tok.encode(f"# request {self.run}{self.n} {self.rng.randrange(10**9)}\n")
        body_len = max(0, input_len - len(prefix))
        start = self.rng.randrange(0, len(self.ids) - body_len - 1)
        ids = prefix + self.ids[start:start + body_len]
        text = self.tok.decode(ids)
        while len(self.tok.encode(text)) > input_len and body_len > 0:   # decode/encode may merge
            body_len -= 1
            text = self.tok.decode(prefix + self.ids[start:start + body_len])
        return text

    def make_ids(self, length: int, label: str = "request") -> list[int]:
        """Exactly `length` token ids: a unique header (`# <label> <n> <random>`, cut to `length`
        when longer) then held-out text.  Sent as a token-id prompt, no re-tokenisation changes
        its length, and the header makes its first page differ from every other one's."""
        if length < 1:
            raise ValueError(f"a prompt piece of {length} tokens: it needs at least 1")
        if length >= len(self.ids):
            raise ValueError(f"a prompt piece of {length} tokens is longer than the held-out text "
                             f"({len(self.ids)} tokens)")
        self.n += 1
        head = self.tok.encode(f"# {label} {self.run}{self.n} {self.rng.randrange(10**9)}\n")[:length]
        start = self.rng.randrange(0, len(self.ids) - length)
        return head + self.ids[start:start + length - len(head)]
