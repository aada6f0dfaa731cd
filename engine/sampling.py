"""The batched sampler (greedy, temperature, top-k, top-p, per-request seeds, logprobs of the
chosen token plus the top N).  The parameters it reads live in `engine.params`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.params import SamplingParams

__all__ = ["SampleOutput", "request_generator", "sample"]


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[dict[int, float] | None]


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator], raw: torch.Tensor | None = None) -> SampleOutput:
    """Pick one token per row.  logits: [B, V] fp32 (raw model output, or its masked copy with
    `raw` the model's output: a grammar's -inf where a token is not allowed).

    Logprobs are those of the raw model distribution (before temperature, cuts and a mask).
    Each row's random draw comes from its own generator, so a seeded request samples
    the same tokens whatever else is in the batch.
    """
    b = logits.shape[0]
    tokens = logits.argmax(dim=-1)  # [B]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        tokens[rows] = _sample_rows(logits[rows], [params[i] for i in sampled],
                                    [generators[i] for i in sampled])
    token_list = tokens.tolist()
    want = [p.logprobs for p in params]
    if all(w is None for w in want):
        return SampleOutput(token_list, [None] * b)
    logp = torch.log_softmax(logits if raw is None else raw, dim=-1)
    top_n = max(w for w in want if w is not None)
    top = logp.topk(top_n, dim=-1) if top_n else None   # values, indices: [B, top_n]
    chosen = logp.gather(1, tokens[:, None]).squeeze(1).tolist()
    out: list[dict[int, float] | None] = []
    for i, n in enumerate(want):
        if n is None:
            out.append(None)
            continue
        entry = {token_list[i]: chosen[i]}
        if n and top is not None:
            for tid, val in zip(top.indices[i, :n].tolist(), top.values[i, :n].tolist()):
                entry.setdefault(tid, val)
        out.append(entry)
    return SampleOutput(token_list, out)


def request_generator(seed: int, draws: int = 0) -> torch.Generator:
    """A request's generator seeded with `seed` and advanced past `draws` draws.  `sample`
    takes exactly one draw (`_draw`) per token of a non-greedy request and none of a greedy
    one, so a request that already has n tokens continues its stream with
    `request_generator(seed, n)` (n = 0 for greedy requests makes no difference)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(draws):
        _draw(g)
    return g


def _draw(g: torch.Generator) -> torch.Tensor:
    """The one uniform draw of a sampled token."""
    return torch.rand((), generator=g)


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator]) -> torch.Tensor:
    """Temperature, top-k and top-p over sorted logits, then an inverse-CDF draw."""
    temp = torch.tensor([p.temperature for p in params], device=logits.device)
    scaled = logits / temp[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [R, V]
    rank = torch.arange(logits.shape[1], device=logits.device)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else logits.shape[1] for p in params],
                         device=logits.device)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=probs.dtype)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    probs = probs.masked_fill((before >= top_p[:, None]) & (rank > 0), 0.0)
    cdf = probs.cumsum(dim=-1)
    u = torch.stack([_draw(g) for g in generators]).to(logits.device)
    u = u * cdf[:, -1]
    pick = torch.searchsorted(cdf, u[:, None]).clamp_(max=logits.shape[1] - 1)  # [R, 1]
    return order.gather(1, pick).squeeze(1)
