"""The sampling parameters' field list exists once (engine.params.SamplingParams): the proto
conversions and the gateway's request translation are derived from it, and checked here."""

from __future__ import annotations

from dataclasses import fields

import pytest

from engine.constraint import Constraint
from engine.errors import ErrorCode
from engine.params import SamplingParams
from gateway.errors import ForwardError
from gateway.protocol import PER_CHOICE, ChatCompletionRequest, CompletionRequest, _Common, sampling_params
from proto import worker_pb2 as wpb
from worker.convert import SPECIAL_FIELDS, params_from_proto, params_to_proto
from worker.types import WorkerError

PARAM_FIELDS = {f.name for f in fields(SamplingParams)}
PROTO_FIELDS = {f.name for f in wpb.SamplingParams.DESCRIPTOR.fields}

# Every field off its default.  temperature and top_p are proto `float` (32-bit): 0.5 and 0.75
# are exactly representable there, so the round trip can be compared with ==.
NON_DEFAULT = SamplingParams(max_tokens=40, temperature=0.5, top_p=0.75, top_k=7, seed=2**40 + 3,
                             stop=("\n\n", "def "), stop_token_ids=(0, 5), ignore_eos=True, logprobs=3,
                             min_tokens=2, stop_regex=(r"\d+:",), no_stop_trim=True,
                             constraint=Constraint.json_schema({"type": "integer"}, after="</think>"),
                             prompt_logprobs=2, logit_bias=((5, -1.5), (9, 100.0)))


def test_every_field_has_a_wire_spelling_and_every_wire_field_a_param():
    plain = PARAM_FIELDS - set(SPECIAL_FIELDS)
    assert set(SPECIAL_FIELDS) <= PARAM_FIELDS
    assert plain <= PROTO_FIELDS, f"SamplingParams fields with no proto field: {plain - PROTO_FIELDS}"
    special = {name for wire in SPECIAL_FIELDS.values() for name in wire.proto_fields}
    assert not plain & special
    assert PROTO_FIELDS == plain | special, f"proto fields no param covers: {PROTO_FIELDS - plain - special}"


def test_non_default_params_round_trip_exactly():
    assert all(getattr(NON_DEFAULT, f.name) != f.default for f in fields(SamplingParams))
    assert params_from_proto(params_to_proto(NON_DEFAULT)) == NON_DEFAULT


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(seed=0, logprobs=0),
                                    SamplingParams(temperature=0, top_k=0)])
def test_defaults_and_zero_values_round_trip(params):
    """seed=0 and logprobs=0 are values, not "unset" (has_seed, -1 carry the None)."""
    assert params_from_proto(params_to_proto(params)) == params


def test_wire_encoding_of_the_special_fields():
    wire = params_to_proto(SamplingParams())
    assert (wire.has_seed, wire.seed, wire.logprobs) == (False, 0, -1)
    wire = params_to_proto(SamplingParams(seed=9, logprobs=0))
    assert (wire.has_seed, wire.seed, wire.logprobs) == (True, 9, 0)


@pytest.mark.parametrize("wire", [wpb.SamplingParams(),                       # max_tokens 0
                                  wpb.SamplingParams(max_tokens=4, top_p=1, min_tokens=5),
                                  wpb.SamplingParams(max_tokens=4, top_p=1, logprobs=99),
                                  wpb.SamplingParams(max_tokens=4, top_p=1, stop_regex=["("])])
def test_invalid_params_from_the_wire_raise_invalid_request(wire):
    with pytest.raises(WorkerError) as e:
        params_from_proto(wire)
    assert e.value.code == ErrorCode.INVALID_REQUEST and e.value.message


def test_the_gateway_request_carries_every_param_field():
    """gateway.protocol.sampling_params reads each field from the request field of the same
    name, except the ones the gateway decides per choice."""
    assert set(PER_CHOICE) <= PARAM_FIELDS
    missing = PARAM_FIELDS - set(PER_CHOICE) - set(_Common.model_fields)
    assert not missing, f"SamplingParams fields the OpenAI request does not carry: {missing}"


def test_the_gateway_translates_a_request():
    req = CompletionRequest(model="m", prompt="x", temperature=0.5, top_p=0.75, top_k=7, stop="\n",
                            stop_token_ids=[0, 5], ignore_eos=True, logprobs=3, min_tokens=2,
                            stop_regex=r"\d+:", no_stop_trim=True)
    assert sampling_params(req, 40, 11) == SamplingParams(
        max_tokens=40, temperature=0.5, top_p=0.75, top_k=7, seed=11, stop=("\n",), stop_token_ids=(0, 5),
        ignore_eos=True, logprobs=3, min_tokens=2, stop_regex=(r"\d+:",), no_stop_trim=True)
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                 top_logprobs=2, stop=["a", "b"])
    assert sampling_params(chat, 8, None) == SamplingParams(max_tokens=8, logprobs=2, stop=("a", "b"))


def test_a_wire_error_code_becomes_an_error_code_and_an_unknown_one_does_not_crash():
    known = ForwardError.from_proto(wpb.Error(code="PROMPT_TOO_LONG", message="too long"))
    assert (known.code, known.status, known.message) == (ErrorCode.PROMPT_TOO_LONG, 400, "too long")
    unknown = ForwardError.from_proto(wpb.Error(code="FROM_A_NEWER_WORKER", message="m"), "prefill: ")
    assert (unknown.code, unknown.status) == (ErrorCode.INTERNAL, 502)
    assert unknown.message == "prefill: FROM_A_NEWER_WORKER: m"

