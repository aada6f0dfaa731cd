"""The token mask of a batch's guided rows (structured outputs), computed and applied per step.

    guides (one per sampled row)  ── llguidance fills ──▶  bits   int32 [R, W]   (host; pinned on CUDA)
                                                          │  copy (non_blocking from pinned memory)
    logits [B, V] fp32 ──(clone)──▶ masked[rows] = -inf where bit (token % 32) of word (token // 32) is 0

R: the rows whose guide masks (`Guide.masks`), W = ceil(V / 32).  One row is filled on the
calling thread; several through an `llguidance.LLExecutor` (its threads, GIL released).  The
unpacking is torch ops on the logits' device.  When a row wants logprobs the raw logits stay as
they were (the mask goes into a copy): the sampler takes its logprobs from them
(`engine.sampling.sample(raw=...)`).

`MaskWork` counts the rows masked and the time spent filling (llguidance) and applying (copy
and unpack; on CUDA the time to launch them, the sampler's read of the tokens waits for them).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import torch

from engine.guide import Guide

MASK_THREADS = 4          # the executor's threads at most (it fills rows in parallel)


@dataclass
class MaskWork:
    """What the masks of a runner have cost so far (read by `bench.engine` and tests)."""
    steps: int = 0               # sampling steps with at least one guided row
    rows: int = 0                # rows masked (one per guided token)
    fill_seconds: float = 0.0    # llguidance computing the bits
    apply_seconds: float = 0.0   # copying, unpacking and applying them to the logits

    @property
    def seconds(self) -> float:
        return self.fill_seconds + self.apply_seconds

    def as_dict(self) -> dict[str, float]:
        return {"steps": self.steps, "rows": self.rows, "fill_seconds": self.fill_seconds,
                "apply_seconds": self.apply_seconds}


class TokenMasker:
    """Masks the guided rows of a batch's logits.  `vocab_size`: the logits' width (the
    grammar compiler's vocabulary, `GrammarCompiler.vocab_size`)."""

    def __init__(self, vocab_size: int, device: str | torch.device):
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.device = torch.device(device)
        self._pinned = self.device.type == "cuda"
        self._host = self._alloc(8)                                        # [cap, W] int32
        self._bits = torch.arange(32, dtype=torch.int32, device=self.device)
        self._executor: llguidance.LLExecutor | None = None
        self.work = MaskWork()

    def apply(self, logits: torch.Tensor, guides: Sequence[Guide | None], copy: bool = True,
              bans: Sequence[Sequence[int]] | None = None) -> torch.Tensor | None:
        """`logits`: [B, V] raw, one row per entry of `guides`.  Returns logits whose guided rows
        allow only what their grammar allows (-inf elsewhere): a copy, or `logits` itself masked
        in place when `copy` is False (nobody reads the raw ones: no logprobs wanted).  None when
        no row is guided (then `logits` is the one to sample from).
        `bans[i]`: tokens row i may not pick either (min_tokens' EOS and stop tokens), unless
        they are all its grammar allows: then the grammar wins (the output can only end), never a
        row with nothing to sample."""
        rows = [(i, g) for i, g in enumerate(guides) if g is not None and g.masks]
        if not rows:
            return None
        assert logits.shape[1] == self.vocab_size, \
            f"logits have {logits.shape[1]} columns, the grammar's vocabulary {self.vocab_size}"
        start = time.perf_counter()
        bits = self._fill([g for _, g in rows])                            # [R, W] host
        filled = time.perf_counter()
        words = bits.to(self.device, non_blocking=self._pinned)
        allowed = ((words[:, :, None] >> self._bits) & 1).bool()           # [R, W, 32]
        allowed = allowed.reshape(len(rows), self.words * 32)[:, :self.vocab_size]
        for k, (i, _) in enumerate(rows):
            if bans is not None and bans[i]:
                kept = allowed[k].clone()
                kept[list(bans[i])] = False
                if bool(kept.any()):          # a host read, only for a guided row under min_tokens
                    allowed[k] = kept
        masked = logits.clone() if copy else logits
        if len(rows) == logits.shape[0]:
            masked.masked_fill_(~allowed, float("-inf"))
        else:
            index = torch.tensor([i for i, _ in rows], device=logits.device)
            masked[index] = masked[index].masked_fill(~allowed, float("-inf"))
        w = self.work
        w.steps += 1
        w.rows += len(rows)
        w.fill_seconds += filled - start
        w.apply_seconds += time.perf_counter() - filled
        return masked

    def _fill(self, guides: list[Guide]) -> torch.Tensor:
        """The guides' bits in the host buffer's first rows (a view of it)."""
        n = len(guides)
        if n > self._host.shape[0]:
            self._host = self._alloc(max(n, 2 * self._host.shape[0]))
        host = self._host[:n]
        row_bytes = self.words * 4
        if n == 1:
            guides[0].matcher.unsafe_compute_mask_ptr(host.data_ptr(), row_bytes)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=min(MASK_THREADS, os.cpu_count() or 1))
            self._executor.unsafe_compute_mask_ptr([(g.matcher, k) for k, g in enumerate(guides)],
                                                   host.data_ptr(), row_bytes, n)
        return host

    def _alloc(self, rows: int) -> torch.Tensor:
        return torch.zeros((rows, self.words), dtype=torch.int32, pin_memory=self._pinned)
