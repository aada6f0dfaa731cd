"""A transfer is bound to the tokens of the prompt it carries (I9, issue 15): a Prefill call
that names a victim's reservation (tenant, request id, transfer id) with another prompt of the
same length is refused by the decode worker on its first frame (PROMPT_MISMATCH), and the
victim's request ends with an explicit TRANSFER_FAILED error, never a completion of the other
prompt."""

from __future__ import annotations

from dataclasses import replace

from engine.params import SamplingParams
from proto import worker_pb2_grpc as wpb_grpc
from tests.workers import channel, generate_order, module_worker, run, start_decode, start_prefill, wait_idle

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


decode = module_worker(start_decode, max_model_len=1024)
prefill = module_worker(start_prefill)


def test_a_prefill_of_another_prompt_into_a_victims_reservation_fails_the_victim(decode, prefill, shipped_llm):
    victim_ids = shipped_llm.tokenizer.encode("def add(a, b):\n    return")
    attacker_ids = shipped_llm.tokenizer.encode("print(a, b)\n\n\n")[:len(victim_ids)]
    attacker_ids += victim_ids[len(attacker_ids):]          # another prompt, the same length
    assert len(attacker_ids) == len(victim_ids) and attacker_ids != victim_ids
    receiver = decode.roles[0].receiver
    refused = receiver.refused["PROMPT_MISMATCH"]

    victim = generate_order("victim", victim_ids, PARAMS)
    call = wpb_grpc.DecodeServiceStub(channel(decode.address)).Generate(victim.to_proto(), timeout=60)
    first = next(call)
    assert first.WhichOneof("kind") == "reservation"
    # the attacker's Prefill: the victim's tenant, request id and reservation, its own prompt
    reply = wpb_grpc.PrefillServiceStub(channel(prefill.address)).Prefill(
        replace(victim, prompt_token_ids=tuple(attacker_ids)).prefill_order(first.reservation).to_proto(), timeout=60)
    rest = list(call)

    assert not reply.ok and reply.error.code == "TRANSFER_FAILED", reply
    assert "PROMPT_MISMATCH" in reply.error.message
    assert [m.WhichOneof("kind") for m in rest] == ["error"], rest     # not one token streamed
    assert rest[0].error.code == "TRANSFER_FAILED" and "PROMPT_MISMATCH" in rest[0].error.message
    assert receiver.refused["PROMPT_MISMATCH"] == refused + 1
    wait_idle(decode, prefill)


def test_the_right_prompt_still_completes(decode, prefill, shipped_llm):
    ids = shipped_llm.tokenizer.encode("def add(a, b):\n    return")
    got = run(channel(decode.address), channel(prefill.address), "honest", ids, PARAMS)
    want = shipped_llm.generate([ids], PARAMS)[0]
    assert got.error is None and got.token_ids == want.token_ids
    wait_idle(decode, prefill)
