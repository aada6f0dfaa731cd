"""What a JSON-schema constraint costs per decoded token (structured outputs, issue 21), read
by `bench.engine`.

The same prompts decode `tokens` tokens (EOS ignored, greedy) with and without a json_schema
constraint, one stream and 16 concurrent, the two alternating run by run; the schema
(`records_schema`) asks for more records than `tokens` tokens can hold, so every constrained
request runs to `tokens` tokens, as the plain ones do.  The mask's own cost comes from the
engine's counters (`EngineCore.mask_work`: rows masked, seconds llguidance spent filling the
bits, seconds copying/unpacking/applying them to the logits), summed over the timed runs (the
warm-up, which compiles the schema, is left out):
  schema_single_tok_s, schema_batch16_tok_s      tokens/s with the constraint
  schema_ratio_single, schema_ratio_batch16      constrained / plain tokens/s (plain: measured
                                                 here, alternating, as mask.b1/b16.plain_tok_s)
  mask_us_per_token_b1, mask_us_per_token_b16    (fill + apply) seconds / rows masked, in µs
  mask_median_us_per_token_b1, ..._b16           the median step's mask µs per row, measured
                                                 apart on the outputs' grammar states
                                                 (`median_mask_us`: robust to a busy machine)
  mask                                           per batch size: plain_tok_s, rows, steps, fill_us
                                                 and apply_us per token, us per step, the median
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import replace

import torch

from engine import LLM, SamplingParams
from engine.constraint import Constraint
from engine.guided_mask import MaskWork, TokenMasker


def records_schema(tokens: int) -> dict:
    """An array of at least tokens // 4 + 1 small records (each takes more than 4 tokens):
    the output cannot complete within `tokens` tokens."""
    record = {"type": "object", "additionalProperties": False, "required": ["id", "name", "ok"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                             "name": {"type": "string", "maxLength": 16}, "ok": {"type": "boolean"}}}
    return {"type": "array", "items": record, "minItems": tokens // 4 + 1}


def _work(llm: LLM) -> MaskWork:
    w = llm.core.mask_work
    return MaskWork(w.steps, w.rows, w.fill_seconds, w.apply_seconds)


def _run(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    took = time.perf_counter() - start
    assert all(len(o.token_ids) == params.max_tokens for o in outs), \
        [(len(o.token_ids), o.finish_reason) for o in outs]
    return took, [o.token_ids for o in outs]


def median_mask_us(llm: LLM, c: Constraint, outputs: list[list[int]]) -> float:
    """The median over steps of one batch mask (fill + apply, to completion on CUDA), in µs per
    row: one guide per output walks that output's tokens, the batch masked before each token
    (in place, as a step without logprobs), on a masker of its own.  A median, unlike the
    counters' mean, is not moved by the few steps a busy machine preempts."""
    runner = llm.core.runner
    masker = TokenMasker(runner.masker.vocab_size, runner.masker.device)
    guides = [llm.core.guide(c) for _ in outputs]
    logits = torch.zeros(len(outputs), masker.vocab_size, device=masker.device)
    cuda = masker.device.type == "cuda"
    times = []
    for t in range(min(len(o) for o in outputs)):
        start = time.perf_counter()
        masker.apply(logits, guides, copy=False)
        if cuda:
            torch.cuda.synchronize(masker.device)
        times.append(time.perf_counter() - start)
        assert all(g is not None and g.accept(o[t]) for g, o in zip(guides, outputs))
    return 1e6 * statistics.median(times) / len(outputs)


def _timed(llm: LLM, prompts: list[str], params: SamplingParams,
           repeats: int) -> tuple[float, float, MaskWork]:
    """Best plain and constrained tokens/s of `repeats` runs each, alternating (the machine's
    drift touches both alike), after a warm-up of each; and the mask work of the timed runs."""
    plain = replace(params, constraint=None)
    _run(llm, prompts, plain), _run(llm, prompts, params)
    before, best_plain, best = _work(llm), float("inf"), float("inf")
    for _ in range(repeats):
        best_plain = min(best_plain, _run(llm, prompts, plain)[0])
        best = min(best, _run(llm, prompts, params)[0])
    after = llm.core.mask_work
    spent = MaskWork(after.steps - before.steps, after.rows - before.rows,
                     after.fill_seconds - before.fill_seconds, after.apply_seconds - before.apply_seconds)
    tokens = params.max_tokens * len(prompts)
    return tokens / best_plain, tokens / best, spent


def _per_token(w: MaskWork) -> dict[str, float]:
    rows, steps = max(w.rows, 1), max(w.steps, 1)
    return {"rows": w.rows, "steps": w.steps, "fill_us": 1e6 * w.fill_seconds / rows,
            "apply_us": 1e6 * w.apply_seconds / rows, "us_per_token": 1e6 * w.seconds / rows,
            "us_per_step": 1e6 * w.seconds / steps}


def mask_cost(llm: LLM, prompts: list[str], tokens: int, repeats: int) -> dict[str, object]:
    """The keys above, for batch 1 (prompts[:1]) and 16 (prompts[:16])."""
    c = Constraint("json_schema", json.dumps(records_schema(tokens)))
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, constraint=c)
    out: dict[str, object] = {}
    detail: dict[str, dict[str, float]] = {}
    for batch, name in ((1, "single"), (16, "batch16")):
        plain, rate, work = _timed(llm, prompts[:batch], params, repeats)
        per = {"plain_tok_s": plain, **_per_token(work)}
        per["median_us_per_token"] = median_mask_us(llm, c, _run(llm, prompts[:batch], params)[1])
        out[f"schema_{name}_tok_s"] = rate
        out[f"schema_ratio_{name}"] = rate / plain
        out[f"mask_us_per_token_b{batch}"] = per["us_per_token"]
        out[f"mask_median_us_per_token_b{batch}"] = per["median_us_per_token"]
        detail[f"b{batch}"] = per
    out["mask"] = detail
    return out
