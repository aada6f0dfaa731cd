"""The compiled decode step (engine/compiled) on the shipped model: batch buckets and padding,
compiled tokens and logprobs equal to eager, batch invariance across buckets, the eager fallback
past the largest bucket, grammar-constrained rows as in eager, one graph with no break when every
expert is resident, paged experts bit-identical to all-resident under compilation (padding rows
route, page and count nothing), and the scratch page that padding rows write (buckets without
compiling: test_compiled_buckets)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from engine.compiled.buckets import bucket_for, pad_rows
from engine.compiled.step import GATHERED, MIN_PAGES, CompiledDecode, recompile_budget
from engine.constraint import Constraint
from engine.experts import EmulatedLink
from engine.forward_batch import build_batch
from engine.kv_pool import PagePool
from engine.moe import ResidentExperts
from tests.kv_helpers import assert_engines_idle
from tests.test_batching import MIXED
from tests.test_paged_experts import small_layer
from tests.test_parity_hf import PROMPTS

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5)
# compiled and eager sum the same fp32 products in different orders (inductor's C++ kernels, aten's
# on the CPU at hand): the largest difference measured was under 1e-5 on an Intel CPU and 1.05e-5
# on an AMD EPYC, where a 1e-5 bound failed; tokens must still be equal
LOGPROB_TOLERANCE = 1e-4
Run = Callable[[list[list[int]], list[int], list[list[int]]], torch.Tensor]

_ENGINES: list[LLM] = []   # this module's engines: idle and intact after every test (I6)


def _engine(**kw: object) -> LLM:
    settings: dict = {"max_num_seqs": 8, "enable_prefix_cache": False, **kw}
    llm = LLM(**settings)
    _ENGINES.append(llm)
    return llm


@pytest.fixture(autouse=True)
def engines_idle_and_intact() -> Iterator[None]:
    """I6 for this module's engines (conftest's check covers the session's)."""
    yield
    assert_engines_idle(_ENGINES)


@pytest.fixture(scope="module")
def eager() -> LLM:
    return _engine(compile=False)


@pytest.fixture(scope="module")
def compiled() -> LLM:
    """Buckets 1 and 4 of at most 8 requests: 2-4 rows run padded to 4, 5-8 run eager."""
    return _engine(compile=True, compile_buckets=[1, 4])


@pytest.fixture(scope="module")
def reference(eager: LLM) -> list:
    """Eager greedy output of the parity prompts, all in one batch."""
    return eager.generate(PROMPTS, GREEDY)


def step_of(llm: LLM) -> CompiledDecode:
    step = llm.core.runner.compiled
    assert step is not None
    return step


# ---- compiled == eager -----------------------------------------------------------------------

def assert_same(got: list, want: list) -> float:
    """Same greedy tokens, logprobs within LOGPROB_TOLERANCE; returns the largest difference."""
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids, f"tokens differ for {a.prompt!r}"
        for step, (x, y) in enumerate(zip(a.logprobs, b.logprobs, strict=True)):
            assert x.keys() == y.keys(), f"{a.prompt!r} step {step}: top logprobs differ"
            for t in x:
                worst = max(worst, abs(x[t] - y[t]))
                assert abs(x[t] - y[t]) <= LOGPROB_TOLERANCE, f"{a.prompt!r} step {step} token {t}"
    return worst


def test_compiled_greedy_equals_eager_alone_and_padded(compiled: LLM, reference: list) -> None:
    alone = [compiled.generate([p], GREEDY)[0] for p in PROMPTS]                # bucket 1
    groups = [PROMPTS[i:i + 3] for i in range(0, len(PROMPTS), 3)]              # 3, 3, 2 rows: bucket 4
    padded = [o for g in groups for o in compiled.generate(g, GREEDY)]
    worst = max(assert_same(alone, reference), assert_same(padded, reference))
    print(f"\nlargest logprob difference compiled - eager: {worst:.1e}")


def test_seeded_sampling_draws_the_same_tokens(compiled: LLM, eager: LLM) -> None:
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=s) for s in (1, 2, 3)]
    prompts = MIXED[:3]
    want = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in compiled.generate(prompts, params)] == want
    assert [compiled.generate([p], q)[0].token_ids for p, q in zip(prompts, params)] == want


def test_constrained_rows_decode_as_in_eager(compiled: LLM, eager: LLM) -> None:
    """Grammar masks run on the compiled step's logits (outside the graph): guided rows, one
    wanting logprobs (the mask goes into a copy) and the others not (in place, on the graph's
    output), next to a plain row, give eager's tokens and logprobs, alone (bucket 1) and
    padded together (bucket 4); every constrained output keeps its grammar."""
    schema = {"type": "object", "additionalProperties": False, "required": ["n", "ok"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}}
    json_c, choice_c = Constraint.json_schema(schema), Constraint.choice(["alpha", "beta", "gamma"])
    params = [SamplingParams(max_tokens=24, temperature=0, constraint=json_c, logprobs=3),
              SamplingParams(max_tokens=24, temperature=0.8, seed=5, constraint=json_c),
              SamplingParams(max_tokens=24, temperature=0, constraint=choice_c),
              SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)]
    prompts = MIXED[:4]
    want = eager.generate(prompts, params)
    for got in (compiled.generate(prompts, params),
                [compiled.generate([p], q)[0] for p, q in zip(prompts, params)]):
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert_same(got[:1], want[:1])
    for o in want[:2]:
        assert o.finish_reason == "stop", (o.finish_reason, o.text)
        jsonschema.validate(json.loads(o.text), schema)
    assert want[2].text in ("alpha", "beta", "gamma")


def test_a_requests_tokens_do_not_depend_on_its_bucket(compiled: LLM) -> None:
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    me = MIXED[0]
    alone = compiled.generate([me], params)[0].token_ids            # bucket 1
    for others in (MIXED[1:2], MIXED[1:3], MIXED[4:7]):             # 2, 3, 4 rows: bucket 4
        assert compiled.generate([me, *others], params)[0].token_ids == alone, f"with {len(others)} others"


def test_compiled_path_runs_and_larger_batches_fall_back_to_eager(compiled: LLM, eager: LLM) -> None:
    step = step_of(compiled)
    assert step.buckets == (1, 4) and step.compiled == {1, 4}   # both compiled at start-up
    rows: list[int] = []
    real_run = step.run

    def spy(tokens: list[list[int]], *args: object, **kw: object) -> torch.Tensor:
        rows.append(len(tokens))
        return real_run(tokens, *args, **kw)  # type: ignore[arg-type]
    step.run = spy  # type: ignore[method-assign]
    try:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        assert [o.token_ids for o in compiled.generate(MIXED[:3], params)] == \
               [o.token_ids for o in eager.generate(MIXED[:3], params)]
        assert rows and set(rows) == {3}, "3 decoding requests did not run compiled"
        rows.clear()
        many = [*MIXED, "y = "]   # 9 prompts, 8 at a time: decode steps of 8 and of 1 row
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        assert [o.token_ids for o in compiled.generate(many, params)] == \
               [o.token_ids for o in eager.generate(many, params)]
        assert rows and max(rows) <= 4, "a batch past the largest bucket ran compiled"
    finally:
        del step.run
    with pytest.raises(ValueError, match="5 requests exceeds the largest compiled bucket 4"):
        step.run([[1]] * 5, [0] * 5, [[0]] * 5)


def test_a_step_runs_the_compiled_graph(compiled: LLM) -> None:
    """Not a silent eager fallback (dynamo past its recompile limit runs the Python function)."""
    step = step_of(compiled)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        decode(step.run, compiled.pool, [[5, 6]])
    assert any(e.name.startswith("Torch-Compiled Region") for e in prof.events())


# ---- direct decode steps ----------------------------------------------------------------------

def decode(run: Run, pool: PagePool, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Feed each prompt token by token through decode steps of `run` (one row per request still
    feeding), on pages of `pool` allocated here and freed after.  Returns each step's logits."""
    ids = [f"direct-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        pool.allocate(rid, pool.pages_for(len(p)))
    out = []
    try:
        for pos in range(max(map(len, prompts))):
            live = [i for i, p in enumerate(prompts) if pos < len(p)]
            with torch.inference_mode():
                logits = run([[prompts[i][pos]] for i in live], [pos] * len(live),
                             [pool.page_table(ids[i]) for i in live])
            out.append(logits.clone())
    finally:
        for rid in ids:
            pool.free(rid)
    return out


def eager_run(llm: LLM) -> Run:
    def run(tokens: list[list[int]], starts: list[int], tables: list[list[int]]) -> torch.Tensor:
        fb = build_batch(tokens, starts, tables, llm.pool.page_size, llm.pool.kv.device)
        return llm.model.logits(llm.model.forward(fb, llm.pool.kv))
    return run


# prompts of at least 9 tokens: fed token by token, every request stays in the batch to the end
LONG = [MIXED[3], MIXED[4], MIXED[7], PROMPTS[2], PROMPTS[3], PROMPTS[5]]


def ids(llm: LLM, texts: list[str], n: int) -> list[list[int]]:
    """The first `n` token ids of each text (each has that many)."""
    out = [llm.tokenizer.encode(t)[:n] for t in texts]
    assert all(len(p) == n for p in out)
    return out


def test_padding_never_changes_a_rows_logits(compiled: LLM) -> None:
    """Within bucket 4, a request's logits are bit-identical whether the other rows are
    padding or other requests, and equal eager's within the logprob tolerance."""
    step = step_of(compiled)
    me, others = ids(compiled, LONG[:1], 9), ids(compiled, LONG[1:4], 9)   # one page each
    scratch = compiled.pool.scratch_page

    def padded(t: list[list[int]], s: list[int], tb: list[list[int]]) -> torch.Tensor:
        return step.run(t + [[0]], s + [0], tb + [[scratch]])[:1]   # me and 3 padding rows
    alone = decode(padded, compiled.pool, me)
    for company in (others[:1], others[:2], others[:3]):   # 2, 3, 4 rows
        together = decode(step.run, compiled.pool, me + company)
        for a, b in zip(alone, together, strict=True):
            assert torch.equal(a[0], b[0]), \
                f"with {len(company)} other requests: {(a[0] - b[0]).abs().max().item():.2e} apart"
    plain = decode(eager_run(compiled), compiled.pool, me)
    assert all(torch.allclose(a, b, atol=1e-4, rtol=0) for a, b in zip(alone, plain, strict=True))


def test_padding_rows_write_only_the_scratch_page(compiled: LLM) -> None:
    step, pool = step_of(compiled), compiled.pool
    scratch = pool.scratch_page
    a = pool.allocate("owner-of-the-rest", pool.num_free - 2)   # every page but two is someone's
    try:
        b, c = pool.allocate("b", 1)[0], pool.allocate("c", 1)[0]
        with torch.inference_mode():
            pool.kv[:, :, scratch] = 0
            before = pool.kv.clone()
            step.run([[7], [8]], [0, 0], [[b], [c]])   # 2 rows padded to bucket 4
        after = pool.kv
        assert after[:, :, scratch].abs().sum() > 0, "the padding rows wrote no scratch page"
        assert torch.equal(after[:, :, a], before[:, :, a]), "a padding row wrote a request's page"
        for page in (b, c):   # each request wrote its own position 0, nothing else of its page
            assert torch.equal(after[:, :, page, 1:], before[:, :, page, 1:])
            assert not torch.equal(after[:, :, page, 0], before[:, :, page, 0])
        pool.check_integrity()
    finally:
        for rid in ("owner-of-the-rest", "b", "c"):
            pool.free(rid)


# ---- paged experts under compilation ---------------------------------------------------------

STEPS = 7   # decode steps of 3 requests: 3 * top-4 = up to 12 experts a layer, 3 rows in bucket 4


@pytest.fixture(scope="module")
def paged_prompts(compiled: LLM) -> list[list[int]]:
    return ids(compiled, LONG[3:6], STEPS)


@pytest.fixture(scope="module")
def resident_logits(compiled: LLM, paged_prompts: list[list[int]]) -> list[torch.Tensor]:
    return decode(step_of(compiled).run, compiled.pool, paged_prompts)


@pytest.fixture(scope="module")
def paged() -> Callable[[int], LLM]:
    """The compiled engine with K resident experts (bucket 4 only), made once per K."""
    made: dict[int, LLM] = {}

    def get(k: int) -> LLM:
        if k not in made:
            made[k] = _engine(compile=True, compile_buckets=[4], max_num_seqs=4, paged_experts_num_resident=k)
        return made[k]
    return get


@pytest.mark.parametrize("k", [16, 64, 4])   # 4 with 3 requests of top-4: waves
def test_paged_experts_are_bit_identical_to_all_resident(k: int, paged: Callable[[int], LLM],
                                                         paged_prompts: list[list[int]],
                                                         resident_logits: list[torch.Tensor]) -> None:
    step = step_of(paged(k))
    assert not step.fullgraph and len(step.paged) == 6
    assert step.on_device(4) == (k >= 16), "bucket 4 of top-4 decides on the device when 16 experts fit"
    got = decode(step.run, paged(k).pool, paged_prompts)
    for i, (a, b) in enumerate(zip(got, resident_logits, strict=True)):
        assert torch.equal(a, b), f"K={k} step {i}: max difference {(a - b).abs().max().item():.2e}"
    counters = [e.counters for e in step.paged]
    assert all(c.steps >= STEPS for c in counters)
    if k == 4:
        assert all(c.waves > c.steps for c in counters), "K=4 never ran in waves"
    if k < 64:
        assert all(c.misses > 0 for c in counters)


def test_padding_rows_route_page_and_count_nothing(paged: Callable[[int], LLM]) -> None:
    paged16 = paged(16)
    step = step_of(paged16)

    def state() -> list:
        return [(e.counters.hits, e.counters.misses, list(e.slots.expert_in), e.slots.policy.order())  # type: ignore[attr-defined]
                for e in step.paged]
    before = state()
    with torch.inference_mode():
        step.run([[0]] * 4, [0] * 4, [[paged16.pool.scratch_page]] * 4, real=0)   # padding rows only
    assert state() == before


def test_expert_counters_count_real_rows_only(paged: Callable[[int], LLM],
                                              paged_prompts: list[list[int]]) -> None:
    """hits + misses (the experts a step needs) of compiled steps with padding rows equal those
    of the same steps run eagerly."""
    paged16 = paged(16)
    step = step_of(paged16)

    def needed() -> list[int]:
        return [e.counters.hits + e.counters.misses for e in step.paged]

    def counted(run: Run) -> list[int]:
        start = needed()
        decode(run, paged16.pool, paged_prompts)
        return [b - a for a, b in zip(start, needed())]
    compiled_counts = counted(step.run)
    assert compiled_counts == counted(eager_run(paged16))
    assert all(n >= STEPS * 4 for n in compiled_counts)   # at least top-4 experts a step


def test_padding_rows_of_a_step_in_waves_stay_finite(monkeypatch: pytest.MonkeyPatch) -> None:
    """A padding row's expert output reaches the scratch page's K/V, and from there every real
    row (its masked scratch keys weigh 0, but 0 * NaN is NaN): it must be finite even when the
    step runs in waves, whatever memory the step's buffers come from (poisoned here)."""
    layer, _ = small_layer(k=3)
    layer.rows, layer.plan = 1, GATHERED     # as a compiled step sets them: row 1 is padding
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])   # the real row needs 4 experts > K=3: waves
    x = torch.randn(2, 4)
    empty = torch.empty

    def poisoned(*args: object, **kw: object) -> torch.Tensor:
        t = empty(*args, **kw)  # type: ignore[call-overload]
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", poisoned)
    y = layer(x, ids)
    monkeypatch.undo()
    assert layer.counters.waves == 2
    assert torch.equal(y[0], ResidentExperts(layer.slots.store.w13, layer.slots.store.w2)(x, ids)[0])
    assert torch.isfinite(y[1]).all(), "a padding row's expert output is not finite"


# ---- one graph, no break ------------------------------------------------------------------

def explain_step(step: CompiledDecode, pool: PagePool, prompts: list[list[int]], on_device: bool = False) -> Any:
    """torch._dynamo.explain of the step's forward on the decode batch of `prompts` (each at
    its last position over freshly allocated pages), padded to its bucket as `run` pads it;
    `on_device`: the paged experts decide on the device, as `run` has them for such a bucket.
    (explain resets dynamo: compiled engines compile again at their next step.)"""
    names = [f"explain-{i}" for i in range(len(prompts))]
    tables = [pool.allocate(n, pool.pages_for(len(p))) for n, p in zip(names, prompts)]
    try:
        size = bucket_for(len(prompts), step.buckets)
        assert size is not None
        t, s, tb = pad_rows([[p[-1]] for p in prompts], [len(p) - 1 for p in prompts], tables, size,
                            pool.scratch_page)
        fb = build_batch(t, s, tb, pool.page_size, pool.kv.device, pad_page=pool.scratch_page,
                         min_pages=MIN_PAGES)
        live = torch.arange(size) < len(prompts) if on_device else None
        with torch.inference_mode(), step._paging(len(prompts), on_device):
            return torch._dynamo.explain(step._forward)(fb.input_ids, fb.positions, fb.slot_mapping,
                                                        fb.page_table, fb.seq_lens, pool.kv, live)
    finally:
        for n in names:
            pool.free(n)


def test_all_resident_step_is_one_graph_without_breaks(eager: LLM) -> None:
    step = CompiledDecode(eager.model, eager.pool, (1, 4))   # not warmed up: nothing compiled
    assert step.fullgraph
    prompts = [list(range(100, 100 + n)) for n in (1, 17, 40)]   # 3 rows padded to 4, 1-3 pages
    out = explain_step(step, eager.pool, prompts)
    assert (out.graph_count, out.graph_break_count) == (1, 0), out.break_reasons


def test_a_single_wave_paged_step_is_one_graph_without_breaks(paged: Callable[[int], LLM]) -> None:
    """K = 16 of 64 experts, top-4, bucket 4: the paging decision runs inside the graph."""
    llm = paged(16)
    step = CompiledDecode(llm.model, llm.pool, (1, 4))   # not warmed up: nothing compiled
    assert not step.fullgraph and step.on_device(4) and not step.on_device(8)
    prompts = [list(range(200, 200 + n)) for n in (3, 30)]   # 2 rows padded to 4
    before = [e.counters.hits + e.counters.misses for e in step.paged]
    out = explain_step(step, llm.pool, prompts, on_device=True)
    assert (out.graph_count, out.graph_break_count) == (1, 0), out.break_reasons
    looked = [e.counters.hits + e.counters.misses - b for e, b in zip(step.paged, before)]
    assert all(4 <= n <= 8 for n in looked), f"the traced step did not page its 2 rows: {looked}"


def test_what_the_device_plan_cannot_stand_for_keeps_the_host_plan(paged: Callable[[int], LLM]) -> None:
    """An emulated link (its timing is the host plan's), verify mode and plain offload
    (cache=False) each send the bucket back to the host plan."""
    step = step_of(paged(16))
    layer = step.paged[0]
    assert step.on_device(4)
    copier = layer.slots.copier
    layer.slots.copier = EmulatedLink(1e12)
    try:
        assert not step.on_device(4)
    finally:
        layer.slots.copier = copier
    for owner, name in ((layer.slots, "verify_on_use"), (layer, "cache")):
        old = getattr(owner, name)
        setattr(owner, name, not old)
        try:
            assert not step.on_device(4), name
        finally:
            setattr(owner, name, old)
    assert step.on_device(4)


def test_verify_mode_after_start_up_steps_without_compiling(paged_prompts: list[list[int]],
                                                             resident_logits: list[torch.Tensor]) -> None:
    """A worker turns verify mode on after its engine compiled, and steps from its loop's
    thread: the bucket that decided on the device runs the host plan's graphs, compiled at
    start-up too (dynamo would otherwise compile them mid-serving).  An engine of its own:
    `torch._dynamo.explain` (above) drops every compiled graph of the process."""
    llm = _engine(compile=True, compile_buckets=[4], max_num_seqs=4, paged_experts_num_resident=16)
    step = step_of(llm)
    assert step.modes(4) == (True, False)
    llm.verify_experts(True)
    got: list[torch.Tensor] = []
    compiled: list[int] = []

    def serve() -> None:
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        got.extend(decode(step.run, llm.pool, paged_prompts))
        compiled.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - before)

    try:
        assert not step.on_device(4)
        loop = threading.Thread(target=serve)
        loop.start()
        loop.join(timeout=300)
        assert not loop.is_alive(), "the steps did not end"
    finally:
        llm.verify_experts(False)
    assert compiled == [0], f"the host plan's graphs compiled while serving: {compiled}"
    assert len(got) == len(resident_logits)
    for i, (a, b) in enumerate(zip(got, resident_logits)):
        assert torch.equal(a, b), f"step {i}: max difference {(a - b).abs().max().item():.2e}"


def test_the_graph_budget_holds_in_every_thread(compiled: LLM) -> None:
    """dynamo's recompile limits are per-thread settings: the thread that steps an engine gets
    the budget the process's engines asked for, not dynamo's default."""
    limits: dict[str, int] = {}

    def step_thread() -> None:
        limits["default"] = torch._dynamo.config.recompile_limit
        recompile_budget()
        limits["applied"] = torch._dynamo.config.recompile_limit
        limits["accumulated"] = torch._dynamo.config.accumulated_recompile_limit

    loop = threading.Thread(target=step_thread)
    loop.start()
    loop.join(timeout=30)
    step = step_of(compiled)
    asked = len(step.buckets) * (len(step.parts) + 1)
    assert limits["applied"] >= limits["default"] + asked, limits
    assert limits["accumulated"] > limits["applied"], limits
