"""Structured outputs in the engine (issue 21): the grammar masks every generated token of the
single-process `LLM` (the workers run the same token path), refusals leave no state, a resumed
request replays its grammar exactly, and logprobs stay those of the raw model distribution.

The shipped model is tiny: quality is not the point, validity is.  Its schemas bound every
string (maxLength), and constraints generate compact JSON (no whitespace between tokens, the
default), so every completion ends within the max_tokens given here."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
import regex
import torch

from engine import LLM, SamplingParams
from engine.constraint import Constraint
from engine.errors import RequestError
from engine.guide import Guide
from engine.guided_mask import TokenMasker
from engine.request import RequestOutput, Status

PROMPTS = ["Write a person as JSON:", "def add(a, b):", "Hello", "1, 2, 3,"]
SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
               "properties": {"name": {"type": "string", "maxLength": 8},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120},
                              "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}},
    "nested": {"type": "object", "additionalProperties": False, "required": ["shape", "at"],
               "properties": {"shape": {"enum": ["circle", "square", "line"]},
                              "at": {"type": "object", "additionalProperties": False, "required": ["x", "ok"],
                                     "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1,
                                                          "multipleOf": 0.25},
                                                    "ok": {"type": "boolean"}}}}},
    "array": {"type": "array", "minItems": 1, "maxItems": 4,
              "items": {"type": "integer", "minimum": -5, "maximum": 50}},
    "optional": {"type": "object", "additionalProperties": False, "required": ["id"],
                 "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                "note": {"type": "string", "maxLength": 6},
                                "score": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5}}},
}
MODES = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=1.0, seed=7)}


def _params(constraint: Constraint, max_tokens: int = 64, mode: str = "greedy", **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, constraint=constraint, **MODES[mode], **kw)


def _all_stopped(outs: list[RequestOutput]) -> None:
    ended = [(o.prompt, o.finish_reason, o.text) for o in outs if o.finish_reason != "stop"]
    assert not ended, f"completions that did not end with 'stop' (a 'length' ran out of max_tokens): {ended}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_completions_validate(shipped_llm: LLM, name: str, mode: str):
    schema = SCHEMAS[name]
    outs = shipped_llm.generate(PROMPTS, _params(Constraint.json_schema(schema), 64, mode))
    _all_stopped(outs)
    for o in outs:
        jsonschema.validate(json.loads(o.text), SCHEMAS[name])
        assert o.matched_stop in (None, *shipped_llm.eos_ids)


@pytest.mark.parametrize("mode", MODES)
def test_regex_choice_and_grammar(shipped_llm: LLM, mode: str):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    outs = shipped_llm.generate(PROMPTS, _params(Constraint("regex", pattern), 24, mode))
    _all_stopped(outs)
    assert all(regex.fullmatch(pattern, o.text) for o in outs), [o.text for o in outs]

    choices = ["yes", "no", "maybe later"]
    outs = shipped_llm.generate(PROMPTS, _params(Constraint.choice(choices), 16, mode))
    _all_stopped(outs)
    assert all(o.text in choices for o in outs), [o.text for o in outs]

    lark = 'start: "(" num ("," num)? ")"\nnum: /[1-9][0-9]?/'
    outs = shipped_llm.generate(PROMPTS, _params(Constraint("grammar", lark), 24, mode))
    _all_stopped(outs)
    assert all(regex.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)?\)", o.text) for o in outs), [o.text for o in outs]


@pytest.mark.parametrize("mode", MODES)
def test_json_object_outputs_are_objects(shipped_llm: LLM, mode: str):
    """json_object leaves strings unbounded, so the tiny model often writes one until max_tokens:
    every output that stops is a JSON object, one that runs out is reported as 'length' with
    every token it was given (the prompt "{" makes it close the object at once)."""
    outs = shipped_llm.generate([*PROMPTS, "{"], _params(Constraint("json_object"), 48, mode))
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped, [(o.finish_reason, o.text) for o in outs]
    for o in stopped:
        assert isinstance(json.loads(o.text), dict), o.text
    assert all(o.finish_reason == "length" and len(o.token_ids) == 48 for o in outs if o not in stopped)


def test_complete_grammar_stops_without_eos(shipped_llm: LLM):
    """Once nothing but EOS may follow, the request ends with 'stop' (matched_stop None) without
    sampling EOS; also on the very token that reaches max_tokens."""
    constraint = Constraint.choice(["maybe later", "no"])
    out = shipped_llm.generate("Answer:", _params(constraint, 16))[0]
    assert out.finish_reason == "stop" and out.matched_stop is None
    assert not set(out.token_ids) & shipped_llm.eos_ids
    n = len(out.token_ids)
    exact = shipped_llm.generate("Answer:", _params(constraint, n))[0]
    assert (exact.finish_reason, exact.token_ids, exact.matched_stop) == ("stop", out.token_ids, None)


def test_the_mask_changes_the_first_token(shipped_llm: LLM):
    """A grammar that forbids the unconstrained greedy token forces another one (the first token
    of a prompt, sampled at the end of prefill, is masked like every other)."""
    free = shipped_llm.generate("Hello", _params(None, 1))[0]  # type: ignore[arg-type]
    first = shipped_llm.tokenizer.decode(free.token_ids)
    options = [w for w in ("alpha", "beta", "gamma") if not w.startswith(first) and not first.startswith(w[:1])]
    out = shipped_llm.generate("Hello", _params(Constraint.choice(options), 8))[0]
    assert out.token_ids[0] != free.token_ids[0] and out.text in options


def test_after_gate(shipped_llm: LLM):
    """Free output until the generated ids end with the marker's ids, the grammar after them."""
    free = shipped_llm.generate("def add(a, b):", _params(None, 6))[0]  # type: ignore[arg-type]
    tok = shipped_llm.tokenizer
    marker = tok.decode(free.token_ids[1:3])
    assert tok.encode(marker) == free.token_ids[1:3], "pick a marker that encodes back to its ids"
    out = shipped_llm.generate("def add(a, b):", _params(Constraint("regex", r"[a-c]{2}!", after=marker), 16))[0]
    assert out.token_ids[:3] == free.token_ids[:3]             # free up to and including the marker
    assert out.finish_reason == "stop" and regex.fullmatch(r"[a-c]{2}!", tok.decode(out.token_ids[3:]))


def test_guide_gate_waits_for_the_whole_marker():
    class Matcher:
        consumed: list[int] = []

        def consume_token(self, t: int) -> bool:
            self.consumed.append(t)
            return True
    m = Matcher()
    guide = Guide(m, "regex", gate=[5, 6])  # type: ignore[arg-type]
    for t in (5, 5, 7, 5):
        assert guide.accept(t) and not guide.active and not guide.masks
    assert guide.accept(6) and guide.active and guide.masks
    assert guide.accept(9) and m.consumed == [9]


def test_an_output_that_ends_before_its_gate_opens_is_an_error(shipped_llm: LLM):
    """A request whose reasoning never ended (the marker was not generated) ends with an error,
    never as an unconstrained "stop"; a stop after the marker is as before."""
    from engine.stop import StopChecker
    eos = min(shipped_llm.eos_ids)
    params = _params(Constraint("regex", "a+", after="x"), 16)
    for tokens, reason in (([7, eos], "error"), ([5, 6, eos], "stop")):
        guide = Guide(shipped_llm.core.grammars.compile(Constraint("regex", "(a|b|c)*")), "regex", gate=[5, 6])
        stopper = StopChecker(params, shipped_llm.tokenizer, shipped_llm.eos_ids, 512, guide=guide)
        got = [stopper.append(t, 10 + i) for i, t in enumerate(tokens)]
        assert got[-1] == reason and got[:-1] == [None] * (len(tokens) - 1)
    assert stopper.error is None
    guide = Guide(shipped_llm.core.grammars.compile(Constraint("regex", "(a|b|c)*")), "regex", gate=[5, 6])
    stopper = StopChecker(params, shipped_llm.tokenizer, shipped_llm.eos_ids, 512, guide=guide)
    assert stopper.append(eos, 10) == "error" and "never applied" in (stopper.error or "")


@pytest.mark.parametrize("kind,spec,words", [
    ("json_schema", json.dumps({"type": "wobble"}), "JSON schema"),
    ("regex", "a(b", "regex"),
    ("grammar", "start: missing_rule", "grammar"),
])
def test_bad_constraint_refused_before_anything(shipped_llm: LLM, kind: str, spec: str, words: str):
    free = shipped_llm.pool.num_free
    bad = _params(Constraint(kind, spec))
    with pytest.raises(RequestError, match=words) as err:
        shipped_llm.generate(["Hello", "World"], [_params(None), bad])  # type: ignore[arg-type]
    assert err.value.code == "INVALID_REQUEST"
    with pytest.raises(RequestError, match=words):
        shipped_llm.core.make_request([1, 2, 3], bad, handoff=True)
    assert shipped_llm.pool.num_free == free and not shipped_llm.scheduler.has_work()


@pytest.mark.parametrize("mode", MODES)
def test_resume_replays_the_grammar(shipped_llm: LLM, mode: str):
    """A request resumed with the tokens it generated (a migration) continues exactly."""
    params = _params(Constraint.json_schema(SCHEMAS["person"]), 48, mode)
    full = shipped_llm.generate("Hello", params)[0]
    assert full.finish_reason == "stop"
    prompt = shipped_llm.tokenizer.encode("Hello")
    core = shipped_llm.core
    for k in (1, len(full.token_ids) // 2):
        req = core.make_request(prompt, params, generated=full.token_ids[:k])
        assert req.guide is not None and req.guide.consumed == k
        core.add(req)
        while shipped_llm.scheduler.has_work():
            shipped_llm.step()
        assert req.output_token_ids == full.token_ids[k:] and req.finish_reason == "stop"
    done = core.make_request(prompt, params, generated=full.token_ids)      # already complete
    assert done.status == Status.FINISHED and done.finish_reason == "stop"


def test_generated_tokens_the_grammar_refuses(shipped_llm: LLM):
    params = _params(Constraint.choice(["yes", "no"]), 8)
    bad = shipped_llm.tokenizer.encode("zzz")
    for handoff in (False, True):
        with pytest.raises(RequestError, match="not allowed by the request's choice constraint"):
            shipped_llm.core.make_request([1, 2, 3], params, generated=bad, handoff=handoff)


def test_refused_first_token_ends_with_error_and_frees(shipped_llm: LLM):
    """A first token that came with a KV transfer and that the grammar refuses ends the request
    with an explicit error (never decoded on); its pages go back to the pool."""
    core, pool = shipped_llm.core, shipped_llm.pool
    free = pool.num_free
    req = core.make_request([5, 6, 7], _params(Constraint.choice(["yes", "no"]), 8), salt=b"h1-refused-first")
    core.allocate_for(req, req.max_total_tokens)
    pool.mark_tokens_written(req.request_id, 0, 3)
    event = core.add_prefilled(req, shipped_llm.tokenizer.encode("zzz")[0], None)
    assert event.finish_reason == "error" and "not allowed" in (req.stopper.error or "")
    assert pool.num_free == free and not shipped_llm.scheduler.has_work()


def test_logprobs_are_the_raw_distribution(shipped_llm: LLM):
    """Under a grammar the logprobs (chosen token and top N) are the model's, before the mask:
    the same as an unconstrained request over the same prefix (another kernel path: 1e-5)."""
    prompt = shipped_llm.tokenizer.encode("Hello")
    out = shipped_llm.generate(prompt, _params(Constraint("regex", r"[x-z]{4}"), 8, logprobs=5))[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    masked_out_mass = 0.0
    for k in range(len(out.token_ids)):
        ref = shipped_llm.generate(prompt + out.token_ids[:k], _params(None, 1, logprobs=5))[0]  # type: ignore[arg-type]
        ref_top = ref.logprobs[0] if ref.logprobs else {}
        for token, lp in out.logprobs[k].items():
            if token in ref_top:
                assert lp == pytest.approx(ref_top[token], abs=1e-5)
        masked_out_mass += sum(math.exp(v) for t, v in ref_top.items() if t != out.token_ids[k])
        assert set(ref_top) - {ref.token_ids[0]} <= set(out.logprobs[k])   # the raw top 5 are listed
    assert masked_out_mass > 0.5      # the top tokens the grammar forbade kept their probabilities


def test_masker_applies_bits_to_guided_rows_only(shipped_llm: LLM):
    guide = shipped_llm.core.guide(Constraint.choice(["yes", "no"]))
    assert guide is not None
    masker = TokenMasker(shipped_llm.model_config.vocab_size, "cpu")
    logits = torch.randn(3, shipped_llm.model_config.vocab_size)
    masked = masker.apply(logits, [None, guide, None])
    assert masked is not None and torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    allowed = set(torch.isfinite(masked[1]).nonzero().flatten().tolist())
    tok = shipped_llm.tokenizer
    assert allowed and all("yes".startswith(tok.decode([t])) or "no".startswith(tok.decode([t])) for t in allowed)
    assert {tok.encode("yes")[0], tok.encode("no")[0]} <= allowed
    assert masker.work.rows == 1 and masker.apply(logits, [None, None, None]) is None
    more = [shipped_llm.core.guide(Constraint.choice(["yes", "no"])) for _ in range(3)]
    batch = masker.apply(logits, more)                              # several rows: the executor
    assert batch is not None and all(set(torch.isfinite(r).nonzero().flatten().tolist()) == allowed for r in batch)
    raw = logits.clone()
    inplace = masker.apply(logits, [None, guide, None], copy=False)    # no logprobs wanted: no copy
    assert inplace is logits and torch.equal(inplace, masked) and not torch.equal(raw, logits)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_mask_and_outputs(shipped_llm: LLM):
    """On the device: the pinned, non-blocking mask equals the CPU one bit for bit (in place and
    copied, one row and several), and constrained outputs of an engine on the device validate."""
    vocab = shipped_llm.model_config.vocab_size
    guides = [shipped_llm.core.guide(Constraint("regex", r"[a-f]{2,5}")) for _ in range(4)]
    cpu, cuda = TokenMasker(vocab, "cpu"), TokenMasker(vocab, "cuda")
    logits = torch.randn(5, vocab)
    for rows in ([None, guides[0], None, None, None], [guides[0], None, *guides[1:]]):
        want = cpu.apply(logits, rows)
        assert want is not None
        for copy in (True, False):
            on_device = logits.to("cuda")
            got = cuda.apply(on_device, rows, copy=copy)
            assert got is not None and torch.equal(got.cpu(), want) and (got is on_device) != copy
    llm = LLM(device="cuda")
    schema = SCHEMAS["person"]
    for mode in MODES:
        outs = llm.generate(PROMPTS, _params(Constraint.json_schema(schema), 64, mode, logprobs=2))
        _all_stopped(outs)
        for o in outs:
            jsonschema.validate(json.loads(o.text), SCHEMAS["person"])
    assert llm.core.mask_work.rows > 0


@pytest.mark.parametrize("mode", MODES)
def test_min_tokens_yields_to_a_grammar_that_can_only_end(shipped_llm: LLM, mode: str):
    """min_tokens bans EOS, unless EOS is all the grammar allows (a row with nothing left to
    sample drew a token the grammar refuses); where the grammar allows more, it still holds."""
    empty = shipped_llm.generate("Hello", _params(Constraint("grammar", 'start: ""'), 8, mode, min_tokens=2))[0]
    assert empty.finish_reason == "stop" and empty.text == "" and set(empty.token_ids) <= shipped_llm.eos_ids
    more = shipped_llm.generate("Hello", _params(Constraint("regex", "(abc)?"), 8, mode, min_tokens=2))[0]
    assert more.finish_reason == "stop" and more.text == "abc" and len(more.token_ids) >= 2
