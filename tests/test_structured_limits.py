"""Every schema the gateway accepts compiles (issue 41): a schema whose recursion cannot end
passed the gateway's check (a matcher and its first mask) and failed in the worker at the
output's first token (`Too many items (limit 50000; ff_tokens)`, a 500).  The check now takes
the worker's first steps (engine/grammar_steps.py), also from every $ref target, under every one
of the workers' parser limits (which travel whole to the checker children): such a schema is a
400 naming the limit before any worker is called.  One that still meets a limit in a worker
ends as the constraint's fault (INVALID_REQUEST), never INTERNAL."""

from __future__ import annotations

import json
from dataclasses import replace

import llguidance
import pytest

from engine.config import SHIPPED_MODEL, ModelConfig
from engine.constraint import Constraint, GrammarCompiler, default_limits, grammar_text
from engine.grammar_check import CheckerPool, checker_for
from engine.grammar_steps import MAX_REF_WALKS, grammar_fault, limits_setup, ref_roots, ref_walks
from engine.params import SamplingParams
from engine.tokenizer import Tokenizer
from proto import worker_pb2_grpc as wpb_grpc
from tests.gateway_helpers import API_KEY, connection, fake_cluster
from tests.workers import channel, config, generate_order, start_decode, start_prefill, wait_idle

TOK = Tokenizer(SHIPPED_MODEL)
CFG = ModelConfig.from_path(SHIPPED_MODEL)
EOS = sorted(TOK.end_ids(CFG.eos_token_ids))
# every `{` forces `"a":{` again: the forced-bytes pass after the first token exceeds the item limit
REC = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
NEVER_ENDS = {
    "root": REC,
    "anyof": {"anyOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/a"},
                                                                 "minItems": 1}}},
    # the finding's shape: a harmless root, an optional property whose schema recurses without end
    "optional_def": {"type": "object", "properties": {
        "name": {"type": "string"}, "child": {"$ref": "#/$defs/node"}}, "required": ["name"],
        "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
                           "required": ["next"], "additionalProperties": False}}},
    "pointer": {"type": "object", "properties": {"x": {"type": "integer"}, "a": {
        "type": "object", "properties": {"b": {"$ref": "#/properties/a"}}, "required": ["b"]}}},
}
ENDS = {"optional_recursion": {"type": "object", "properties": {"a": {"$ref": "#"}}},
        "tree": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
            "type": "array", "items": {"$ref": "#"}}}, "required": ["v", "kids"]}}


def compiler(**kw: object) -> GrammarCompiler:
    return GrammarCompiler(TOK.backend.to_str(), CFG.vocab_size, EOS, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(NEVER_ENDS))
def test_a_schema_whose_recursion_cannot_end_is_refused_naming_the_limit(name: str) -> None:
    with pytest.raises(ValueError, match=r"step_max_items.*recursion that cannot end") as e:
        compiler().check(Constraint.json_schema(NEVER_ENDS[name]))
    assert str(default_limits().step_max_items) in str(e.value)


@pytest.mark.parametrize("name", sorted(ENDS))
def test_a_recursion_that_can_end_passes(name: str) -> None:
    """...and the in-process check (engine.LLM's, whose matcher is the request's) leaves the
    matcher at its start, where one built without the check is."""
    constraint = Constraint.json_schema(ENDS[name])
    checked = compiler().compile(constraint)
    fresh = compiler()._ready(constraint, grammar_text(constraint))
    assert checked.compute_ff_bytes() == fresh.compute_ff_bytes() and checked.compute_ff_bytes().startswith(b"{")
    assert checked.compute_bitmask() == fresh.compute_bitmask()


def test_what_the_check_refused_fails_in_the_workers_steps() -> None:
    """The refusal is not a guess: a request's matcher (built as a worker builds it, without
    the check) meets the limit at the first token, and `grammar_fault` calls it the grammar's."""
    c, rec = compiler(), Constraint.json_schema(REC)
    matcher = c._ready(rec, grammar_text(rec))
    assert not matcher.consume_token(TOK.encode("{")[0])
    assert "Too many items" in matcher.get_error() and grammar_fault(matcher)
    refused = c.compile(Constraint.choice(["yes", "no"]))
    assert not refused.consume_token(TOK.encode("maybe")[0]) and not grammar_fault(refused)


def test_the_walks_from_references_are_bounded_by_the_schemas_size() -> None:
    """Each walk from a $ref target compiles up to the whole schema: a large one is walked
    from fewer targets (the check stays within its budget), a small one from MAX_REF_WALKS."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"type": "string", "maxLength": 20},
                                                        "next": {"$ref": f"#/$defs/d{(i + 1) % 300}"}}}
            for i in range(300)}
    big = json.dumps({"$defs": defs, "$ref": "#/$defs/d0"})
    assert len(ref_roots(big)) == ref_walks(len(big)) < MAX_REF_WALKS
    assert len(ref_roots(json.dumps(NEVER_ENDS["optional_def"]))) == 1
    compiler().check(Constraint.json_schema(json.loads(big)))


def test_the_checker_children_run_under_every_limit_of_the_workers() -> None:
    assert checker_for(TOK.backend.to_str(), CFG.vocab_size, EOS, 5.0).setup["limits"] == \
        limits_setup(default_limits())
    tight = llguidance.LLParserLimits(max_grammar_size=10)            # not the lexer fuel, which alone travelled
    pool = CheckerPool(TOK.backend.to_str(), CFG.vocab_size, EOS, tight, processes=1, timeout_s=30)
    try:
        with pytest.raises(ValueError, match="grammar size .* too big"):
            pool(Constraint("grammar", "start: " + " ".join(f'"w{i}"' for i in range(50))))
    finally:
        pool.close()


def test_a_checker_child_walks_as_the_in_process_check_does() -> None:
    pool = checker_for(TOK.backend.to_str(), CFG.vocab_size, EOS, 30.0, processes=1)
    assert pool is not None
    try:
        with pytest.raises(ValueError, match="step_max_items"):
            compiler(checker=pool).check(Constraint.json_schema(REC))
    finally:
        pool.close()


def post(gw, body: dict) -> tuple[int, dict]:
    conn = connection(gw.url)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def test_the_gateway_answers_400_naming_the_limit_and_calls_no_worker() -> None:
    msg = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": NEVER_ENDS["optional_def"]}}
    bodies = [{"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": REC}}},
              {"tools": [tool], "tool_choice": "required"},
              {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}}]
    assert len(json.dumps({"model": "tiny-moe", "messages": msg, **bodies[0]})) < 292
    with fake_cluster() as (gw, decode):
        for extra in bodies:
            status, got = post(gw, {"model": "tiny-moe", "messages": msg, "max_tokens": 8, **extra})
            assert status == 400, got
            assert got["error"]["code"] == "invalid_constraint", got
            assert "step_max_items" in got["error"]["message"] and "50000" in got["error"]["message"], got
        assert decode.generated == []


def test_a_limit_met_in_a_decode_worker_is_the_constraints_fault() -> None:
    """A grammar whose first branch ends at once (the check walks it: lowest token ids) and whose
    other one, starting with the model's own first token, forces `(` forever: a prefill peer
    without the constraint commits that token, the decode worker's grammar takes it and meets
    the item limit at the next: INVALID_REQUEST (a 400 at the gateway), and every page back."""
    decode, prefill = start_decode(config(compile=False)), start_prefill(config(compile=False))
    try:
        ids = TOK.encode(TOK.apply_chat_template([{"role": "user", "content": "def add(a, b):"}]))
        free = SamplingParams(max_tokens=8, temperature=0, seed=7)
        first = _first_token(decode, prefill, ids, free)
        c = Constraint("grammar", f'start: "!" | {json.dumps(TOK.decode([first]))} r\nr: "(" r ")"')
        compiler().check(c)                                      # the check passes it
        constrained = replace(free, constraint=c)
        order = generate_order("deep", ids, constrained)
        call = wpb_grpc.DecodeServiceStub(channel(decode.address)).Generate(order.to_proto(), timeout=60)
        reservation = next(call)
        assert reservation.WhichOneof("kind") == "reservation", reservation
        wpb_grpc.PrefillServiceStub(channel(prefill.address)).Prefill(
            replace(order, params=free).prefill_order(reservation.reservation).to_proto(), timeout=60)
        rest = list(call)
        assert rest[-1].WhichOneof("kind") == "error", rest
        assert rest[-1].error.code == "INVALID_REQUEST", rest[-1]
        assert "Too many items" in rest[-1].error.message, rest[-1]
        wait_idle(decode, prefill)
    finally:
        decode.stop()
        prefill.stop()


def _first_token(decode, prefill, ids: list[int], params: SamplingParams) -> int:
    from tests.workers import run
    got = run(channel(decode.address), channel(prefill.address), "free", ids, params)
    assert got.error is None and got.token_ids, got
    return got.token_ids[0]
