"""The compiled decode step on CUDA (engine/compiled/cuda_graphs.py): each batch bucket captured
as CUDA graphs.  The CUDA tests (`pytest -m cuda`, run by `bench.gpu_check`'s cuda_tests step)
skip without a device: greedy tokens equal to eager CUDA, logprobs within 1e-5, no host
synchronisation in a step with every expert resident or with paged experts deciding on the
device, paged experts bit-identical to resident (at most one synchronisation per MoE layer in a
bucket the host plans), batch invariance.  The tests without the mark
run on a CPU: the host side of a step (staging a batch into a bucket's rows) and the decode
attention's custom op, opaque to dynamo.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.compiled.buckets import pad_rows
from engine.compiled.cuda_graphs import CudaGraphDecode
from engine.compiled.cuda_support import (
    IDS,
    LEN,
    PAGES,
    POS,
    REAL,
    SLOT,
    GraphAttention,
    blank_rows,
    count_host_syncs,
    fill_rows,
    unpack,
)
from engine.config import SHIPPED_MODEL, ModelConfig
from engine.forward_batch import build_batch
from engine.kernels.paged_attention import paged_decode_attention_ref
from tests.test_paged_experts import NATURAL

BUCKETS = (1, 4)
BATCHES = (1, 3, 4)        # bucket 1; bucket 4 with a padding row; bucket 4 full
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)


# ---- CPU: the host side of a step ---------------------------------------------------------

def test_fill_rows_matches_build_batch_and_pads_on_the_scratch_page() -> None:
    page_size, scratch, width = 4, 50, 6
    tokens, starts, tables = [[7], [9], [11]], [5, 0, 12], [[3, 8], [4], [1, 2, 6, 9]]
    out = blank_rows(4, width, scratch, page_size)
    out[:, PAGES:] = 33     # stale pages of earlier steps (another request's): replaced by the scratch page
    fill_rows(out, tokens, starts, tables, page_size, scratch, real=2)
    t, s, tb = pad_rows(tokens, starts, tables, 4, scratch)
    want = build_batch(t, s, tb, page_size, "cpu", pad_page=scratch)
    assert out[:, IDS].tolist() == want.input_ids.tolist()
    assert out[:, POS].tolist() == want.positions.tolist()
    assert out[:, SLOT].tolist() == want.slot_mapping.tolist()
    assert out[:, LEN].tolist() == want.seq_lens.tolist()
    assert out[:, REAL].tolist() == [1, 1, 0, 0]
    for row, table in enumerate(tb):
        assert out[row, PAGES:PAGES + len(table)].tolist() == table
    assert out[0, PAGES + 2:].tolist() == [scratch] * 4     # past row 0's pages: the scratch page
    assert out[3, SLOT] == scratch * page_size and out[3, PAGES] == scratch
    # the next step with fewer rows turns the freed rows back into padding
    fill_rows(out, tokens[:1], [6], tables[:1], page_size, scratch)
    assert out[1:, REAL].tolist() == [0, 0, 0] and out[1:, IDS].tolist() == [0, 0, 0]
    assert out[1:, SLOT].tolist() == [scratch * page_size] * 3 and out[1:, LEN].tolist() == [1, 1, 1]
    assert out[0, REAL] == 1 and out[0, LEN] == 7


def test_unpack_gives_the_forward_batch_tensors() -> None:
    tokens, starts, tables = [[7], [9]], [5, 0], [[3, 8], [4]]
    out = blank_rows(2, 3, 20, 4)
    fill_rows(out, tokens, starts, tables, 4, 20)
    ids, pos, slots, table, lens = unpack(torch.from_numpy(out))
    want = build_batch(tokens, starts, tables, 4, "cpu", pad_page=20)
    for got, w in ((ids, want.input_ids), (pos, want.positions), (slots, want.slot_mapping),
                   (lens, want.seq_lens), (table[:, :2], want.page_table)):
        assert got.dtype == w.dtype and torch.equal(got, w)
    assert table.shape == (2, 3) and table.is_contiguous() and lens.is_contiguous()


def test_fill_rows_refuses_what_a_bucket_cannot_hold() -> None:
    out = blank_rows(2, 3, 9, 4)
    with pytest.raises(ValueError, match="does not fit the bucket of 2"):
        fill_rows(out, [[1]] * 3, [0] * 3, [[0]] * 3, 4, 9)
    with pytest.raises(ValueError, match="adds 2 tokens"):
        fill_rows(out, [[1, 2]], [0], [[0]], 4, 9)
    with pytest.raises(ValueError, match="4 pages, more than the graphs' 3"):
        fill_rows(out, [[1]], [0], [[0, 1, 2, 3]], 4, 9)
    assert out.dtype == np.int32


def test_decode_op_is_opaque_to_dynamo_and_matches_the_reference() -> None:
    """The custom op traces into one graph (its launcher never runs under dynamo) and computes
    the reference (on a CPU its registered kernel is the reference; on CUDA, the Triton kernel's
    equality with it is tests/test_kernel_paged_attention.py's)."""
    gen = torch.Generator().manual_seed(0)
    q, kv = torch.randn(3, 4, 32, generator=gen), torch.randn(2, 8, 4, 2, 32, generator=gen)
    table = torch.tensor([[3, 1, 0], [7, 2, 5], [4, 6, 0]], dtype=torch.int32)
    lens = torch.tensor([5, 12, 1], dtype=torch.int32)
    attn = GraphAttention(4)

    def decode(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        return attn.decode(q, kv, (table, lens), 0.125, window=6)

    compiled = torch.compile(decode, backend="aot_eager", fullgraph=True)
    want = paged_decode_attention_ref(q, kv[0], kv[1], table, lens, 0.125, window=6)
    torch.testing.assert_close(compiled(q, kv, table, lens), want, rtol=0, atol=0)


def test_graph_attention_decodes_the_shipped_model_like_the_torch_attention() -> None:
    """Every decode step of the shipped model through the custom op (its CPU kernel) gives the
    torch attention's tokens, logprobs within 1e-5."""
    want = LLM(compile=False).generate(NATURAL[:3], PARAMS)
    llm = LLM(compile=False)
    llm.core.model.attention = GraphAttention(llm.pool.page_size)
    got = llm.generate(NATURAL[:3], PARAMS)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert max(logprob_diff(a.logprobs, b.logprobs) for a, b in zip(got, want)) <= 1e-5


def decodes_uncaptured_like(llm: LLM, eager: LLM) -> CudaGraphDecode:
    """Give `llm` a CudaGraphDecode of bucket 4 that captures nothing (its graphs run directly)
    and check that batches of 1 and 3 decode `eager`'s tokens, logprobs within 1e-5."""
    want = {b: eager.generate(NATURAL[:b], PARAMS) for b in (1, 3)}
    step = CudaGraphDecode(llm.core.model, llm.pool, (4,), attention=GraphAttention(llm.pool.page_size),
                           capture=False)
    step.warm_up()
    llm.core.runner.compiled = step
    for batch, outs in want.items():
        got = llm.generate(NATURAL[:batch], PARAMS)
        assert [o.token_ids for o in got] == [o.token_ids for o in outs]
        assert max(logprob_diff(a.logprobs, b.logprobs) for a, b in zip(got, outs)) <= 1e-5
    return step


def test_the_step_uncaptured_with_paged_experts_decodes_like_eager() -> None:
    """Everything of CudaGraphDecode but the capture, on a CPU (one bucket, one compilation):
    packed rows, the custom-op attention, the split at each MoE layer with the host's paging
    decision; one request in the bucket of 4 (three padding rows, one wave at K = top_k) and
    three (waves: those layers' experts run through PagedExperts) decode eager's tokens."""
    mc = ModelConfig.from_path(SHIPPED_MODEL)
    llm = LLM(compile=False, paged_experts_num_resident=mc.num_experts_per_tok)
    step = decodes_uncaptured_like(llm, LLM(compile=False))
    assert step.compiled == {4} and not step.fullgraph and len(step.paged) > 0
    stats = llm.expert_stats()
    assert all(s["waves"] > s["steps"] for s in stats.values())   # some steps ran in waves
    llm.pool.check_integrity()


def test_the_step_uncaptured_deciding_on_the_device_decodes_like_eager() -> None:
    """K = 16 of 64, top-4: bucket 4 (batches of 1 and 3, padded) pages in on the device inside
    the whole forward (the graph a capture would record), with the same counters as eager paged
    experts."""
    eager = LLM(compile=False, paged_experts_num_resident=16)
    llm = LLM(compile=False, paged_experts_num_resident=16)
    step = decodes_uncaptured_like(llm, eager)
    assert step.compiled == {4} and set(step._buckets) == {(4, True), (4, False)}   # warmed both ways
    assert step.on_device(4), "the batches ran the host plan"
    assert llm.expert_stats() == eager.expert_stats()   # the same hits, misses and steps per layer
    llm.pool.check_integrity()


# ---- CUDA -----------------------------------------------------------------------------------

def syncs_per_step(step: Any, work: Callable[[], Any]) -> tuple[Any, list[int]]:
    """Run `work` with every call of `step.run` counted: (what work returned, the host
    synchronisations of each step)."""
    counts: list[int] = []
    inner = step.run

    def counted(*args: Any, **kwargs: Any) -> Any:
        with count_host_syncs() as found:
            out = inner(*args, **kwargs)
        counts.append(found.count)
        return out

    setattr(step, "run", counted)
    try:
        return work(), counts
    finally:
        delattr(step, "run")


def logprob_diff(a: list[dict[int, float]] | None, b: list[dict[int, float]] | None) -> float:
    assert a is not None and b is not None and len(a) == len(b)
    worst = 0.0
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        worst = max(worst, max(abs(x[t] - y[t]) for t in x))
    return worst


def cuda_step(llm: LLM) -> CudaGraphDecode:
    step = llm.core.runner.compiled
    assert isinstance(step, CudaGraphDecode)
    return step


def _generate(llm: LLM, batch: int) -> list:
    return llm.generate(NATURAL[:batch], PARAMS)


@pytest.fixture(scope="module")
def eager() -> LLM:
    return LLM(device="cuda", compile=False)


@pytest.fixture(scope="module")
def graphs() -> LLM:
    return LLM(device="cuda", compile=True, compile_buckets=BUCKETS)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_count_host_syncs_counts_a_sync_and_not_a_replay() -> None:
    x = torch.ones(4, device="cuda")
    with count_host_syncs() as found:
        x.sum().item()
    assert found.count >= 1
    g, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.mul_(1.0)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        x.mul_(1.0)
    with count_host_syncs() as found:
        g.replay()
    assert found.count == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_bucket_is_one_captured_graph(graphs: LLM) -> None:
    step = cuda_step(graphs)
    assert step.fullgraph
    assert isinstance(step.attention, GraphAttention)
    assert step.compiled == set(BUCKETS)
    assert all(len(b.graphs) == 1 and not b.segments for b in step._buckets.values())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tokens_and_logprobs_match_eager(eager: LLM, graphs: LLM, record_testsuite_property: Any) -> None:
    worst = 0.0
    for batch in BATCHES:
        want, got = _generate(eager, batch), _generate(graphs, batch)
        for w, g in zip(want, got):
            assert g.token_ids == w.token_ids, batch
            worst = max(worst, logprob_diff(w.logprobs, g.logprobs))
    record_testsuite_property("compiled.max_logprob_diff_vs_eager", worst)
    assert worst <= 1e-5
    graphs.pool.check_integrity()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_resident_step_has_no_host_sync(graphs: LLM, record_testsuite_property: Any) -> None:
    step = cuda_step(graphs)
    waits = step.staging_waits
    _, counts = syncs_per_step(step, lambda: _generate(graphs, 3))
    record_testsuite_property("compiled.syncs_per_step_resident", max(counts))
    assert len(counts) >= PARAMS.max_tokens - 1
    assert counts == [0] * len(counts)
    assert step.staging_waits == waits   # the sampler read the previous logits: its copy was done


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batch_invariance(graphs: LLM) -> None:
    alone = [graphs.generate([p], PARAMS)[0].token_ids for p in NATURAL[:4]]   # bucket 1
    assert [o.token_ids for o in _generate(graphs, 3)] == alone[:3]           # bucket 4, one padding row
    assert [o.token_ids for o in _generate(graphs, 4)] == alone               # bucket 4, full


def _ks() -> list[int]:
    """K = top_k (steps in waves: that layer's experts run eagerly between the graphs) and E/2
    (every step of these batches fits in one wave: the graphs only)."""
    mc = ModelConfig.from_path(SHIPPED_MODEL)
    return sorted({mc.num_experts_per_tok, mc.num_experts // 2})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("k", _ks())
def test_paged_experts_bit_identical_with_one_sync_per_moe_layer(k: int, graphs: LLM,
                                                                 record_testsuite_property: Any) -> None:
    llm = LLM(device="cuda", compile=True, compile_buckets=BUCKETS, paged_experts_num_resident=k)
    step = cuda_step(llm)
    assert not step.fullgraph
    layers = len(step.paged)
    assert layers > 0
    assert set(step._buckets) == {(size, whole) for size in step.buckets for whole in step.modes(size)}
    for (size, whole), b in step._buckets.items():
        # deciding on the device: one graph; else a graph per part and per paged layer's experts
        assert (len(b.graphs), len(b.segments)) == ((1, 0) if whole else (layers + 1, layers))
    top_k = ModelConfig.from_path(SHIPPED_MODEL).num_experts_per_tok
    for batch in BATCHES:
        got, counts = syncs_per_step(step, lambda: _generate(llm, batch))
        want = _generate(graphs, batch)
        for a, b in zip(got, want):
            assert a.token_ids == b.token_ids
            assert a.logprobs == b.logprobs       # exact, every step, every entry
        size = 1 if batch == 1 else 4
        record_testsuite_property(f"compiled.syncs_per_step_paged_k{k}_b{batch}", max(counts))
        if step.on_device(size):
            assert counts == [0] * len(counts), f"batch {batch}: host syncs in steps deciding on the device"
        elif k >= size * top_k:
            assert max(counts) <= layers     # one wave per layer: the routing read is the only sync
    record_testsuite_property("compiled.moe_layers", layers)
    stats = llm.expert_stats()
    assert all(s["misses"] > 0 for s in stats.values())
    llm.pool.check_integrity()
