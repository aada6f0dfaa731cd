"""Sampling: seeds, top-k/top-p limits, logprobs."""

import math

import torch

from engine import SamplingParams
from engine.sampling import sample

PROMPT = [40, 41, 42, 43]


def test_seeded_sampling_is_reproducible_and_batch_independent(random_llm):
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=123, ignore_eos=True)
    a = random_llm.generate([PROMPT], p)[0].token_ids
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    b = random_llm.generate([[7, 8], PROMPT, [9]], [others, p, others])[1].token_ids
    c = random_llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=1.0, seed=124,
                                                     ignore_eos=True))[0].token_ids
    assert a == b and a != c


def test_top_k_1_and_tiny_top_p_are_greedy(random_llm):
    greedy = random_llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    for p in (SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, seed=2, ignore_eos=True)):
        assert random_llm.generate([PROMPT], p)[0].token_ids == greedy.token_ids


def test_sampler_respects_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(400)]
    k2 = sample(logits, [SamplingParams(temperature=1.0, top_k=2)] * 400, gens).tokens
    assert set(k2) == {0, 1}
    p7 = sample(logits, [SamplingParams(temperature=1.0, top_p=0.7)] * 400, gens).tokens
    assert set(p7) == {0, 1}  # 0.5 alone is below 0.7; 0.5 + 0.3 covers it
    full = sample(logits, [SamplingParams(temperature=1.0)] * 400, gens).tokens
    assert set(full) == {0, 1, 2, 3}
    share = full.count(0) / 400
    assert 0.4 < share < 0.6


def test_logprobs_hold_the_chosen_token_and_top_n(random_llm):
    out = random_llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=1.0, seed=5,
                                                       logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 6
    for tok, lps in zip(out.token_ids, out.logprobs):
        assert tok in lps and 3 <= len(lps) <= 4
        assert all(v <= 0 for v in lps.values())
        assert sum(math.exp(v) for k, v in lps.items()) <= 1.0 + 1e-5
    none = random_llm.generate([PROMPT], SamplingParams(max_tokens=2))[0]
    assert none.logprobs is None
