"""Structured outputs across the prefill/decode split (issue 21): a constrained request gives
the same tokens in the single-process `LLM`, a colocated worker and a disaggregated prefill +
decode pair, greedy and seeded, and every output that ends with "stop" is valid; the grammar's
state crosses the transfer (a grammar that forbids the model's own first token makes prefill
pick another, and decode continues from that choice); a decode worker refuses a first token its
grammar rejects; a constraint the grammar engine cannot compile is refused before any page is
reserved; a migrated constrained request continues exactly."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import jsonschema
import pytest
import regex

from deploy.colocated import start_colocated_worker
from engine.constraint import Constraint, GrammarCompiler
from engine.grammar_check import CheckerPool
from engine.params import SamplingParams
from proto import worker_pb2 as wpb
from proto import worker_pb2_grpc as wpb_grpc
from tests.test_grammar_compiler import SLOW
from tests.workers import Result, channel, generate_order, module_worker, run, start_decode, start_prefill, wait_idle
from worker.convert import params_to_proto

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                               "minItems": 1, "maxItems": 3}, "ok": {"type": "boolean"}},
     "required": ["tags", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -10, "maximum": 10},
                                                   "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["x", "y"], "additionalProperties": False},
        "label": {"type": "string", "maxLength": 8}, "kind": {"enum": ["a", "b", 3]}},
     "required": ["point", "label", "kind"], "additionalProperties": False},
    {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                         "word": {"type": "string", "maxLength": 6}},
        "required": ["id", "word"], "additionalProperties": False}},
]
CHOICES = ["alpha beta", "gamma delta", "transfer", "migration"]
PATTERN = r"[a-f]{2,5}-[0-9]{1,3}"
LARK = 'start: "(" expr ")"\nexpr: NUM | NUM OP expr\nNUM: /[0-9]{1,3}/\nOP: "+" | "-" | "*"'
LARK_RE = r"\(([0-9]{1,3}[-+*])*[0-9]{1,3}\)"         # what LARK derives
CONSTRAINTS = [*(Constraint("json_schema", json.dumps(s)) for s in SCHEMAS),
               Constraint.choice(CHOICES), Constraint("regex", PATTERN), Constraint("grammar", LARK)]
GREEDY = SamplingParams(max_tokens=64, temperature=0, logprobs=2, seed=7)
SEEDED = SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95, logprobs=2, seed=1234)
MODES = {"greedy": GREEDY, "seeded": SEEDED}
CHATS = ["Give me a JSON object describing a user.", "def add(a, b):\n    return"]

decode = module_worker(start_decode)
prefill = module_worker(start_prefill)
colocated = module_worker(start_colocated_worker)


@pytest.fixture(scope="module")
def prompts(shipped_llm) -> list[list[int]]:
    tok = shipped_llm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in CHATS]


@pytest.fixture(scope="module")
def compiler(shipped_llm) -> GrammarCompiler:
    return GrammarCompiler(shipped_llm.tokenizer.backend.to_str(), shipped_llm.model_config.vocab_size,
                           sorted(shipped_llm.eos_ids))


def assert_valid(c: Constraint, text: str, finish: str) -> None:
    """An output that ends "stop" is valid for `c`; none may end by length (max_tokens is ample)."""
    assert finish == "stop", f"a {c.kind} output ended with {finish!r} (max_tokens too small?): {text!r}"
    if c.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(c.spec))
    elif c.kind == "choice":
        assert text in json.loads(c.spec), text
    else:
        assert regex.fullmatch(LARK_RE if c.kind == "grammar" else c.spec, text), (c.spec, text)


def assert_same(got: Result, want, label: str) -> None:
    assert got.error is None, (label, got.error)
    assert got.token_ids == want.token_ids, label
    assert got.text == want.text and got.finish.finish_reason == want.finish_reason, label
    assert got.finish.completion_tokens == len(want.token_ids), label
    # the same logprobs (raw, tests/test_structured_engine.py checks that) on every side of the
    # split.  The engine and the workers batch these requests differently, so the reduction
    # orders differ: measured up to 7.6e-6 for plain requests of varied lengths and 1.2e-5 for
    # these, hence 1e-4.
    assert len(got.logprobs) == len(want.logprobs), label
    for g, w in zip(got.logprobs, want.logprobs):
        assert g.keys() == w.keys() and all(abs(g[t] - w[t]) < 1e-4 for t in w), (label, g, w)


def workers_agree(shipped_llm, decode, prefill, colocated, prompts, cases: list[SamplingParams], tag: str):
    """Every (prompt, params) case in the LLM, the colocated worker and the disaggregated pair
    (all cases at once: guided and plain rows share batches): the same tokens and text
    everywhere; returns the LLM's outputs, one list per prompt."""
    wants = [shipped_llm.generate([ids] * len(cases), cases) for ids in prompts]
    places = {"colocated": (channel(colocated.address), None),
              "disaggregated": (channel(decode.address), channel(prefill.address))}
    jobs = [(i, j) for i in range(len(prompts)) for j in range(len(cases))]
    for place, chs in places.items():
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(lambda ij: run(*chs, f"{tag}-{place}-{ij[0]}-{ij[1]}", prompts[ij[0]],
                                               cases[ij[1]]), jobs))
        for (i, j), r in zip(jobs, got):
            assert_same(r, wants[i][j], f"{place}: prompt {i}, case {j}")
    wait_idle(decode, prefill, colocated)
    return wants


@pytest.mark.parametrize("mode", MODES)
def test_constrained_outputs_are_valid_and_identical_in_the_engine_colocated_and_disaggregated(
        shipped_llm, decode, prefill, colocated, prompts, mode):
    cases = [replace(MODES[mode], constraint=c) for c in CONSTRAINTS]
    cases.append(replace(MODES[mode], constraint=None, max_tokens=16))       # a plain row among them
    wants = workers_agree(shipped_llm, decode, prefill, colocated, prompts, cases, mode)
    for outs in wants:
        for c, out in zip(CONSTRAINTS, outs):
            assert_valid(c, out.text, out.finish_reason)


def first_allowed(compiler: GrammarCompiler, c: Constraint, token: int) -> bool:
    return compiler.compile(c).consume_token(token)


def test_the_grammar_state_crosses_the_transfer(shipped_llm, decode, prefill, colocated, prompts, compiler):
    """Grammars that forbid the model's own greedy first token X: prefill must pick another
    token, and decode must go on from the branch that token chose (each choice and the regex
    take several tokens)."""
    plain = shipped_llm.generate(prompts, replace(GREEDY, constraint=None))
    forced = [Constraint.choice(["gamma delta", "transfer", "migration"]),
              Constraint("regex", r"[0-9]{2,4}-[x-z]{1,3}"), Constraint.choice(["yes", "no"])]
    for ids, out in zip(prompts, plain):
        x = out.token_ids[0]
        assert not any(first_allowed(compiler, c, x) for c in forced), \
            f"the first token {x} ({shipped_llm.tokenizer.decode([x])!r}) is allowed: choose other grammars"
    cases = [replace(GREEDY, constraint=c) for c in forced]
    wants = workers_agree(shipped_llm, decode, prefill, colocated, prompts, cases, "forced")
    for outs, out in zip(wants, plain):
        for c, w in zip(forced, outs):
            assert w.token_ids[0] != out.token_ids[0]
            assert_valid(c, w.text, w.finish_reason)
    assert any(len(w.token_ids) > 2 for outs in wants for w in outs)     # decode really continued


def test_the_after_gate_crosses_the_transfer(shipped_llm, decode, prefill, colocated, prompts):
    """A constraint that starts after a marker the model writes itself: at its first token
    (the marker comes from prefill) and a few tokens in (the gate opens on the decode side);
    a migration just before, at and just after the marker replays the gate too."""
    tok = shipped_llm.tokenizer
    plain = shipped_llm.generate(prompts[:1], replace(GREEDY, constraint=None, max_tokens=8))[0].token_ids
    marks = [i for i, t in enumerate(plain) if tok.encode(tok.decode([t])) == [t] and t not in plain[:i]]
    at = sorted({marks[0], marks[-1]}) if marks else []
    assert at and at[-1] > 0, f"no single-token markers after the first token in {plain}"
    cases = [replace(GREEDY, constraint=Constraint.choice(CHOICES, after=tok.decode([plain[i]]))) for i in at]
    wants = workers_agree(shipped_llm, decode, prefill, colocated, prompts[:1], cases, "after")[0]
    for i, w in zip(at, wants):
        assert w.token_ids[:i + 1] == plain[:i + 1]                     # free up to the marker
        assert_valid(cases[0].constraint, tok.decode(w.token_ids[i + 1:]), w.finish_reason)
        assert w.text.endswith(tok.decode(w.token_ids[i + 1:]))
    i, w, params = at[-1], wants[-1], cases[-1]
    chs = (channel(decode.address), channel(prefill.address))
    for k in (i, i + 1, i + 2):
        resumed = run(*chs, f"after-{k}", prompts[0], params, generated=w.token_ids[:k])
        assert resumed.error is None and resumed.token_ids == w.token_ids[k:], (k, resumed)
    wait_idle(decode, prefill)


def test_a_decode_worker_refuses_a_first_token_its_grammar_rejects(shipped_llm, decode, prefill, prompts,
                                                                   compiler):
    """A prefill peer that ignores the constraint (it is sent the request without it) commits
    the model's own first token; the decode worker's grammar forbids it: an explicit error,
    the token is never streamed, every page comes back."""
    ids = prompts[1]
    constrained = replace(GREEDY, constraint=Constraint.choice(["yes", "no"]))
    x = shipped_llm.generate([ids], replace(GREEDY, constraint=None, max_tokens=1))[0].token_ids[0]
    assert not first_allowed(compiler, constrained.constraint, x)
    order = generate_order("liar", ids, constrained)
    call = wpb_grpc.DecodeServiceStub(channel(decode.address)).Generate(order.to_proto(), timeout=60)
    first = next(call)
    assert first.WhichOneof("kind") == "reservation", first
    wpb_grpc.PrefillServiceStub(channel(prefill.address)).Prefill(
        replace(order, params=replace(constrained, constraint=None)).prefill_order(first.reservation).to_proto(),
        timeout=60)
    rest = list(call)
    assert [m.WhichOneof("kind") for m in rest] == ["error"], rest
    assert rest[0].error.code != "INVALID_REQUEST", rest      # the client asked nothing wrong
    assert f"id {x}" in rest[0].error.message and "choice" in rest[0].error.message, rest
    wait_idle(decode, prefill)


DEEP = '{"type": "array", "items": ' * 40 + '{"type": "integer"}' + "}" * 40
BAD = [("regex", "a(b", "regex"), ("json_schema", '{"type": "nonsense"}', "nonsense"),
       ("grammar", "start: foo", "foo"), ("json_schema", DEEP, "levels"), ("choice", "[]", "non-empty"),
       ("xml", "<a/>", "kind")]


@pytest.mark.parametrize("kind, spec, words", BAD, ids=["regex", "schema", "grammar", "deep", "no-choice", "kind"])
def test_a_constraint_that_cannot_compile_is_refused_before_any_page(decode, prefill, colocated, prompts,
                                                                     kind, spec, words):
    """As a worker receives it (the wire carries any kind and spec): refused by name before
    any page is reserved or anything queued, on the decode, colocated and prefill workers."""
    refused_everywhere(decode, prefill, colocated, prompts, kind, spec, words)


def test_a_constraint_past_the_workers_check_budget_is_refused_before_any_page(decode, prefill, colocated,
                                                                               prompts):
    """A schema llguidance would compile for minutes is checked in a child process that each
    worker kills at its budget (here 1 s): refused by name, nothing reserved."""
    checkers = [h.core.grammars.checker for h in (decode, prefill, colocated)]
    assert all(isinstance(c, CheckerPool) for c in checkers)
    budgets = [c.timeout_s for c in checkers]
    try:
        for c in checkers:
            c.timeout_s = 1.0
        refused_everywhere(decode, prefill, colocated, prompts, SLOW.kind, SLOW.spec, "took longer than 1 s")
    finally:
        for c, b in zip(checkers, budgets):
            c.timeout_s = b
    assert [c.killed for c in checkers] == [1, 1, 1]


def refused_everywhere(decode, prefill, colocated, prompts, kind: str, spec: str, words: str) -> None:
    params = params_to_proto(GREEDY)
    params.constraint.CopyFrom(wpb.Constraint(kind=kind, spec=spec))
    for handle in (decode, colocated):
        free = handle.core.pool.num_free
        replies = list(wpb_grpc.DecodeServiceStub(channel(handle.address)).Generate(wpb.GenerateRequest(
            request_id=f"bad-{handle.role.value}", tenant="acme", prompt_token_ids=prompts[0],
            params=params, timeout_s=60), timeout=60))
        assert [m.WhichOneof("kind") for m in replies] == ["error"], replies
        assert replies[0].error.code == "INVALID_REQUEST" and words in replies[0].error.message, replies[0]
        assert handle.core.pool.num_free == free and not handle.core.scheduler.has_work()
    assert decode.roles[0].receiver.open_transfers == 0
    request = generate_order("bad-prefill", prompts[0], GREEDY).prefill_order(wpb.Reservation(
        transfer_id=b"t" * 16, transfer_endpoint=decode.transfer_endpoint, seed=7)).to_proto()
    request.params.constraint.CopyFrom(params.constraint)
    reply = wpb_grpc.PrefillServiceStub(channel(prefill.address)).Prefill(request, timeout=60)
    assert not reply.ok and reply.error.code == "INVALID_REQUEST" and words in reply.error.message, reply
    wait_idle(decode, prefill, colocated)


@pytest.mark.parametrize("mode", MODES)
def test_a_migrated_constrained_request_continues_exactly(shipped_llm, decode, prefill, colocated, prompts,
                                                          mode):
    """Resuming with `generated_token_ids` replays them into a fresh matcher: the continuation
    is the uninterrupted stream's, at a break after the first token, in the middle and one
    token before the end; tokens that already complete the grammar end the request at once."""
    c = Constraint("json_schema", json.dumps(SCHEMAS[2]))
    params = replace(MODES[mode], constraint=c)
    for chs in ((channel(decode.address), channel(prefill.address)), (channel(colocated.address), None)):
        full = run(*chs, f"mig-{mode}", prompts[0], params)
        assert full.error is None, full.error
        assert_valid(c, full.text, full.finish.finish_reason)
        n = len(full.token_ids)
        for k in sorted({1, n // 2, n - 1}):
            resumed = run(*chs, f"mig-{mode}-{k}", prompts[0], params, generated=full.token_ids[:k])
            assert resumed.error is None, resumed.error
            assert resumed.token_ids == full.token_ids[k:], k
            assert "".join(full.deltas[:k]) + resumed.text == full.text
            assert resumed.finish.finish_reason == "stop" and resumed.finish.completion_tokens == n
        ended = run(*chs, f"mig-{mode}-end", prompts[0], params, generated=full.token_ids)
        assert ended.error is None and ended.reservation is None and not ended.token_ids, ended
        assert ended.finish.finish_reason == "stop" and ended.finish.completion_tokens == n
    wait_idle(decode, prefill, colocated)


def test_generated_tokens_the_grammar_rejects_are_refused(shipped_llm, decode, prefill, prompts, compiler):
    """A resume whose generated tokens the grammar could not have produced fails closed."""
    c = Constraint.choice(["yes", "no"])
    x = shipped_llm.generate([prompts[1]], replace(GREEDY, constraint=None, max_tokens=1))[0].token_ids[0]
    assert not first_allowed(compiler, c, x)
    r = run(channel(decode.address), channel(prefill.address), "mig-bad", prompts[1],
            replace(GREEDY, constraint=c), generated=[x])
    assert not r.token_ids and r.reservation is None and r.error is not None, r     # nothing reserved
    assert r.error.code == "INVALID_REQUEST" and f"id {x}" in r.error.message, r.error
    wait_idle(decode, prefill)
