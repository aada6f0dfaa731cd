"""Bad input gets a clear exception and leaves nothing behind."""

import pytest

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def small_llm(random_ckpt):
    # Context 512 (config), KV capacity 256 tokens: both limits are reachable.
    return LLM(random_ckpt, kv_cache_tokens=256, page_size=16)


def assert_untouched(llm):
    llm.pool.check_integrity()
    assert llm.pool.num_free == llm.pool.num_pages and not llm.scheduler.has_work()


@pytest.mark.parametrize("prompt, message", [
    ("", "empty prompt"),
    ([], "empty prompt"),
    ([5, 4096], r"prompt token 1 is 4096, not a token id in 0\.\.4095"),
    ([-1], r"prompt token 0 is -1"),
    ([1.5], r"prompt token 0 is 1\.5"),
])
def test_bad_prompts(small_llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        small_llm.generate([prompt], SamplingParams(max_tokens=4))
    assert_untouched(small_llm)


def test_over_the_model_context(random_ckpt):
    llm = LLM(random_ckpt, kv_cache_tokens=4096)
    with pytest.raises(ValueError, match=r"prompt \(500 tokens\) \+ max_tokens \(13\) = 513 exceeds "
                                         r"the model context of 512 tokens"):
        llm.generate([[7] * 500], SamplingParams(max_tokens=13))
    assert_untouched(llm)
    assert len(llm.generate([[7] * 500], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids) == 12


def test_over_the_kv_capacity(small_llm):
    with pytest.raises(ValueError, match=r"= 257 exceeds the KV cache capacity of 256 tokens"):
        small_llm.generate([[7] * 250], SamplingParams(max_tokens=7))
    assert_untouched(small_llm)


def test_one_bad_prompt_in_a_batch_adds_nothing(small_llm):
    with pytest.raises(ValueError, match="empty prompt"):
        small_llm.generate([[1, 2, 3], []], SamplingParams(max_tokens=4))
    assert_untouched(small_llm)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -3}, "top_k must be -1"),
    ({"logprobs": 21}, r"logprobs must be in 0\.\.20"),
    ({"stop": [""]}, "stop strings must be non-empty"),
    ({"stop_token_ids": [-2]}, "stop_token_ids must be non-negative"),
    ({"seed": "x"}, "seed must be an integer"),
])
def test_invalid_sampling_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_mismatched_params_list(small_llm):
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        small_llm.generate([[1], [2]], [SamplingParams()])
    assert_untouched(small_llm)


def test_bad_engine_settings(random_ckpt, tmp_path):
    with pytest.raises(ValueError, match="page_size=12 must be a positive power of two"):
        LLM(random_ckpt, page_size=12)
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        LLM(random_ckpt, dtype="float8")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(tmp_path)
