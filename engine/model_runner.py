"""Runs one scheduled batch through the model: build tensors, forward, mask, sample."""

from __future__ import annotations

from typing import Callable

import torch

from engine.compiled.step import CompiledDecode
from engine.forward_batch import build_batch
from engine.guided_mask import TokenMasker
from engine.kv_pool import PagePool
from engine.models.decoder import DecoderModel
from engine.request import Request
from engine.sampling import SampleOutput, sample
from engine.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: DecoderModel, pool: PagePool, device: str, vocab_size: int,
                 eos_ids: frozenset[int] = frozenset()):
        self.model = model
        self.pool = pool
        self.device = device
        self.eos_ids = eos_ids
        self.masker = TokenMasker(vocab_size, device)   # the rows of requests with a grammar
        self.compiled: CompiledDecode | None = None     # decode batches that fit a bucket run compiled

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, on_layer: Callable[[int], None] | None = None) -> SampleOutput:
        """Forward the batch (writing its K/V into the pool, marking those positions written
        and advancing each request's `num_computed`) and sample a token for every request
        whose prompt is complete (within what its grammar allows, `Request.guide`).  Rows of
        requests still prefilling hold -1.
        `on_layer(i)` is called after layer i has written its K/V (transfer overlap)."""
        reqs = batch.requests
        tokens = [[r.token_at(p) for p in range(r.num_computed, r.num_computed + n)]
                  for r, n in zip(reqs, batch.num_new_tokens)]
        starts = [r.num_computed for r in reqs]
        tables = [self.pool.page_table(r.request_id) for r in reqs]
        compiled = (self.compiled is not None and on_layer is None and self.compiled.fits(len(reqs))
                    and all(n == 1 for n in batch.num_new_tokens))
        if compiled:
            assert self.compiled is not None
            all_logits = self.compiled.run(tokens, starts, tables)  # [B, V]
        else:
            fb = build_batch(tokens, starts, tables, self.pool.page_size, self.device)
            hidden = self.model.forward(fb, self.pool.kv, on_layer)  # [B, H]
        samples = batch.samples()
        for r, n in zip(reqs, batch.num_new_tokens):
            self.pool.mark_tokens_written(r.request_id, r.num_computed, n)
            r.num_computed += n
        rows = [i for i, s in enumerate(samples) if s]
        out = SampleOutput([-1] * len(reqs), [None] * len(reqs))
        if not rows:
            return out
        if compiled:
            logits = all_logits[rows] if len(rows) < len(reqs) else all_logits
        else:
            logits = self.model.logits(hidden[rows] if len(rows) < len(reqs) else hidden)
        sampled = [reqs[i] for i in rows]
        guides = [r.guide for r in sampled]
        bans = [self._early_stops(r) for r in sampled]
        for row, (banned, guide) in enumerate(zip(bans, guides)):
            if banned and not (guide is not None and guide.masks):    # a masked row's ban: the masker's
                logits[row, banned] = float("-inf")
        params, generators = [r.params for r in sampled], [r.generator for r in sampled]
        want_logprobs = any(p.logprobs is not None for p in params)
        masked = self.masker.apply(logits, guides, copy=want_logprobs, bans=bans)
        # logprobs stay the model's (before the grammar): `logits` is raw unless masked in place,
        # which happens only when no row wants logprobs
        picked = sample(logits if masked is None else masked, params, generators, raw=logits)
        for j, i in enumerate(rows):
            out.tokens[i] = picked.tokens[j]
            out.logprobs[i] = picked.logprobs[j]
        return out

    def _early_stops(self, req: Request) -> list[int]:
        """The tokens a request under `min_tokens` cannot pick: EOS (unless ignored) and its stop
        tokens (none past min_tokens)."""
        if not req.under_min_tokens:
            return []
        banned = set(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            banned |= self.eos_ids
        return sorted(banned)
