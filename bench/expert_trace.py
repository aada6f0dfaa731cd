"""The shipped model's expert routing over real prompts, recorded once, and what it becomes at
another model's MoE shape (for `bench.real_shape`).

    python -m bench.expert_trace [--sequences 16] [--steps 96] [--out bench/data/expert_trace.json]

Recording: the shipped checkpoint (`engine.LLM()`, CPU, eager, greedy) decodes each of
`sequences` held-out prompts (`bench.experts.natural_prompts`: windows of standard-library text,
the prompts `bench.experts` measures with) alone, for `steps` tokens; every MoE layer's router
is wrapped for the run, and after the prompt's prefill each decode step's top-k expert ids are
kept.  The file holds ids[layer][sequence][step] = the k experts, in the router's order.  One
sequence at a time, greedy, on CPU: recording twice gives the same file (tests check a prefix).

Mapping (`mapped_steps`) onto E' experts, top-k' with E' = f * E and k' = f * k: shipped expert e
becomes the f experts f*e .. f*e + f - 1, so a token's k' experts are distinct, and any two steps
share f times as many experts as the shipped steps do: reuse distances and the working set's
shape are kept, scaled by f.  Real layer l replays shipped layer l mod L (cyclic).  A step of
batch b at step t takes sequences 0..b-1 at step t: b independent requests decoding together.

`reference_lru_misses` is a plain simulation over expert ids of the paging policy that
engine/experts implements (LRU per step, in waves when a step needs more than K experts), with
no slots and no tensors: the misses the link bound is computed from.
"""

from __future__ import annotations

import argparse
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TRACE = Path(__file__).resolve().parent / "data" / "expert_trace.json"


@dataclass(frozen=True)
class Trace:
    """ids: [L, S, T, k] int64 (layer, sequence, decode step, the step's k experts)."""
    model: str
    num_experts: int
    top_k: int
    ids: torch.Tensor

    @property
    def layers(self) -> int:
        return self.ids.shape[0]

    @property
    def sequences(self) -> int:
        return self.ids.shape[1]

    @property
    def steps(self) -> int:
        return self.ids.shape[2]


def load(path: Path = TRACE) -> Trace:
    """The trace stored at `path`.  Raises ValueError when its ids do not fit its header."""
    data = json.loads(path.read_text())
    ids = torch.tensor(data["ids"], dtype=torch.int64)
    e, k = data["num_experts"], data["top_k"]
    if ids.dim() != 4 or ids.shape[3] != k or int(ids.min()) < 0 or int(ids.max()) >= e:
        raise ValueError(f"{path}: ids of shape {tuple(ids.shape)} do not fit {e} experts, top-{k}")
    return Trace(data["model"], e, k, ids)


class RecordingRouter:
    """A router that passes every call through and, while `on`, keeps the ids of row 0."""

    def __init__(self, router: Any, steps: list[list[int]]) -> None:
        self.router, self.steps, self.on = router, steps, False

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = self.router(h)
        if self.on:
            self.steps.append(ids[0].tolist())   # one sequence at a time: [1, k]
        return weights, ids


def record(sequences: int = 16, steps: int = 96, prompt_tokens: int = 32) -> dict[str, Any]:
    """Decode `sequences` held-out prompts one at a time on the shipped model for `steps` tokens
    each; returns the trace file's contents (see the module doc)."""
    from bench.experts import natural_prompts
    from engine import LLM, SamplingParams
    from engine.models.decoder import MoeBlock

    llm = LLM(device="cpu", compile=False)
    blocks = [layer.mlp for layer in llm.model.layers if isinstance(layer.mlp, MoeBlock)]
    ids: list[list[list[list[int]]]] = [[] for _ in blocks]
    # the prefill samples the first token; each decode step after it routes one
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for prompt in natural_prompts(llm, sequences, prompt_tokens):
        recorders = [RecordingRouter(b.router, []) for b in blocks]
        for block, rec in zip(blocks, recorders):
            block.router = rec        # for this prompt only (restored below)
        llm.add_request(prompt, params)
        while any(r.prefilling for r in llm.scheduler.running) or llm.scheduler.waiting:
            llm.step()
        for rec in recorders:
            rec.on = True
        while llm.scheduler.has_work():
            llm.step()
        for layer, (block, rec) in enumerate(zip(blocks, recorders)):
            block.router = rec.router
            assert len(rec.steps) == steps, f"layer {layer} routed {len(rec.steps)} decode steps, not {steps}"
            ids[layer].append(rec.steps)
    cfg = llm.model_config
    return {"model": Path(llm.config.model).name, "num_experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
            "moe_layers": len(blocks), "sequences": sequences, "steps": steps, "prompt_tokens": prompt_tokens,
            "recorded_by": "python -m bench.expert_trace", "ids": ids}


def mapped_steps(trace: Trace, num_experts: int, top_k: int, layers: int, batch: int,
                 first: int, count: int) -> list[torch.Tensor]:
    """Per real layer, the ids [count, batch, top_k] of decode steps first..first+count-1 of
    `batch` sequences, mapped onto `num_experts` experts top-`top_k` (see the module doc).
    Raises ValueError when the shapes do not scale by one factor or the trace is too short."""
    f = num_experts // trace.num_experts
    if f < 1 or num_experts != f * trace.num_experts or top_k != f * trace.top_k:
        raise ValueError(f"{num_experts} experts top-{top_k} is not the trace's {trace.num_experts} "
                         f"top-{trace.top_k} scaled by one factor")
    if batch > trace.sequences or first + count > trace.steps:
        raise ValueError(f"batch {batch}, steps {first}..{first + count - 1}: the trace has "
                         f"{trace.sequences} sequences of {trace.steps} steps")
    part = trace.ids[:, :batch, first:first + count].transpose(1, 2)        # [L, count, batch, k]
    spread = part[..., None] * f + torch.arange(f)                          # [L, count, batch, k, f]
    spread = spread.reshape(*part.shape[:3], top_k)
    return [spread[layer % trace.layers] for layer in range(layers)]


def reference_lru_misses(steps: list[list[int]], num_slots: int) -> list[int]:
    """Misses of each step (its expert ids, any order, repeats allowed) under LRU over
    `num_slots` slots that start holding experts 0..K-1 (0 least recently used).  A step's
    experts are needed at once: the resident ones are kept; when all fit, the missing ones
    replace the least recently used others and every needed expert is then used in ascending
    order; when more than K are needed, the step runs in waves (the resident ones and as many
    missing as fit, then K missing at a time), each wave evicting what it does not hold."""
    cache: OrderedDict[int, None] = OrderedDict((e, None) for e in range(num_slots))
    out = []
    for step in steps:
        needed = sorted(set(step))
        resident = [e for e in needed if e in cache]
        missing = [e for e in needed if e not in cache]
        out.append(len(missing))
        if len(needed) <= num_slots:
            waves = [needed]
        else:
            room = num_slots - len(resident)
            rest = missing[room:]
            waves = [resident + missing[:room]] + [rest[i:i + num_slots] for i in range(0, len(rest), num_slots)]
        for wave in waves:
            incoming = [e for e in wave if e not in cache]
            victims = [e for e in cache if e not in wave][:len(incoming)]
            for e in victims:
                del cache[e]
            for e in wave:
                cache[e] = None
                cache.move_to_end(e)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=TRACE)
    args = ap.parse_args(argv)
    data = record(args.sequences, args.steps, args.prompt_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"{args.out}: {data['moe_layers']} layers x {args.sequences} sequences x {args.steps} steps, "
          f"{args.out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
