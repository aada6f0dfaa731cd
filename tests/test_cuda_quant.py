"""Quantized checkpoints on a CUDA device (`pytest -m cuda`; all skip without one).

For each published layout (tests/test_quant_experts.py's list), the random Qwen3-MoE checkpoint
quantized by engine/quant/pack.py, served on cuda (Triton fused MoE reading the experts'
published parts, dequantized in the kernel): greedy tokens identical to its reference dequantization served on
the CPU, every logprob within CPU_TOLERANCE (fp32 both sides, different kernels); paged at
K = top_k over CUDA copy streams (pinned quantized host store) bit-identical to resident on
cuda; and each format's decode tok/s at K = E/4 against bf16, as JUnit properties
`<format>.<figure>` (`python -m bench.gpu_check`'s `quantized` step).  The step also runs the
quantized kernels' cases (tests/test_kernel_fused_moe_quant.py, tests/test_kernel_quant_linear.py)
and the loader's start-up check of each format on the device, compiled instead of interpreted; the
formats whose attention is quantized keep it so (keep_dense_quantized, on by default on CUDA).
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.quant import LinearFormat
from engine.quant.pack import quantize_checkpoint
from tests import test_kernel_quant_linear as linear_cases
from tests.checkpoints import write_random_checkpoint
from tests.test_kernel_fused_moe_quant import CASES, STARTUP_CHECKS, run_cases
from tests.test_quant_experts import FORMATS, PARAMS, dequantized_copy, prompts

DEVICE = "cuda"
CPU_TOLERANCE = 1e-3
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def kernel_results() -> dict[str, str | None]:
    return run_cases(DEVICE)


@pytest.mark.parametrize("name", [c[0] for c in CASES + STARTUP_CHECKS])
def test_the_quantized_fused_moe_kernel_on_cuda(kernel_results: dict[str, str | None], name: str) -> None:
    assert kernel_results[name] is None, kernel_results[name]


@pytest.fixture(scope="module")
def linear_results() -> dict[str, str | None]:
    return linear_cases.run_cases(DEVICE)


@pytest.mark.parametrize("name", [c[0] for c in linear_cases.CASES])
def test_the_quantized_linear_kernel_on_cuda(linear_results: dict[str, str | None], name: str) -> None:
    assert linear_results[name] is None, linear_results[name]


def decode_tok_s(llm: LLM, tokens: int = 64) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts()[:1], params)               # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts()[:1], params)
    torch.cuda.synchronize()
    return tokens / (time.perf_counter() - start)


@pytest.mark.parametrize("fmt,all_linears", FORMATS, ids=[f.describe() for f, _ in FORMATS])
def test_a_quantized_checkpoint_on_cuda(fmt: LinearFormat, all_linears: bool, plain: Path, tmp_path: Path,
                                        record_testsuite_property) -> None:
    quantized = tmp_path / "q"
    quantize_checkpoint(plain, quantized, fmt, experts_only=not all_linears)
    reference = LLM(dequantized_copy(quantized, tmp_path / "ref", fmt), device="cpu").generate(prompts(), PARAMS)
    resident = LLM(quantized, device=DEVICE)
    got = resident.generate(prompts(), PARAMS)
    assert [o.token_ids for o in got] == [r.token_ids for r in reference]
    worst = max(abs(a[t] - b[t]) for o, r in zip(got, reference) for a, b in zip(o.logprobs, r.logprobs) for t in a)
    assert worst <= CPU_TOLERANCE
    name = fmt.describe().replace(" ", "_")
    record_testsuite_property(f"{name}.max_logprob_diff_vs_cpu_reference", worst)
    record_testsuite_property(f"{name}.resident_tok_s", decode_tok_s(resident))
    del resident
    paged = LLM(quantized, device=DEVICE, paged_experts_num_resident=2)   # K = E/4 = top_k of these 8 experts
    outs = paged.generate(prompts(), PARAMS)
    assert [o.token_ids for o in outs] == [g.token_ids for g in got]
    assert [o.logprobs for o in outs] == [g.logprobs for g in got], "paged not bit-identical to resident"
    record_testsuite_property(f"{name}.paged_k_e4_tok_s", decode_tok_s(paged))
    del paged
    gc.collect()
    torch.cuda.empty_cache()
