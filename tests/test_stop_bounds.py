"""Stop conditions in bounded work (issue 16): caps and ranges refused by name, regexes that
cannot be compiled in bounded memory refused, the work per token independent of the output's
length (counted, never timed), a pattern past the budget ending its request with an explicit
error, and streaming exactly as the full re-decoding checker streamed."""

from __future__ import annotations

import random

import pytest

from bench.engine import FullDecodeStopChecker
from engine.errors import RequestError
from engine.params import SamplingParams
from engine.stop import StopChecker, StopLimits
from engine.tokenizer import Tokenizer
from worker.convert import params_from_proto, params_to_proto

CATASTROPHIC = r"(?:.|.)+(?!)"      # exponential backtracking: seconds at ~22 characters


@pytest.mark.parametrize("kwargs, message", [
    ({"top_k": 2**40}, r"top_k must be -1 \(off\) or in 1\.\.2147483647"),
    ({"stop_token_ids": [2**33]}, "stop_token_ids must be non-negative integers <= 4294967295"),
    ({"seed": 2**64}, r"seed must be an integer in 0\.\.18446744073709551615"),
    ({"seed": -1}, "seed must be an integer in 0"),
    ({"max_tokens": 2**32}, r"max_tokens must be an integer >= 1 \(0 only with prompt_logprobs: prefill only\) and "
                            "<= 4294967295"),
    ({"max_tokens": True}, "max_tokens must be an integer"),
    ({"temperature": float("nan")}, "temperature must be >= 0 and finite"),
    ({"temperature": float("inf")}, "temperature must be >= 0 and finite"),
    ({"stop": ["x"] * 17}, "stop has 17 strings; at most 16 are allowed"),
    ({"stop": ["x" * 257]}, "stop strings must be at most 256 characters, got one of 257"),
    ({"stop_token_ids": list(range(257))}, "stop_token_ids has 257 ids; at most 256 are allowed"),
    ({"stop_regex": ["x"] * 5}, "stop_regex has 5 patterns; at most 4 are allowed"),
    ({"stop_regex": ["x" * 513]}, "stop_regex patterns must be at most 512 characters, got one of 513"),
    ({"stop_regex": [r"(?:(?:a{1000}){1000}){1000}"]}, r"stop_regex '\(\?:\(\?:a\{1000\}.* repeats too much"),
    ({"stop_regex": [r"(?#[)(?:a{1000}){1000}(?#])"]}, "repeats too much"),
    ({"stop_regex": ["(?x)a # [ \n (?:b{200}){200} # ]"]}, "repeats too much"),
    ({"stop_regex": ["[a-z]{1,100000}"]}, "repeats too much"),
])
def test_out_of_range_and_over_the_caps_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_every_accepted_extreme_fits_the_wire():
    """What SamplingParams accepts always converts to the proto and back (no 500 at the gateway)."""
    p = SamplingParams(max_tokens=2**32 - 1, min_tokens=2**32 - 1, top_k=2**31 - 1, seed=2**64 - 1,
                       stop_token_ids=tuple(range(2**32 - 256, 2**32)), stop=tuple("x" * 256 for _ in range(16)),
                       stop_regex=tuple(["a{16000}"] + ["b" * 512] * 3))
    assert params_from_proto(params_to_proto(p)) == p


def counting(tokenizer: Tokenizer) -> Tokenizer:
    """`tokenizer` whose decode counts the ids it is given (`decoded` list, one entry a call)."""
    decoded: list[int] = []

    class Counting(Tokenizer):
        def __init__(self) -> None:
            self.__dict__.update(tokenizer.__dict__)
            self.decoded = decoded

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            self.decoded.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens)
    return Counting()


def long_stream(tok: Tokenizer, count: int) -> list[int]:
    ids = tok.encode("def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n" * 200)
    assert len(ids) >= count
    return ids[:count]


def test_work_per_token_does_not_grow_with_the_output(shipped_llm):
    """Decode calls, ids decoded and characters searched per token are the same at 100 and at
    2,000 output tokens, and under a bound set by the limits and the stop lists."""
    tok = counting(shipped_llm.tokenizer)
    limits = StopLimits(window_chars=256)
    params = SamplingParams(max_tokens=4000, ignore_eos=True, stop=["\n\nUser:", "<|im_end|>"],
                            stop_regex=[r"\bEND_OF_ANSWER\b", r"\d{4}-\d{2}-\d{2}T"])
    checker = StopChecker(params, tok, shipped_llm.eos_ids, 10**6, limits)
    chars, decoded = [], []
    for i, token in enumerate(long_stream(tok, 2000)):
        before_chars, before_calls = checker.work.chars, len(tok.decoded)
        assert checker.append(token, i + 1) is None
        checker.delta()
        chars.append(checker.work.chars - before_chars)
        decoded.append(tok.decoded[before_calls:])
    longest_token = 64
    bound = 2 * (2 * (limits.window_chars + 1)) + 2 * (6 + longest_token) + 2 * 6
    assert max(chars) <= bound and max(chars[1000:]) == max(chars[100:200])
    assert all(len(calls) <= 2 and sum(calls) <= 2 * 8 for calls in decoded)
    assert checker.text == shipped_llm.tokenizer.decode(checker.token_ids)


def test_a_catastrophic_regex_ends_its_request_with_an_error(shipped_llm):
    """The engine's token path: the request ends ("error", pages free, the message names the
    pattern and the budget); the request beside it in the batch completes as it would alone."""
    bad = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, stop_regex=[CATASTROPHIC])
    good = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = shipped_llm.generate(["def add(a, b):"], good)[0]
    # ended by the per-token budget, or before that by the mean budget (its cost doubles per character)
    ended = r"stop_regex '\(\?:\.\|\.\)\+\(\?!\)' exceeded the stop-check budget of 50 ms per token"
    with pytest.raises(RequestError, match=ended + "|over the limit of 5 ms per token on average") as e:
        shipped_llm.generate(["The quick brown fox", "def add(a, b):"], [bad, good])
    assert e.value.code == "INVALID_REQUEST"
    bad_req = shipped_llm.add_request("The quick brown fox", bad)
    good_req = shipped_llm.add_request("def add(a, b):", good)
    outs = {}
    for _ in range(300):
        if not shipped_llm.scheduler.has_work():
            break
        outs.update({o.request_id: o for o in shipped_llm.step()})
    assert outs[bad_req.request_id].finish_reason == "error" and len(bad_req.output_token_ids) < 200
    assert outs[good_req.request_id].token_ids == want.token_ids


def test_the_budget_covers_the_whole_check(shipped_llm):
    """A clock that jumps past the budget ends the request at the first regex search."""
    ticks = iter(range(0, 10**6, 10))
    checker = StopChecker(SamplingParams(max_tokens=8, stop_regex=["never"]), shipped_llm.tokenizer,
                          shipped_llm.eos_ids, 4096, StopLimits(budget_s=5.0), clock=lambda: float(next(ticks)))
    assert checker.append(shipped_llm.tokenizer.encode("hello")[0], 1) == "error"
    assert "stop_regex 'never' exceeded the stop-check budget of 5000 ms" in str(checker.error)
    assert checker.delta() == ""


@pytest.mark.parametrize("ms_per_token, ends", [(6.0, True), (4.0, False)])
def test_checks_that_cost_more_than_the_mean_budget_end_the_request(shipped_llm, ms_per_token, ends):
    """Under the per-token budget every time, but over the 5 ms mean: the request ends once the
    grace tokens are past; at 4 ms per token it runs to its length."""
    now = [0.0]
    params = SamplingParams(max_tokens=20, ignore_eos=True, stop_regex=["never"])
    checker = StopChecker(params, shipped_llm.tokenizer, shipped_llm.eos_ids, 4096, StopLimits(budget_s=5.0),
                          clock=lambda: now[0])
    check = checker._check

    def costly_check(*args):       # each token's check takes ms_per_token by the checker's clock
        now[0] += ms_per_token / 1000
        return check(*args)

    checker._check = costly_check
    token = shipped_llm.tokenizer.encode("hello")[0]
    reasons = [checker.append(token, 1 + i) for i in range(20)]
    if ends:
        assert reasons.index("error") == StopLimits().grace_tokens - 1 and "on average" in str(checker.error)
    else:
        assert reasons[:-1] == [None] * 19 and reasons[-1] == "length" and checker.error is None


STOPS = ["\n", "ret", "(self", "  ", "x = ", "ab", "json"]
REGEXES = [r"\d+\.\d", r"re(?:turn|ad)\b", r"\(\w+,", r"[A-Z]{3}", r"(?m)^\s*#", r"f\("]


@pytest.mark.parametrize("seed", range(40))
def test_streaming_exactly_as_the_full_redecoding_checker(shipped_llm, seed):
    """Random stop strings, regexes, min_tokens and no_stop_trim over real and random token
    streams: every delta, the finish, the match and the final text as before issue 16."""
    rng = random.Random(seed)
    tok = shipped_llm.tokenizer
    if seed % 2:
        ids = long_stream(tok, 400)[rng.randrange(200):]
    else:
        ids = [rng.randrange(tok.vocab_size) if rng.random() < 0.8 else rng.randrange(256) for _ in range(200)]
    params = SamplingParams(max_tokens=rng.randrange(20, 150), ignore_eos=rng.random() < 0.5,
                            stop=rng.sample(STOPS, rng.randrange(4)), stop_regex=rng.sample(REGEXES, rng.randrange(3)),
                            min_tokens=rng.randrange(5), no_stop_trim=rng.random() < 0.3)
    old = FullDecodeStopChecker(params, tok, shipped_llm.eos_ids, 4096)
    new = StopChecker(params, tok, shipped_llm.eos_ids, 4096)
    for i, token in enumerate(ids):
        reasons = old.append(token, i + 1), new.append(token, i + 1)
        assert reasons[0] == reasons[1] and old.delta() == new.delta(), (i, reasons)
        if reasons[0] is not None:
            break
    assert (old.matched_stop, old.final_text()) == (new.matched_stop, new.final_text())
