"""Prompt logprobs in the engine (engine/prompt_logprobs.py): equal to transformers'
log-softmax within the suite's 1e-4, to an unchunked run within 1e-5 whatever the chunking
and whatever shares the step, computed (not skipped) for a prefix the cache holds; max_tokens 0
only prefills; logit_bias moves the sampled token and not the logprobs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.errors import RequestError
from engine.params import MAX_PROMPT_LOGPROB_ENTRIES
from tests.parity import TOLERANCE, hf_logprobs

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
EXACT = 1e-5


@pytest.fixture(scope="module")
def shipped_hf(shipped_llm):
    return AutoModelForCausalLM.from_pretrained(shipped_llm.config.model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chunked_llm():
    """Prefill in chunks of 7 tokens, several prompts per step."""
    return LLM(max_prefill_tokens=7, compile=False)


def entries(out):
    return [(e.token, e.logprob, e.rank, e.top) for e in out.prompt_logprobs]


def close(a, b, tol):
    assert [x[0] for x in a] == [x[0] for x in b]
    assert [x[2] for x in a] == [x[2] for x in b]
    for (_, la, _, ta), (_, lb, _, tb) in zip(a, b):
        assert abs(la - lb) <= tol
        assert [t for t, _ in ta] == [t for t, _ in tb]
        assert all(abs(x - y) <= tol for (_, x), (_, y) in zip(ta, tb))


def test_prompt_logprobs_equal_transformers(shipped_llm, shipped_hf):
    out = shipped_llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))[0]
    ids = out.prompt_token_ids
    ref = hf_logprobs(shipped_hf, ids)
    assert [e.token for e in out.prompt_logprobs] == ids[1:]          # the first token has no entry
    for p, e in enumerate(out.prompt_logprobs):
        row = ref[p]
        assert abs(e.logprob - row[ids[p + 1]].item()) <= TOLERANCE
        assert e.rank == int((row > row[ids[p + 1]]).sum()) + 1 or abs(e.logprob - row.max().item()) <= TOLERANCE
        assert [t for t, _ in e.top] == row.topk(3).indices.tolist()
        assert e.top[0][1] >= e.top[1][1] >= e.top[2][1]


def test_chunked_and_batched_equal_whole(shipped_llm, chunked_llm):
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    whole = shipped_llm.generate(PROMPT, params)[0]
    others = ["import os\n", "class Stack:\n    pass\n" * 3]
    outs = chunked_llm.generate([others[0], PROMPT, others[1]], [SamplingParams(max_tokens=3), params, params])
    close(entries(outs[1]), entries(whole), EXACT)
    assert outs[1].token_ids == whole.token_ids
    assert outs[0].prompt_logprobs is None and len(outs[2].prompt_logprobs) == len(outs[2].prompt_token_ids) - 1


def test_a_cached_prefix_is_computed_again(chunked_llm):
    """The prefix cache holds the prompt after the first run; a request that asks for prompt
    logprobs still computes every token (0 cached)."""
    chunked_llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0))
    again = chunked_llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0))[0]
    assert again.num_cached_tokens > 0
    a = chunked_llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    assert a.num_cached_tokens == 0 and len(a.prompt_logprobs) == len(a.prompt_token_ids) - 1


def test_max_tokens_0_only_prefills(shipped_llm):
    out = shipped_llm.generate(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    assert out.token_ids == [] and out.text == "" and out.finish_reason == "length"
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) - 1
    with pytest.raises(ValueError, match="0 only with prompt_logprobs"):
        SamplingParams(max_tokens=0)


def test_prompt_logprobs_are_bounded(shipped_llm):
    n = MAX_PROMPT_LOGPROB_ENTRIES // 21 + 1
    with pytest.raises(RequestError, match="exceed the limit"):
        shipped_llm.generate([5] * n, SamplingParams(max_tokens=1, prompt_logprobs=20))
    with pytest.raises(ValueError, match="prompt_logprobs must be in 0..20"):
        SamplingParams(prompt_logprobs=21)


def test_logit_bias_moves_the_pick_not_the_logprobs(shipped_llm):
    plain = shipped_llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, logprobs=1))[0]
    forced = 77
    assert forced not in plain.token_ids
    biased = shipped_llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, logprobs=1,
                                                         logit_bias=((forced, 100.0),)))[0]
    assert biased.token_ids == [forced] * 4          # the prefill's first token and every decode step
    # the first step's logprobs are the model's, unbiased: the same distribution as the plain run
    assert abs(biased.logprobs[0][plain.token_ids[0]] - plain.logprobs[0][plain.token_ids[0]]) <= EXACT
    banned = shipped_llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0,
                                                         logit_bias=((plain.token_ids[0], -100.0),)))[0]
    assert banned.token_ids[0] != plain.token_ids[0]
    with pytest.raises(ValueError, match="logit_bias values must be in -100..100"):
        SamplingParams(logit_bias=((5, 101.0),))
    with pytest.raises(RequestError, match="logit_bias token"):
        shipped_llm.generate(PROMPT, SamplingParams(logit_bias=((10**6, 1.0),)))
