"""The compiled decode step of every family the model registry serves, on a tiny generated
checkpoint: with every expert resident its forward is one graph with no break
(`torch._dynamo.explain`), and the traced step (aot_eager: the graph dynamo and AOTAutograd
produce, run by eager kernels; inductor's code generation is covered on the shipped model in
tests/test_compiled_step.py) decodes the same greedy tokens as eager, with padding rows."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.compiled.step import CompiledDecode
from engine.models import REGISTRY
from tests.checkpoints import write_random_checkpoint
from tests.families import FAMILIES, tiny_checkpoint
from tests.test_compiled_step import LOGPROB_TOLERANCE, assert_same, explain_step

NAMES = sorted([*FAMILIES, "qwen3_moe"])   # tests/families.py writes all but the shipped family's
PROMPT_LENGTHS = (1, 9, 30)                 # 3 rows in bucket 4; past the tiny sliding windows (8, 24)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)


class TracedDecode(CompiledDecode):
    """The compiled step with dynamo's graph run by the aot_eager backend (no code generation:
    seconds, not minutes, per family); counts the steps it ran."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        assert self.fullgraph
        self._graph = torch.compile(self._forward, backend="aot_eager", fullgraph=True, dynamic=False)
        self.steps = 0

    def run(self, *args: Any, **kw: Any) -> torch.Tensor:
        self.steps += 1
        return super().run(*args, **kw)


def prompts(seed: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 4096, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def test_every_registered_family_is_covered() -> None:
    assert {m.__name__.rsplit(".", 1)[1] for m in REGISTRY.values()} == set(NAMES)


@pytest.fixture(scope="module", params=NAMES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    name, path = request.param, tmp_path_factory.mktemp(request.param)
    yield name, (write_random_checkpoint(path) if name == "qwen3_moe" else tiny_checkpoint(name, path))
    gc.collect()


def test_compiled_step_is_one_graph_and_decodes_as_eager(family: tuple[str, Path]) -> None:
    name, path = family
    llm = LLM(path, compile=False, max_num_seqs=4, enable_prefix_cache=False)
    step = TracedDecode(llm.model, llm.pool, (4,))
    out = explain_step(step, llm.pool, prompts())
    assert (out.graph_count, out.graph_break_count) == (1, 0), f"{name}: {out.break_reasons}"

    want = llm.generate(prompts(), GREEDY)
    llm.core.runner.compiled = step
    try:
        got = llm.generate(prompts(), GREEDY)
    finally:
        llm.core.runner.compiled = None
    assert step.steps >= GREEDY.max_tokens - 1, f"{name}: the decode steps did not run compiled"
    worst = assert_same(got, want)
    assert worst <= LOGPROB_TOLERANCE
    llm.pool.check_integrity()
    assert llm.pool.num_free == llm.pool.num_pages
    del llm
    gc.collect()
