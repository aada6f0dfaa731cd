"""Stop handling on the decode worker, end to end through prefill and decode workers:
stop strings across token boundaries (trimmed and kept), streaming hold-back, stop regexes
(matched, never searched for literally), stop token ids, min_tokens, matched_stop."""

from __future__ import annotations

import pytest

from engine.params import SamplingParams
from tests.workers import channel, config, run, start_decode, start_prefill, wait_idle

PROMPT = "Please repeat: paged experts keep the hot experts resident"


@pytest.fixture(scope="module")
def workers():
    cfg = config()
    decode, prefill = start_decode(cfg), start_prefill(cfg)
    yield channel(decode.address), channel(prefill.address)
    wait_idle(decode, prefill)
    decode.stop()
    prefill.stop()


@pytest.fixture(scope="module")
def case(shipped_llm):
    """The prompt's ids, its free-running greedy output (token ids and text) and token texts."""
    tok = shipped_llm.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    out = shipped_llm.generate([ids], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    return ids, out.token_ids, out.text, [tok.decode([t]) for t in out.token_ids]


def check(workers, shipped_llm, ids, params, text, reason="stop", matched=None):
    got = run(*workers, f"stop-{abs(hash((params, text)))}", ids, params)
    assert got.error is None, got.error
    assert got.text == text, (got.text, text)                   # streamed deltas add up exactly
    assert got.finish.finish_reason == reason
    if isinstance(matched, int):
        assert got.finish.matched_token and got.finish.matched_token_id == matched
    elif matched is not None:
        assert got.finish.matched_stop == matched
    want = shipped_llm.generate([ids], params)[0]                  # the single-process engine agrees
    assert (want.text, want.token_ids, want.matched_stop) == (text, got.token_ids, matched)
    return got


def boundary_stop(token_texts, text) -> tuple[str, int]:
    """A stop string that starts inside one token and ends inside a later one."""
    pos = 0
    for a, b in zip(token_texts, token_texts[1:]):
        pos += len(a)
        if len(a) >= 2 and len(b) >= 2:
            s = a[-2:] + b[:2]
            if text.find(s) == pos - 2:
                return s, pos - 2
    raise AssertionError("no two neighbouring tokens of 2+ characters")


def test_a_stop_string_across_tokens_is_cut_and_held_back_while_streaming(workers, shipped_llm, case):
    ids, _, text, token_texts = case
    stop, at = boundary_stop(token_texts, text)
    got = check(workers, shipped_llm, ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                          stop=[stop]), text[:at], matched=stop)
    assert all(stop[0] not in d for d in got.deltas[-2:]) and "" in got.deltas   # held, then cut
    check(workers, shipped_llm, ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                    stop=[stop], no_stop_trim=True),
          text[:at + len(stop)], matched=stop)


def test_a_stop_regex_matches_a_pattern_not_its_source_text(workers, shipped_llm, case):
    ids, _, text, _ = case
    import re
    word = next(w for w in re.findall(r"[a-z]{3,}", text[5:]))
    pattern = re.escape(word[0]) + "." + re.escape(word[2:])      # e.g. "h.t": "hot" matches
    assert pattern not in text
    m = re.search(pattern, text)
    params = dict(max_tokens=40, temperature=0, ignore_eos=True, stop_regex=[pattern])
    check(workers, shipped_llm, ids, SamplingParams(**params), text[:m.start()], matched=pattern)
    check(workers, shipped_llm, ids, SamplingParams(**params, no_stop_trim=True), text[:m.end()],
          matched=pattern)


def test_stop_token_ids(workers, shipped_llm, case):
    ids, tokens, _, _ = case
    i = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    tok = shipped_llm.tokenizer
    params = dict(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[tokens[i]])
    check(workers, shipped_llm, ids, SamplingParams(**params), tok.decode(tokens[:i]), matched=tokens[i])
    check(workers, shipped_llm, ids, SamplingParams(**params, no_stop_trim=True), tok.decode(tokens[:i + 1]),
          matched=tokens[i])


def test_min_tokens_holds_off_eos(workers, shipped_llm):
    tok = shipped_llm.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Repeat after me: blue kettle"}]))
    free = shipped_llm.generate([ids], SamplingParams(max_tokens=30, temperature=0))[0]
    assert free.finish_reason == "stop" and len(free.token_ids) < 10        # stops early by itself
    params = SamplingParams(max_tokens=30, temperature=0, min_tokens=12)
    want = shipped_llm.generate([ids], params)[0]
    got = run(*workers, "min-tokens", ids, params)
    assert got.error is None and got.token_ids == want.token_ids
    assert len(got.token_ids) >= 12
    assert not set(got.token_ids[:11]) & shipped_llm.eos_ids


def test_length_finish_has_no_matched_stop(workers, shipped_llm, case):
    ids, tokens, _, _ = case
    got = run(*workers, "length", ids, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert got.finish.finish_reason == "length" and not got.finish.matched_stop
    assert got.token_ids == tokens[:5] and got.finish.completion_tokens == 5
