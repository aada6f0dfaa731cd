"""Runs one scheduled batch through the model: build tensors, forward, mask, sample."""

from __future__ import annotations

import itertools
from typing import Callable

import torch

from engine.compiled.step import CompiledDecode
from engine.forward_batch import build_batch
from engine.guided_mask import TokenMasker
from engine.kv_pool import PagePool
from engine.models.decoder import DecoderModel
from engine.prompt_logprobs import score_tokens
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
        whose prompt is complete (within what its grammar allows, `Request.guide`), unless it
        only prefills (max_tokens 0).  Rows of requests that sample nothing hold -1.  A request
        that asks for prompt logprobs gets this chunk's entries (engine/prompt_logprobs.py).
        `on_layer(i)` is called after layer i has written its K/V (transfer overlap)."""
        reqs = batch.requests
        tokens = [[r.token_at(p) for p in range(r.num_computed, r.num_computed + n)]
                  for r, n in zip(reqs, batch.num_new_tokens)]
        starts = [r.num_computed for r in reqs]
        tables = [self.pool.page_table(r.request_id) for r in reqs]
        # hidden states wanted per request: its last token's, or every position of a prompt
        # chunk whose logprobs it asked for
        counts = [n if r.prefilling and r.params.prompt_logprobs is not None else 1
                  for r, n in zip(reqs, batch.num_new_tokens)]
        compiled = (self.compiled is not None and on_layer is None and self.compiled.fits(len(reqs))
                    and all(n == 1 for n in batch.num_new_tokens))
        if compiled:
            assert self.compiled is not None
            all_logits = self.compiled.run(tokens, starts, tables)  # [B, V]
        else:
            fb = build_batch(tokens, starts, tables, self.pool.page_size, self.device,
                             logits_counts=counts if any(c > 1 for c in counts) else None)
            hidden = self.model.forward(fb, self.pool.kv, on_layer)  # [sum(counts), H]
            self._score_prompts(reqs, counts, hidden)
        samples = batch.samples()
        for r, n in zip(reqs, batch.num_new_tokens):
            self.pool.mark_tokens_written(r.request_id, r.num_computed, n)
            r.num_computed += n
        rows = [i for i, s in enumerate(samples) if s and not reqs[i].params.prefill_only]
        out = SampleOutput([-1] * len(reqs), [None] * len(reqs))
        if not rows:
            return out
        if compiled:
            logits = all_logits[rows] if len(rows) < len(reqs) else all_logits
        else:
            last = list(itertools.accumulate(counts, initial=-1))[1:]    # each request's last row
            hrows = [last[i] for i in rows]
            logits = self.model.logits(hidden if hrows == list(range(hidden.shape[0])) else hidden[hrows])
        sampled = [reqs[i] for i in rows]
        picked = self._sample(logits, sampled)
        for j, i in enumerate(rows):
            out.tokens[i] = picked.tokens[j]
            out.logprobs[i] = picked.logprobs[j]
        return out

    def _score_prompts(self, reqs: list[Request], counts: list[int], hidden: torch.Tensor) -> None:
        """Append to each request that asked for them the prompt logprobs this chunk scores:
        position p scores prompt token p + 1 (of the client's prompt)."""
        row = 0
        for r, n in zip(reqs, counts):
            want = r.params.prompt_logprobs
            if want is not None and r.prefilling:
                start = r.num_computed
                k = max(0, min(n, r.num_prompt_tokens - 1 - start))
                targets = [r.token_at(p + 1) for p in range(start, start + k)]
                if k:
                    r.prompt_logprobs += score_tokens(hidden[row:row + k], targets, want, self.model.logits)
            row += n

    def _sample(self, logits: torch.Tensor, sampled: list[Request]) -> SampleOutput:
        """One token for each row of `logits` ([R, V], the rows of `sampled`): early-stop bans,
        logit_bias, the grammars' masks, then the sampler; logprobs stay the model's."""
        guides = [r.guide for r in sampled]
        bans = [self._early_stops(r) for r in sampled]
        for row, (banned, guide) in enumerate(zip(bans, guides)):
            if banned and not (guide is not None and guide.masks):    # a masked row's ban: the masker's
                logits[row, banned] = float("-inf")
        params, generators = [r.params for r in sampled], [r.generator for r in sampled]
        want_logprobs = any(p.logprobs is not None for p in params)
        raw = logits
        if any(p.logit_bias for p in params):
            logits = logits.clone()               # the logprobs stay the model's
            for row, p in enumerate(params):
                if p.logit_bias:
                    ids = torch.tensor([t for t, _ in p.logit_bias], device=logits.device)
                    logits[row, ids] += torch.tensor([b for _, b in p.logit_bias], device=logits.device)
        masked = self.masker.apply(logits, guides, copy=want_logprobs and logits is raw, bans=bans)
        # logprobs stay the model's (before the grammar): `raw` is unmasked unless masked in place,
        # which happens only when no row wants logprobs
        return sample(logits if masked is None else masked, params, generators, raw=raw)

    def _early_stops(self, req: Request) -> list[int]:
        """The tokens a request under `min_tokens` cannot pick: EOS (unless ignored) and its stop
        tokens (none past min_tokens)."""
        if not req.under_min_tokens:
            return []
        banned = set(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            banned |= self.eos_ids
        return sorted(banned)
