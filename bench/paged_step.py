"""The compiled step with paged experts (issue 40), read by `bench.engine`: the paging decision
made on the device inside one graph, against the host's decision between graph parts (the step
before issue 40) and against every expert resident, one stream, the three alternating run by
run (the machine's drift touches them alike):

  engine_compiled_paged_single_tok_s            K = E/4 experts resident per layer, direct copies
                                                (no emulated link), decided on the device
  engine_compiled_segmented_paged_single_tok_s  the same engine, the host deciding per MoE layer
                                                (`CompiledDecode.device_paging = False`)
  engine_compiled_resident_single_tok_s         every expert resident (the compiled default)
  paged_over_resident_single, paged_over_segmented_single, paged_k
  paged_hit_rate: hits / (hits + misses) of the paged engine over all its runs

Each figure: best of `repeats` timed runs after one warm-up of each, greedy, EOS ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from bench.compile_cost import _generate, alternate
from engine import LLM


def _paging(llm: LLM, on_device: bool, run: Callable[[], None]) -> Callable[[], None]:
    step = llm.core.runner.compiled
    assert step is not None, "the paged engine is compiled"

    def go() -> None:
        step.device_paging = on_device
        run()
    return go


def paged_speeds(resident: LLM, device: str, buckets: Sequence[int] | None, prompts: Sequence[str],
                 tokens: int, repeats: int) -> dict[str, Any]:
    """The keys of the module doc; `resident`: an engine with every expert resident (compiled
    here when it is not)."""
    if not resident.config.compile:
        resident = LLM(device=device, compile=True, compile_buckets=buckets)
    experts = resident.model.cfg.num_experts
    k = max(experts // 4, resident.model.cfg.num_experts_per_tok)
    paged = LLM(device=device, compile=True, compile_buckets=buckets, paged_experts_num_resident=k)
    one = [prompts[0]]
    gen = _generate(paged, one, tokens)
    best = alternate({"resident": _generate(resident, one, tokens), "device": _paging(paged, True, gen),
                      "segmented": _paging(paged, False, gen)}, repeats)
    layers = paged.core.paged_experts().values()
    hits = sum(e.counters.hits for e in layers)
    looked = hits + sum(e.counters.misses for e in layers)
    rate = {name: tokens / s for name, s in best.items()}
    return {"engine_compiled_paged_single_tok_s": rate["device"],
            "engine_compiled_segmented_paged_single_tok_s": rate["segmented"],
            "engine_compiled_resident_single_tok_s": rate["resident"],
            "paged_over_resident_single": rate["device"] / rate["resident"],
            "paged_over_segmented_single": rate["device"] / rate["segmented"],
            "paged_k": k, "paged_hit_rate": hits / looked if looked else 0.0}
