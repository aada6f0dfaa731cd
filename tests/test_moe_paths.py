"""Every CPU expert-compute path a step's shape can select (engine.moe.choose_strategy):
each matches the reference, the choice is deterministic and the same in another process, and
the shipped model matches transformers whichever path runs its MoE layers (issue 17)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import engine.moe as moe
from engine import SamplingParams
from engine.kernels.fused_moe import fused_moe_ref
from engine.moe import GATHER_MAX_PAIRS, StepPlan, choose_strategy, expert_outputs
from tests.test_parity_hf import check_parity

ROOT = Path(__file__).resolve().parents[1]
E, H, INTER, K = 64, 128, 64, 4  # the shipped model's MoE shape
STRATEGIES = ("gathered", "padded", "grouped")


def make_step(tokens: int, skew: bool, seed: int, skipped: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], ids [T, K]: uniform routing, or rank 0 of every
    token on one expert (a prefill of repetitive text); `skipped`: some pairs -1 (paged waves)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, INTER, generator=g) * INTER ** -0.5
    ids = torch.randint(0, E, (tokens, K), generator=g)
    if skew:
        ids[:, 0] = 7
    if skipped:
        ids[::3, 1] = -1
    return x, w13, w2, ids


def run_path(strategy: str, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor
             ) -> torch.Tensor:
    cap = int(torch.bincount(ids[ids >= 0], minlength=E).max()) if strategy == "padded" else 0
    out = torch.full((ids.numel(), H), 7.0)
    return expert_outputs(x, w13, w2, ids, out, StepPlan(strategy, cap))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("tokens,skew,skipped", [(1, False, False), (8, False, True), (64, True, False),
                                                 (257, True, True), (300, False, False)])
def test_every_path_matches_the_reference(strategy: str, tokens: int, skew: bool, skipped: bool) -> None:
    x, w13, w2, ids = make_step(tokens, skew, tokens, skipped)
    got = run_path(strategy, x, w13, w2, ids)
    want = fused_moe_ref(x, w13, w2, ids, torch.full((ids.numel(), H), 7.0))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert bool((got[ids.reshape(-1) < 0] == 7.0).all()), "rows of skipped pairs were written"
    assert torch.equal(run_path(strategy, x, w13, w2, ids), got), "not deterministic"


def test_each_path_is_selected_by_some_shape() -> None:
    chosen = {}
    for tokens, skew in ((1, False), (2, False), (16, False), (64, False), (256, False), (64, True),
                         (256, True), (512, True)):
        ids = make_step(tokens, skew, 0)[3]
        chosen[(tokens, skew)] = StepPlan.for_step(ids, E).strategy
    assert chosen[(1, False)] == chosen[(2, False)] == "gathered"
    assert chosen[(64, False)] == chosen[(256, False)] == "padded"   # batched decode: routing spread
    assert chosen[(256, True)] == chosen[(512, True)] == "grouped"   # prefill: one expert takes every token
    assert set(chosen.values()) == set(STRATEGIES)


def test_choice_follows_the_padded_block_not_the_pair_count() -> None:
    # Issue 17: 256 tokens x top-4 with one expert taking 209 pairs went down the padded path.
    assert choose_strategy(1024, 209, 30, E) == "grouped"
    assert choose_strategy(1024, 30, 64, E) == "padded"
    assert choose_strategy(GATHER_MAX_PAIRS + K, 2, GATHER_MAX_PAIRS, E) != "gathered"
    assert choose_strategy(4, 1, 4, E) == "gathered"
    plan = StepPlan.for_step(make_step(256, True, 0)[3], E)
    assert plan == StepPlan("grouped", 0)


CHILD = """
import json, sys, torch
sys.path.insert(0, {root!r})
from tests.test_moe_paths import make_step, run_path
from engine.moe import StepPlan
res = {{}}
for tokens, skew in ((2, False), (64, False), (256, True)):
    x, w13, w2, ids = make_step(tokens, skew, tokens)
    plan = StepPlan.for_step(ids, 64)
    out = run_path(plan.strategy, x, w13, w2, ids)
    res[str(tokens)] = [plan.strategy, plan.cap, out.double().sum().item(), out.abs().double().sum().item()]
print(json.dumps(res))
"""


def test_same_choice_and_bits_in_another_process() -> None:
    """The chaos oracle compares separate processes: same shape, same path, same bits."""
    proc = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT))], capture_output=True,
                          text=True, check=True, cwd=ROOT)
    theirs = json.loads(proc.stdout)
    for tokens, skew in ((2, False), (64, False), (256, True)):
        x, w13, w2, ids = make_step(tokens, skew, tokens)
        plan = StepPlan.for_step(ids, 64)
        out = run_path(plan.strategy, x, w13, w2, ids)
        assert theirs[str(tokens)] == [plan.strategy, plan.cap, out.double().sum().item(),
                                       out.abs().double().sum().item()]


@pytest.fixture(scope="module")
def shipped_hf(shipped_llm):
    return AutoModelForCausalLM.from_pretrained(shipped_llm.config.model, dtype=torch.float32).eval()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shipped_model_matches_transformers_on_every_path(strategy, shipped_llm, shipped_hf, monkeypatch):
    """Every MoE call of prefill and decode forced onto one path, a short and a 300-token prompt."""
    monkeypatch.setattr(moe, "choose_strategy", lambda *args: strategy)
    long = "def handler(event, context):\n    return {'status': 200}\n" * 20
    check_parity(shipped_llm, shipped_hf, ["def fibonacci(n):", long])


def test_long_prompt_greedy_is_the_same_alone_and_in_a_batch(shipped_llm) -> None:
    """A 257-token-ish prefill (grouped) and decodes (gathered / padded) mixed in one batch."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = ["import os\n" * 64, "x", "class A:\n    pass\n" * 20]
    alone = [shipped_llm.generate([p], params)[0].token_ids for p in prompts]
    assert alone == [o.token_ids for o in shipped_llm.generate(prompts, params)]
