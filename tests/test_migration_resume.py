"""A migrated request continues exactly (issue 19): a Generate that carries the original prompt
and the tokens already streamed (`generated_token_ids`, with the first reservation's seed) goes
on with the tokens, text and usage of the uninterrupted stream, and its logprobs agree within
1e-5 (the generated tokens' KV is recomputed by prefill, in another reduction order than decode
computed it) — greedy and seeded, across a break after the first token, mid-word, inside a stop
string's prefix (the stop spans the break, its held-back text is not lost), under min_tokens,
and one token before max_tokens.  Generated tokens that already end the request answer with one
Finish and reserve nothing; tokens past the end, a missing seed or a moved prompt/generated
boundary are refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import regex
import torch

from deploy.colocated import start_colocated_worker
from engine.params import SamplingParams
from engine.sampling import request_generator
from kv_transfer.frame import prompt_digest
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc
from tests.workers import (
    Result,
    channel,
    config,
    generate_order,
    module_worker,
    run,
    start_decode,
    start_prefill,
    wait_idle,
)

GREEDY = SamplingParams(max_tokens=24, temperature=0, logprobs=2, seed=5)
SEEDED = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, logprobs=2, seed=1234)

decode = module_worker(start_decode)
prefill = module_worker(start_prefill)


@pytest.fixture(scope="module")
def chs(decode, prefill):
    return channel(decode.address), channel(prefill.address)


@pytest.fixture(scope="module")
def prompt(shipped_llm):
    return shipped_llm.tokenizer.encode("def add(a, b):\n    return")


def _stream(chs, rid: str, ids: list[int], params: SamplingParams, generated: list[int] = ()) -> Result:
    r = run(*chs, rid, ids, params, generated=generated)
    assert r.error is None, r.error
    return r


def assert_continues(full: Result, k: int, resumed: Result) -> None:
    """`resumed` (after k generated tokens) is the rest of `full`: tokens, text, usage, logprobs."""
    assert resumed.token_ids == full.token_ids[k:]
    assert "".join(full.deltas[:k]) + resumed.text == full.text       # one Tokens message per token
    assert resumed.finish.finish_reason == full.finish.finish_reason
    assert resumed.finish.matched_stop == full.finish.matched_stop
    assert resumed.finish.matched_token_id == full.finish.matched_token_id
    assert resumed.finish.prompt_tokens == full.finish.prompt_tokens
    assert resumed.finish.completion_tokens == full.finish.completion_tokens
    assert len(resumed.logprobs) == len(full.logprobs) - k
    for got, want in zip(resumed.logprobs, full.logprobs[k:]):
        assert got.keys() == want.keys()
        assert all(abs(got[t] - want[t]) < 1e-5 for t in want), (got, want)


def _word(c: str) -> bool:
    return c.isalnum() or c == "_"


def _mid_word(tokenizer, ids: list[int]) -> int:
    """A break k where token k continues the word token k - 1 ended."""
    for k in range(2, len(ids) - 1):
        before, after = tokenizer.decode(ids[:k]), tokenizer.decode(ids[:k + 1])
        if _word(before[-1:]) and _word(after[len(before):][:1]):
            return k
    raise AssertionError(f"no mid-word break in {tokenizer.decode(ids)!r}")


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_resumed_request_continues_the_uninterrupted_stream(decode, prefill, chs, prompt, params, shipped_llm):
    full = _stream(chs, "full", prompt, params)
    assert full.finish.completion_tokens == params.max_tokens      # the breaks below all fall inside
    ks = {1, _mid_word(shipped_llm.tokenizer, full.token_ids), params.max_tokens - 1}
    for k in sorted(ks):
        assert_continues(full, k, _stream(chs, f"k{k}", prompt, params, full.token_ids[:k]))
    # the stream equals the single-process engine's (I7), the break points included
    assert full.token_ids == shipped_llm.generate([prompt], params)[0].token_ids
    wait_idle(decode, prefill)


@pytest.mark.parametrize("params, kind", [(GREEDY, "stop"), (SEEDED, "stop"), (SEEDED, "stop_regex")],
                         ids=["greedy", "seeded", "seeded-regex"])
def test_a_stop_string_spanning_the_break_is_found_and_its_held_back_text_kept(decode, prefill, chs, prompt,
                                                                               params, kind, shipped_llm):
    tok = shipped_llm.tokenizer
    plain = _stream(chs, "plain", prompt, params).token_ids
    j, stop = _spanning_stop(tok, plain)
    stopping = replace(params, **{kind: (stop if kind == "stop" else regex.escape(stop),)})
    full = _stream(chs, "stop-full", prompt, stopping)
    assert full.finish.finish_reason == "stop"
    assert (full.finish.matched_stop,) == stopping.stop + stopping.stop_regex
    assert len(full.token_ids) == j + 2
    k = j + 1                                     # the break: the stop's first part is generated
    assert len("".join(full.deltas[:k])) < len(tok.decode(plain[:k])), "nothing was held back"
    assert_continues(full, k, _stream(chs, "stop-resumed", prompt, stopping, full.token_ids[:k]))
    wait_idle(decode, prefill)


def _spanning_stop(tokenizer, ids: list[int]) -> tuple[int, str]:
    """A token j and a stop string made of the end of token j's text and the start of token
    j + 1's that first occurs there."""
    for j in range(3, len(ids) - 2):
        a, b, c = (tokenizer.decode(ids[:n]) for n in (j, j + 1, j + 2))
        tail, head = b[len(a):][-2:], c[len(b):][:2]
        stop = tail + head
        if len(tail) == 2 and len(head) == 2 and c.find(stop) == len(b) - 2 and "\ufffd" not in stop:
            return j, stop
    raise AssertionError(f"no spanning stop string in {tokenizer.decode(ids)!r}")


def test_min_tokens_and_a_stop_token_count_the_generated_tokens(decode, prefill, chs, prompt):
    """A stop token that min_tokens bans before the 8th token, and that stops the stream after
    it: the break before, at and after min_tokens continues exactly."""
    plain = _stream(chs, "mt-plain", prompt, GREEDY).token_ids
    for i, stop_id in enumerate(dict.fromkeys(plain[:8])):
        params = replace(GREEDY, stop_token_ids=(stop_id,), min_tokens=8)
        full = _stream(chs, f"mt-full{i}", prompt, params)
        if full.finish.finish_reason == "stop":
            break
    else:
        pytest.fail(f"no stop token of {plain[:8]} stops the stream after min_tokens")
    assert full.finish.matched_token_id == stop_id and len(full.token_ids) > 8
    assert stop_id not in full.token_ids[:-1] and stop_id in plain[:8]
    for k in (2, 7, 8):
        assert_continues(full, k, _stream(chs, f"mt{k}", prompt, params, full.token_ids[:k]))
    wait_idle(decode, prefill)


def _one_reply(decode, ids: list[int], params: SamplingParams, generated: list[int]) -> list[wpb.GenerateResponse]:
    call = wpb_grpc.DecodeServiceStub(channel(decode.address)).Generate(
        generate_order("ended", ids, params, generated).to_proto(), timeout=60)
    return list(call)


def test_generated_tokens_that_end_the_request_get_one_finish_and_reserve_nothing(decode, prefill, chs, prompt):
    full = _stream(chs, "end-length", prompt, SEEDED)                           # ends by length
    plain = _stream(chs, "end-plain", prompt, GREEDY).token_ids
    stopped = replace(GREEDY, stop_token_ids=(plain[5],))
    by_token = _stream(chs, "end-token", prompt, stopped)                       # ends with a stop token
    for params, r in ((SEEDED, full), (stopped, by_token)):
        before = decode.counts()["reserved"]
        replies = _one_reply(decode, prompt, params, r.token_ids)
        assert [m.WhichOneof("kind") for m in replies] == ["finish"], replies
        f = replies[0].finish
        assert (f.finish_reason, f.matched_token_id, f.prompt_tokens, f.completion_tokens) == \
            (r.finish.finish_reason, r.finish.matched_token_id, len(prompt), len(r.token_ids))
        assert decode.counts()["reserved"] == before and decode.core.pool.num_free == decode.core.pool.num_pages
    wait_idle(decode, prefill)


def test_refused_resumes_leave_nothing_behind(decode, prefill, chs, prompt):
    plain = _stream(chs, "ref-plain", prompt, GREEDY).token_ids
    stopped = replace(GREEDY, stop_token_ids=(plain[5],))
    cases = [
        (stopped, plain[:8], "end the request"),                        # a stop before the last token
        (replace(GREEDY, max_tokens=4), plain[:5], "max_tokens"),       # more tokens than max_tokens
        (replace(GREEDY, seed=None), plain[:3], "seed"),                # no seed to continue with
        (GREEDY, [*plain[:2], 10**6], "generated token 2"),            # not a token id
    ]
    for params, generated, words in cases:
        replies = _one_reply(decode, prompt, params, generated)
        assert [m.WhichOneof("kind") for m in replies] == ["error"], replies
        assert replies[0].error.code == "INVALID_REQUEST" and words in replies[0].error.message
    # prefill refuses tokens that leave nothing to sample
    reply = wpb_grpc.PrefillServiceStub(chs[1]).Prefill(generate_order(
        "p-ended", prompt, replace(GREEDY, max_tokens=3), plain[:3]).prefill_order(wpb.Reservation(
            transfer_id=b"t" * 16, transfer_endpoint=decode.transfer_endpoint, seed=5)).to_proto(), timeout=60)
    assert not reply.ok and reply.error.code == "INVALID_REQUEST"
    wait_idle(decode, prefill)


@pytest.mark.parametrize("moved", [1, -1], ids=["prompt-token-as-generated", "generated-token-as-prompt"])
def test_moving_the_prompt_generated_boundary_is_refused(decode, prefill, prompt, moved):
    """The transfer's digest binds the boundary: the same token ids with one more (or one less)
    of them called generated are another transfer (PROMPT_MISMATCH), and the request fails."""
    generated = _stream((channel(decode.address), channel(prefill.address)), "mv-plain", prompt, GREEDY).token_ids[:3]
    receiver = decode.receiver
    refused = receiver.refused["PROMPT_MISMATCH"]
    order = generate_order("moved", prompt, GREEDY, generated)
    call = wpb_grpc.DecodeServiceStub(channel(decode.address)).Generate(order.to_proto(), timeout=60)
    first = next(call)
    assert first.WhichOneof("kind") == "reservation"
    kv = [*prompt, *generated]
    cut = len(prompt) - moved
    reply = wpb_grpc.PrefillServiceStub(channel(prefill.address)).Prefill(
        replace(order, prompt_token_ids=tuple(kv[:cut]), generated_token_ids=tuple(kv[cut:]))
        .prefill_order(first.reservation).to_proto(), timeout=60)
    rest = list(call)
    assert not reply.ok and "PROMPT_MISMATCH" in reply.error.message, reply
    assert [m.WhichOneof("kind") for m in rest] == ["error"], rest
    assert rest[0].error.code == "TRANSFER_FAILED" and receiver.refused["PROMPT_MISMATCH"] == refused + 1
    wait_idle(decode, prefill)


def test_a_colocated_worker_resumes_too(prompt):
    worker = start_colocated_worker(config())
    try:
        ch = (channel(worker.address), None)
        full = _stream(ch, "co-full", prompt, SEEDED)
        for k in (1, 10):
            assert_continues(full, k, _stream(ch, f"co{k}", prompt, SEEDED, full.token_ids[:k]))
        wait_idle(worker)
    finally:
        worker.stop()


def test_the_generator_of_n_tokens_is_past_n_sampler_draws():
    g = torch.Generator().manual_seed(77)
    for _ in range(40):
        torch.rand((), generator=g)
    assert torch.rand((), generator=g).item() == torch.rand((), generator=request_generator(77, 40)).item()


def test_the_transfer_digest_binds_the_boundary():
    ids = [5, 6, 7, 8]
    assert prompt_digest(ids, 0) == prompt_digest(ids)                  # unchanged without generated tokens
    digests = {prompt_digest(ids, g) for g in range(5)} | {prompt_digest([*ids, 0, 0], 0)}
    assert len(digests) == 6
    with pytest.raises(ValueError):
        prompt_digest(ids, 5)
