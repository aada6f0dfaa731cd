"""The log-probabilities of a prompt's own tokens, computed while it is prefilled.

The logits at position p score the token at p + 1, so a prefill chunk covering positions
[s, s + n) scores the prompt tokens s + 1 .. s + n (those that exist): a chunk needs nothing
from the chunks before it, and chunked prefill gives the same entries as a whole one (within
the tolerance of its different reduction order, DESIGN I7).  The first prompt token has no
entry (nothing precedes it).

Rows go through the LM head in blocks of `BLOCK_ROWS`, so a long prompt never holds [T, V]
logits at once, and every block has the same shape whatever else shares the step."""

from __future__ import annotations

from typing import Callable

import torch

from engine.prompt_entry import PromptLogprob

BLOCK_ROWS = 256


def score_tokens(hidden: torch.Tensor, targets: list[int], top_n: int,
                 logits: Callable[[torch.Tensor], torch.Tensor]) -> list[PromptLogprob]:
    """Entries for `targets[i]` scored by `hidden[i]` ([R, H] final hidden states; `logits` maps
    rows to fp32 logits), with `top_n` alternatives each."""
    out: list[PromptLogprob] = []
    for start in range(0, len(targets), BLOCK_ROWS):
        block = hidden[start:start + BLOCK_ROWS]
        want = torch.tensor(targets[start:start + BLOCK_ROWS], dtype=torch.int64, device=hidden.device)
        logp = torch.log_softmax(logits(block), dim=-1)                     # [R, V] fp32
        chosen = logp.gather(1, want[:, None])                              # [R, 1]
        ranks = (logp > chosen).sum(dim=-1) + 1
        top = logp.topk(top_n, dim=-1) if top_n else None
        rows = zip(want.tolist(), chosen.squeeze(1).tolist(), ranks.tolist())
        for i, (token, lp, rank) in enumerate(rows):
            alts = tuple(zip(top.indices[i].tolist(), top.values[i].tolist())) if top is not None else ()
            out.append(PromptLogprob(token, lp, rank, alts))
    return out
