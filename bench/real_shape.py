"""Paged experts at Qwen3-30B-A3B's published MoE shape against the link's bound (issue 40, item 5).

    python -m bench.real_shape --json [--device cuda] [--layers N] [--tiny] [--steps 16]

The shape is read from models/published/qwen3-30b-a3b/config.json: 128 experts, top-8, hidden
2048, expert intermediate 768, bf16 (9.4 MB an expert), 48 MoE layers.  Weights are random; each
layer is built with engine/experts (bench/real_shape_layers.py).  Only the MoE part is modelled:
a step is every layer's router and experts over the batch's hidden states; attention, norms,
embeddings and the LM head are left out.  All 48 layers need 58 GB of host store, so by default
8 layers run at the real per-layer shape (fewer when the host's available memory cannot hold
them twice over; `--layers` chooses); the JSON says `layers_run` and `layers_published`, and the
tok/s and bounds are those of the layers run.

Routing is the shipped model's, recorded (bench/expert_trace.py, bench/data/expert_trace.json)
and mapped onto 128 experts top-8: shipped expert e -> (2e, 2e+1), shipped layer l mod 6.  The
trace's ids are given to `PagedExperts` directly (no router decides them), so the locality is
the recorded one.

K: as `tandem preflight --memory-gib 16` chooses it for the published config (its
`recommended_k`), and 24, 40, 92 (SGLang's published table).  Batches 1, 4, 16, and K // top_k
and the one above it (for `no_cliff_ratio`).  Each point runs on fresh slots with the plan the
engine's compiled step would use: the device decision where batch * top_k <= K (a single wave
whatever the routing), else the host plan; single-wave points also run the host plan, for
comparison.  Per point:
  tok_s            batch tokens over the timed steps' seconds
  misses_per_step  the layers' ExpertCounters, summed over layers
  bound_tok_s      link_GBps / (misses per token x expert bytes), the misses from a reference
                   LRU over the same trace (bench.expert_trace.reference_lru_misses), so paging
                   more than LRU needs cannot raise the ratio
  ratio_to_bound   tok_s / bound_tok_s (None when the reference misses nothing)
  host_syncs_per_step  counted with torch's sync debug mode (CUDA; None on CPU)
The link is one timed pinned host-to-device copy (best of 3; `measure_link`; on CPU a memcpy).
Per K the summary has `no_cliff_ratio` = tok/s at batch K // top_k + 1 over tok/s at batch
K // top_k, both measured (where K // top_k + 1 exceeds the trace's 16 sequences, the two
largest batches the trace allows).

`--tiny`: hidden and intermediate / 64, 2 layers, a few steps: seconds on a CPU, for tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.expert_trace import TRACE, Trace, load
from bench.real_shape_layers import MoeShape, StepCounts, random_stores, run_point, synchronize
from engine.experts.preflight import measure_link, preflight

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "models" / "published" / "qwen3-30b-a3b" / "config.json"
SGLANG_K = (24, 40, 92)
BATCHES = (1, 4, 16)
DEFAULT_LAYERS = 8
TINY_FACTOR = 64
PREFLIGHT_GIB = 16.0


def published_shape(path: Path = PUBLISHED) -> MoeShape:
    cfg = json.loads(path.read_text())
    return MoeShape(cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"],
                    cfg["moe_intermediate_size"])


def available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def layers_to_run(shape: MoeShape, asked: int | None) -> tuple[int, str]:
    """How many layers' host stores to build, and why that many."""
    per_layer = shape.num_experts * shape.expert_bytes
    want = min(asked or DEFAULT_LAYERS, shape.layers)
    why = "--layers" if asked else f"the default ({DEFAULT_LAYERS} of {shape.layers})"
    free = available_host_bytes()
    if free is not None and want * per_layer * 2 > free:
        fit = max(1, free // (2 * per_layer))
        return int(fit), f"{why} cut to what {free / 2**30:.0f} GiB of available host memory holds twice over"
    return want, why


def k_choices(shape: MoeShape, link_bytes_per_s: float) -> tuple[int | None, list[int]]:
    """(preflight's K for a 16 GiB card, or None without the published config; every K to run)."""
    pre = None
    if PUBLISHED.exists():
        pre = preflight(PUBLISHED.parent, PREFLIGHT_GIB, dtype="bfloat16", device="cpu",
                        link_bytes_per_s=link_bytes_per_s)["recommended_k"]
    ks = sorted({k for k in (pre, *SGLANG_K) if k is not None and shape.top_k <= k <= shape.num_experts})
    return pre, ks


def batches_for(k: int, top_k: int, sequences: int) -> tuple[list[int], tuple[int, int]]:
    """The batches to measure at K, and the pair (K // top_k, the one above) no_cliff_ratio compares."""
    cap = min(k // top_k, sequences - 1)
    pair = (cap, cap + 1)
    return sorted({b for b in (*BATCHES, *pair) if 1 <= b <= sequences}), pair


def plans_for(k: int, batch: int, top_k: int) -> list[str]:
    """The engine's plan first (device where a single wave is certain), then the host's for comparison."""
    return ["device", "host"] if batch * top_k <= k else ["host"]


def measure(device: str = "cpu", layers: int | None = None, tiny: bool = False,
            steps: int | None = None) -> dict[str, Any]:
    """Every point (see the module doc); returns the JSON's contents."""
    t0 = time.monotonic()
    dev = torch.device(device)
    real = published_shape() if PUBLISHED.exists() else MoeShape(48, 128, 8, 2048, 768)
    shape = real.scaled(TINY_FACTOR) if tiny else real
    run_layers, why = (2, "--tiny") if tiny else layers_to_run(shape, layers)
    counts = StepCounts(2, steps or 4, 0) if tiny else StepCounts(4, steps or 16, 2 if dev.type == "cuda" else 0)
    trace = load(TRACE)
    link, how = measure_link(device, (16 if tiny else 256) << 20, 3)
    pre_k, ks = k_choices(real, link)
    stores, routers = random_stores(shape, run_layers, dev)
    synchronize(dev)
    setup_s = time.monotonic() - t0
    points = []
    for k in ks:
        for b in batches_for(k, shape.top_k, trace.sequences)[0]:
            for plan in plans_for(k, b, shape.top_k):
                points.append(run_point(stores, routers, shape, trace, k, b, plan, counts, dev, link))
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    return {**header(dev, shape, real, trace, tiny), "layers_run": run_layers, "layers_reason": why,
            "host_store_bytes": run_layers * shape.num_experts * shape.expert_bytes,
            "h2d_pinned_gbps": link / 1e9, "link_measured_by": how, "units": "GB/s = 1e9 bytes/s",
            "K_preflight_16gib": pre_k, "K_sglang": list(SGLANG_K), "Ks": ks,
            "steps_per_point": {"warmup": counts.warmup, "timed": counts.timed, "sync_counted": counts.sync},
            "points": points, "summary": summarize(points, ks, shape.top_k, trace.sequences),
            "setup_s": setup_s, "seconds": time.monotonic() - t0}


def header(dev: torch.device, shape: MoeShape, real: MoeShape, trace: Trace, tiny: bool) -> dict[str, Any]:
    """What ran: the device, the shape (and the published one), the trace and its mapping."""
    f = shape.num_experts // trace.num_experts
    return {
        "device": str(dev), "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "tiny": tiny, "dtype": str(shape.dtype).removeprefix("torch."),
        "shape": {"num_experts": shape.num_experts, "top_k": shape.top_k, "hidden": shape.hidden,
                  "intermediate": shape.intermediate, "published_hidden": real.hidden,
                  "published_intermediate": real.intermediate},
        "layers_published": real.layers, "expert_bytes": shape.expert_bytes,
        "attention": "left out: a step is the MoE layers only (router + paged experts)",
        "expert_compute": "gathered plan, gathered_all uncompiled (as the compiled decode step sets paged experts)",
        "trace": {"file": str(TRACE.relative_to(ROOT)), "model": trace.model, "num_experts": trace.num_experts,
                  "top_k": trace.top_k, "layers": trace.layers, "sequences": trace.sequences, "steps": trace.steps,
                  "mapping": f"expert e -> the {f} experts {f}e..{f}e+{f - 1}; layer l -> trace layer l mod "
                             f"{trace.layers}; batch b = sequences 0..b-1 at the same step"},
    }


def summarize(points: list[dict[str, Any]], ks: list[int], top_k: int, sequences: int) -> dict[str, Any]:
    """Per K ("K24", ...): the engine's plan's tok/s and ratio to the bound at batches 1, 4, 16,
    batch 4 over batch 1, no_cliff_ratio and host syncs per step at batch 1."""
    out: dict[str, Any] = {}
    for k in ks:
        chosen = {p["batch"]: p for p in points if p["K"] == k and p["plan"] == plans_for(k, p["batch"], top_k)[0]}
        _, (lo, hi) = batches_for(k, top_k, sequences)
        s: dict[str, Any] = {f"{key}_b{b}": chosen[b][key] for b in BATCHES if b in chosen
                             for key in ("tok_s", "ratio_to_bound", "plan")}
        s["b4_over_b1"] = chosen[4]["tok_s"] / chosen[1]["tok_s"] if 4 in chosen and 1 in chosen else None
        s["no_cliff_ratio"] = chosen[hi]["tok_s"] / chosen[lo]["tok_s"] if lo in chosen and hi in chosen else None
        s["no_cliff_batches"] = [lo, hi]
        s["host_syncs_per_step_b1"] = chosen[1]["host_syncs_per_step"] if 1 in chosen else None
        s["misses_match_reference"] = all(p["misses_match_reference"] for p in points if p["K"] == k)
        out[f"K{k}"] = s
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the whole JSON (else the summary)")
    ap.add_argument("--device", default="cpu", help="cuda: pinned host store, CUDA copy streams, the real link")
    ap.add_argument("--layers", type=int, default=None, help=f"MoE layers to build (default {DEFAULT_LAYERS})")
    ap.add_argument("--tiny", action="store_true", help=f"hidden and intermediate / {TINY_FACTOR}, 2 layers")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per point (default 16; tiny 4)")
    ap.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure(args.device, args.layers, args.tiny, args.steps)
    print(json.dumps(result if args.json else result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
