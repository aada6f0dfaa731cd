"""Parity with transformers (fp32): the engine's greedy tokens are transformers' argmax at
every step (teacher-forced over the engine's own output), and every logprob the engine reports
is within TOLERANCE of transformers' log-softmax."""

from __future__ import annotations

from typing import Any

import torch

from engine import SamplingParams

NEW_TOKENS = 32
TOLERANCE = 1e-4


def hf_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def check_parity(llm: Any, hf: Any, prompts: list[Any], new_tokens: int = NEW_TOKENS) -> float:
    """Asserts parity for every prompt (text or token ids); returns the largest logprob difference."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, logprobs=5)
    worst = 0.0
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        assert len(out.token_ids) == new_tokens
        ref = hf_logprobs(hf, out.prompt_token_ids + out.token_ids)
        n = len(out.prompt_token_ids)
        assert ref[n - 1:-1].argmax(-1).tolist() == out.token_ids, f"greedy tokens differ for {prompt!r}"
        for step, lps in enumerate(out.logprobs):
            for tid, lp in lps.items():
                diff = abs(lp - ref[n - 1 + step, tid].item())
                assert diff <= TOLERANCE, f"step {step} token {tid}: {lp} differs from transformers by {diff}"
                worst = max(worst, diff)
    return worst
