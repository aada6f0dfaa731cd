"""Where a compiled decode step's time goes (issue 22), read by `bench.engine --profile`.

One single-stream generation of `tokens` greedy tokens on `LLM(compile=True)` with bucket 1
only, under torch.profiler, after a warm-up generation.  The engine's parts are labelled
from outside (their bound methods wrapped in `record_function` on this one engine): the
scheduler, the runner, the compiled step's `run` (padding, building the batch, the graph), the
graph call itself, the grammar mask, the sampler and the token path (`update`: append,
stop checks, freeing).  On a CPU, inductor is asked to label its C++ kernels
(`cpp.enable_kernel_profile`), so the graph's time splits into kernels and the Python around
them (dynamo's guards, inductor's wrapper).

The JSON summary (ms):
  wall_ms_per_token          the generation's wall time per token (the first token is the
                             prefill, eager; each other one a compiled step: compiled_steps)
  parts                      per label: total_ms, calls, ms_per_call
  graph_kernels_ms           per compiled step, in the graph call: self time of kernels and aten ops
  graph_wrapper_ms           per compiled step, in the graph call: the rest (guards, wrappers, Python)
  step_outside_graph_ms      per compiled step, `compiled.run` outside the graph (padding rows,
                             building the batch's tensors)
  top                        the `top` entries by self CPU time over the whole generation: name,
                             self_ms, total_ms, calls
The table of the top entries is printed to stderr.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile, record_function

import engine.model_runner
from engine import LLM, SamplingParams

GRAPH, RUN = "tandem: compiled graph", "tandem: compiled.run"
WRAPPER_PREFIXES = ("tandem:", "Torch-Compiled Region", "TorchDynamo", "## ", "CompiledFunction")


def _labelled(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return fn(*args, **kwargs)
    return wrapped


@contextmanager
def labels(llm: LLM) -> Iterator[None]:
    """The engine's parts wrapped in profiler ranges for the duration (instance attributes
    shadowing the methods, and the runner's module-level sampler), restored after."""
    core, runner = llm.core, llm.core.runner
    step = runner.compiled
    assert step is not None
    targets: list[tuple[object, str, str]] = [
        (core, "schedule", "tandem: schedule"), (core, "run", "tandem: runner.run"),
        (core, "update", "tandem: update (tokens, stop checks)"), (step, "run", RUN), (step, "_graph", GRAPH),
        (runner.masker, "apply", "tandem: grammar mask"), (engine.model_runner, "sample", "tandem: sample")]
    saved = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in targets]
    for obj, name, label in targets:
        setattr(obj, name, _labelled(label, getattr(obj, name)))
    try:
        yield
    finally:
        for obj, name, old in saved:
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


def _kernel_self_us(event: FunctionEvent) -> float:
    """Self CPU time (µs) of the kernels and aten ops under `event` (ranges excluded)."""
    total = 0.0
    for child in event.cpu_children:
        if not child.name.startswith(WRAPPER_PREFIXES):
            total += child.self_cpu_time_total
        total += _kernel_self_us(child)
    return total


def summary(prof: profile, wall_s: float, tokens: int, top: int) -> dict[str, object]:
    """The JSON summary (see the module docstring) of a profiled generation of `tokens` tokens."""
    events = prof.events()
    ranges = [e for e in events if e.name.startswith("tandem:")]
    parts: dict[str, dict[str, float]] = {}
    for e in ranges:
        part = parts.setdefault(e.name.removeprefix("tandem: "), {"total_ms": 0.0, "calls": 0})
        part["total_ms"] += e.cpu_time_total / 1e3
        part["calls"] += 1
    for part in parts.values():
        part["ms_per_call"] = part["total_ms"] / part["calls"]
    graph = [e for e in ranges if e.name == GRAPH]
    per_step = 1e-3 / max(len(graph), 1)  # µs over the generation -> ms per compiled step
    graph_us = sum(e.cpu_time_total for e in graph)
    kernels_us = sum(_kernel_self_us(e) for e in graph)
    run_us = sum(e.cpu_time_total for e in ranges if e.name == RUN)
    avg = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:top]
    return {
        "tokens": tokens, "compiled_steps": len(graph), "wall_ms_per_token": 1e3 * wall_s / tokens, "parts": parts,
        "graph_kernels_ms": kernels_us * per_step, "graph_wrapper_ms": (graph_us - kernels_us) * per_step,
        "step_outside_graph_ms": (run_us - graph_us) * per_step,
        "top": [{"name": a.key, "self_ms": a.self_cpu_time_total / 1e3, "total_ms": a.cpu_time_total / 1e3,
                 "calls": a.count} for a in avg],
    }


def profile_decode(prompt: str, tokens: int, device: str, top: int) -> dict[str, object]:
    """Profile one compiled single-stream generation (see the module docstring); prints the
    top table to stderr and returns the summary."""
    if torch.device(device).type == "cpu":
        torch._inductor.config.cpp.enable_kernel_profile = True
    llm = LLM(device=device, compile=True, compile_buckets=[1])
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompt, params)  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    with labels(llm), profile(activities=activities) as prof:
        start = time.perf_counter()
        out = llm.generate([prompt], params)
        wall = time.perf_counter() - start
    assert len(out[0].token_ids) == tokens
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top), file=sys.stderr)
    return summary(prof, wall, tokens, top)
