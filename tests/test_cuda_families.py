"""The model families on a CUDA device (`pytest -m cuda`; all skip without one).

The CPU suite runs the families' CUDA paths only under the Triton interpreter; these tests run
them compiled, on every family of tests/families.py (its tiny checkpoint written by
transformers):
- the engine on cuda (Triton decode attention with sliding windows, sinks and the latent
  layout; Triton fused MoE with expert biases and the clamped SwiGLU; both chosen and checked
  at start-up) against the same checkpoint on the CPU's torch path, fp32: greedy tokens
  identical and every logprob within CPU_TOLERANCE;
- paged experts at K = top_k over CUDA copy streams (pinned host store, prefetch on),
  bit-identical to all-resident on cuda;
- bf16 on cuda runs and produces tokens (no parity claim: bf16 rounds differently from the fp32
  reference, and greedy choices on a tiny random model may follow the rounding);
plus the Triton decode variants compiled against the torch reference, and disaggregated
workers with their pools on the device carrying DeepSeek-V3's latent pages (C = 1) and
gpt-oss's pages (sinks, windows) over gRPC.

Each family's figures go to the JUnit report as testsuite properties `<family>.<figure>`;
`python -m bench.gpu_check` (its `families` step) puts them in its JSON.
"""

from __future__ import annotations

import gc
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from engine import LLM
from engine.config import ModelConfig
from engine.models.decoder import MoeBlock
from tests.families import FAMILIES, tiny_checkpoint
from tests.test_families import PARAMS, prompts  # the prompts and sampling of the CPU family tests

DEVICE = "cuda"
CPU_TOLERANCE = 1e-3   # fp32 on both sides: different kernels and summation orders, nothing coarser
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

Record = Callable[[str, object], None]


def release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """family -> its tiny checkpoint, written once per module."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = tiny_checkpoint(name, tmp_path_factory.mktemp(name))
        return made[name]
    return get


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, checkpoints: Callable[[str], Path]) -> tuple[str, Path]:
    return request.param, checkpoints(request.param)


@pytest.fixture(scope="module")
def cpu_outputs(family: tuple[str, Path]) -> list[Any]:
    """The CPU's torch path, fp32 (tests/test_families.py holds it to transformers within 1e-4)."""
    llm = LLM(family[1])
    out = llm.generate(prompts(), PARAMS)
    del llm
    gc.collect()
    return out


@pytest.fixture(scope="module")
def cuda_resident(family: tuple[str, Path]) -> Iterator[tuple[LLM, list[Any]]]:
    """All experts resident on cuda, fp32, and its greedy output from a fresh engine (an empty
    prefix cache: every prompt prefilled whole, as in the engines compared with it)."""
    llm = LLM(family[1], device=DEVICE)
    yield llm, llm.generate(prompts(), PARAMS)
    del llm
    release()


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_cuda_runs_the_triton_kernels(family: tuple[str, Path], cuda_resident: tuple[LLM, list[Any]]) -> None:
    llm, _ = cuda_resident
    assert llm.attention_backend == "triton"
    moe = [layer.mlp for layer in llm.model.layers if isinstance(layer.mlp, MoeBlock)]
    assert moe and all(getattr(m.experts, "triton", False) for m in moe), "the Triton fused MoE was not chosen"
    assert llm.pool.kv.is_cuda and llm.pool.geometry == llm.model_config.kv_geometry


def test_cuda_matches_the_cpu_path(family: tuple[str, Path], cpu_outputs: list[Any],
                                   cuda_resident: tuple[LLM, list[Any]], record_testsuite_property: Record) -> None:
    """Greedy tokens identical and every reported logprob within CPU_TOLERANCE (compared up to
    and including the first differing step, so a difference is measured before it is failed)."""
    name, _ = family
    _, cuda = cuda_resident
    worst, diverged = 0.0, []
    for i, (c, g) in enumerate(zip(cpu_outputs, cuda)):
        first = first_difference(c.token_ids, g.token_ids)
        for step in range(min(first + 1, len(c.logprobs), len(g.logprobs))):
            for tid in c.logprobs[step].keys() & g.logprobs[step].keys():
                worst = max(worst, abs(c.logprobs[step][tid] - g.logprobs[step][tid]))
        if c.token_ids != g.token_ids:
            diverged.append(f"prompt {i}: step {first}: cpu {c.logprobs[min(first, len(c.logprobs) - 1)]} "
                            f"cuda {g.logprobs[min(first, len(g.logprobs) - 1)]}")
    record_testsuite_property(f"{name}.cuda_vs_cpu_max_logprob_diff", worst)
    print(f"\n{name}: max logprob difference cuda vs cpu {worst:.2e}")
    assert not diverged, "greedy tokens differ between cuda and cpu: " + "; ".join(diverged)
    assert worst <= CPU_TOLERANCE, f"{name}: logprobs differ by {worst} between cuda and cpu"


def test_paged_experts_on_cuda_bit_identical(family: tuple[str, Path], cuda_resident: tuple[LLM, list[Any]],
                                             record_testsuite_property: Record) -> None:
    """Bit-identical by design: on cuda every MoE call of a step takes the "triton" StepPlan,
    resident or paged, wave or not, and the fused-MoE kernel computes each (token, expert) row on
    its own with block sizes fixed by the dtype alone (engine/kernels/triton/fused_moe.py), so a
    pair's result does not depend on which slot holds its expert or which other pairs share the
    call; everything else in the step is the same computation on the same inputs."""
    from engine.experts import CudaStreamCopy
    name, path = family
    _, want = cuda_resident
    k = ModelConfig.from_path(path).num_experts_per_tok
    llm = LLM(path, device=DEVICE, paged_experts_num_resident=k, paged_experts_prefetch=True)
    layers = llm.paged_experts()
    assert layers and all(isinstance(e.slots.copier, CudaStreamCopy) for e in layers.values())
    assert all(e.slots.store.w13.is_pinned() and e.slots.w13.is_cuda and e.triton for e in layers.values())
    got = llm.generate(prompts(), PARAMS)
    stats = llm.expert_stats()
    record_testsuite_property(f"{name}.paged_k", k)
    record_testsuite_property(f"{name}.paged_misses", sum(s["misses"] for s in stats.values()))
    record_testsuite_property(f"{name}.paged_prefetched", sum(s["prefetched"] for s in stats.values()))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w.token_ids, f"K={k} prompt {i}: tokens differ from all-resident"
        assert g.logprobs == w.logprobs, f"K={k} prompt {i}: logprobs not bit-identical to all-resident"
    assert sum(s["misses"] for s in stats.values()) > 0, f"K={k}: nothing was paged"
    llm.pool.check_integrity()
    del llm
    release()


def test_bf16_on_cuda_produces_tokens(family: tuple[str, Path], cuda_resident: tuple[LLM, list[Any]],
                                      record_testsuite_property: Record) -> None:
    """Runs and produces finite logprobs; how many tokens agree with fp32 is recorded, not held."""
    name, path = family
    _, fp32 = cuda_resident
    llm = LLM(path, device=DEVICE, dtype="bfloat16")
    assert llm.attention_backend == "triton" and llm.pool.kv.dtype == torch.bfloat16
    got = llm.generate(prompts(), PARAMS)
    vocab = llm.model_config.vocab_size
    agree = sum(first_difference(g.token_ids, w.token_ids) for g, w in zip(got, fp32))
    record_testsuite_property(f"{name}.bf16_tokens_agreeing_with_fp32",
                              round(agree / sum(len(w.token_ids) for w in fp32), 3))
    for g in got:
        assert len(g.token_ids) == PARAMS.max_tokens and all(0 <= t < vocab for t in g.token_ids)
        assert all(math.isfinite(lp) and lp <= 1e-6 for step in g.logprobs for lp in step.values()), g.logprobs
    del llm
    release()


def test_attention_variants_compiled_match_reference() -> None:
    """Window, sinks, both in bf16, the latent layout (tails, Dv < Dk, head blocks, fp16) and
    the start-up check (576/512 latent) compiled, against the torch reference."""
    from tests.test_attention_variants import run_cases
    failed = {case: err for case, err in run_cases(DEVICE).items() if err is not None}
    assert not failed, failed


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss"])
def test_disaggregated_on_cuda_equals_the_engine(name: str, checkpoints: Callable[[str], Path]) -> None:
    """Prefill and decode workers (in-process gRPC servers) with their pools on the device:
    DeepSeek-V3's latent pages and gpt-oss's windowed pages staged from and into CUDA pools."""
    from tests.workers import channel, config, run, start_decode, start_prefill, wait_idle
    path = checkpoints(name)
    llm = LLM(path, device=DEVICE)
    want = llm.generate(prompts(), PARAMS)
    del llm
    release()
    cfg = config(model=str(path), device=DEVICE, kv_cache_tokens=2048, max_model_len=1024, max_prefill_tokens=32,
                 layer_group=1)
    decode, prefill = start_decode(cfg), start_prefill(cfg)
    try:
        assert decode.core.pool.kv.is_cuda and prefill.core.pool.kv.is_cuda
        assert decode.core.pool.geometry == decode.core.model_config.kv_geometry
        dch, pch = channel(decode.address), channel(prefill.address)
        ids = prompts()
        with ThreadPoolExecutor(len(ids)) as pool:
            got = list(pool.map(lambda i: run(dch, pch, f"c{i}", ids[i], PARAMS), range(len(ids))))
        for i, (w, g) in enumerate(zip(want, got)):
            assert g.error is None, g.error
            assert g.token_ids == w.token_ids, f"prompt {i}: disaggregated tokens differ from the engine's"
        wait_idle(decode, prefill)
    finally:
        decode.stop()
        prefill.stop()
        release()
