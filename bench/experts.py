"""Paged experts against all-resident experts and plain weight streaming.

    python -m bench.experts [--json] [--copy-cost-ratio 7 | --link-gbps X] [--tokens 64]
    python -m bench.experts --device cuda [--json]     # the real link, no emulation
    python -m bench.experts --format fp8,int4,mxfp4 [--json]   # quantized experts against bf16

With `--device cuda` nothing is emulated: experts are paged from pinned host memory over the
real link (CUDA copy streams, prefetch on and off), the link's pinned host-to-device bandwidth B is
measured in the same run, and paged decode is compared with the bound that link alone sets:
B / (L * k * miss rate * expert bytes) tokens/s for L MoE layers, top-k experts per token
(see `device_run`).

On a CPU-only machine a host-to-device copy is a memcpy that costs almost nothing, the
opposite of a GPU behind PCIe, so the link is emulated: every page-in (and prefetch)
holds one emulated link for bytes / bandwidth, in every mode alike; a wait blocks until
the copy's end time on the link's timeline, so compute in between really overlaps it.
By default the bandwidth makes copying all routed experts of one token take
`--copy-cost-ratio` times the all-resident decode step measured in this run.

Modes (decode only; prompts are held-out standard-library text, never random ids):
  resident     every expert on the device
  paged        K in {E/8, E/4, E/2} resident slots, LRU, demand paging (the CPU default);
               at K = E/4 also with the next-layer prefetcher (`"prefetch": true`)
  stream_all   no cache: every routed expert copied at every step (plain offload)

With `--format`, the shipped model is written in each quantized layout (routed experts only:
engine/quant/pack.py) and every format runs at the same emulated link, calibrated once from
the bf16 run (bf16 compute and bf16 experts are the baseline, never the fp32 default):
resident, paged at K = E/4 and stream_all at batch 1 (see `format_run`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from engine import LLM, SamplingParams, corpus
from engine.config import SHIPPED_MODEL as SHIPPED
from engine.experts import EmulatedLink
from engine.experts.preflight import measure_link

BATCHES = (1, 4, 16)


def natural_prompts(llm: LLM, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens from held-out stdlib files (one per file, in order)."""
    _, held = corpus.read_split()
    prompts = []
    for text in held:
        ids = llm.tokenizer.encode(text)
        if len(ids) > 4 * length:
            mid = len(ids) // 2
            prompts.append(ids[mid:mid + length])
        if len(prompts) == count:
            return prompts
    raise RuntimeError(f"held-out text gave only {len(prompts)} prompts of {length} tokens")


def counters(llm: LLM) -> dict[str, int]:
    total: dict[str, int] = {}
    for stats in llm.expert_stats().values():
        for key in ("hits", "misses", "bytes_paged", "waves", "steps", "prefetched", "prefetch_hits"):
            total[key] = total.get(key, 0) + stats[key]
    return total


def decode_rate(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, dict[str, int], int]:
    """Prefill every prompt, then time the decode steps alone.

    Returns (aggregate tokens/s, expert counters over the decode steps, decode steps)."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for p in prompts:
        llm.add_request(p, params)
    while any(r.prefilling for r in llm.scheduler.running) or llm.scheduler.waiting:
        llm.step()
    before, steps, produced = counters(llm), 0, 0
    start = time.perf_counter()
    while llm.scheduler.has_work():
        produced += len(llm.scheduler.running)
        llm.step()
        steps += 1
    elapsed = time.perf_counter() - start
    after = counters(llm)
    return produced / elapsed, {k: after.get(k, 0) - before.get(k, 0) for k in after}, steps


def build(mode: str, k: int | None, link: EmulatedLink | None, prefetch: bool = False,
          device: str = "cpu", **engine: Any) -> LLM:
    """An engine for one mode (resident, paged or stream_all); paged modes copy over `link` when
    given.  `engine`: more EngineConfig fields (model, dtype)."""
    llm = LLM(paged_experts_num_resident=k, paged_experts_prefetch=prefetch and mode == "paged", device=device,
              **engine)
    for experts in llm.paged_experts().values():
        experts.cache = mode != "stream_all"
        if link is not None:            # paged modes run behind the emulated link
            experts.slots.copier = link
    return llm


def median_trial(trials: list[tuple[float, dict[str, int], int]]) -> tuple[float, dict[str, int], int]:
    return sorted(trials, key=lambda r: r[0])[len(trials) // 2]


def row(llm: LLM, mode: str, batch: int, trial: tuple[float, dict[str, int], int]) -> dict[str, Any]:
    """One run's figures from its (tokens/s, expert counters, decode steps)."""
    rate, c, steps = trial
    looked = c.get("hits", 0) + c.get("misses", 0)
    return {"mode": mode, "K": llm.config.paged_experts_num_resident or llm.model_config.num_experts,
            "batch": batch, "prefetch": bool(llm.config.paged_experts_prefetch),
            "tok_s": rate, "hit_rate": c["hits"] / looked if looked else 1.0,
            "bytes_per_token": c.get("bytes_paged", 0) / max(1, steps * batch),
            "waves_per_step": c["waves"] / c["steps"] if c.get("steps") else 1.0,
            "prefetch_hit_rate": c.get("prefetch_hits", 0) / c["prefetched"] if c.get("prefetched") else None}


def run_mode(mode: str, k: int | None, batch: int, prompts: list[list[int]], tokens: int,
             link: EmulatedLink | None, prefetch: bool = False, repeats: int = 3, **engine: Any) -> dict[str, Any]:
    llm = build(mode, k, link, prefetch, **engine)
    decode_rate(llm, prompts[:batch], 4)  # warm-up: caches and allocator, not timed
    return row(llm, mode, batch, median_trial([decode_rate(llm, prompts[:batch], tokens) for _ in range(repeats)]))


def device_run(device: str, batches: tuple[int, ...] = (1, 16), tokens: int = 64, prompt_tokens: int = 32,
               repeats: int = 5, h2d_mib: int = 256) -> dict[str, Any]:
    """Resident against paged (K = E/4, CUDA copy streams, prefetch on and off) on a real device,
    the runs of one batch interleaved (resident, paged, paged without prefetch, again) so drift
    in the machine hits all alike; each figure is the median of `repeats`.

    The link bound: at hit rate h a token misses L * k * (1 - h) experts, so a link of B bytes/s
    caps decode at B / (L * k * (1 - h) * expert bytes) tokens/s per sequence (None: no misses);
    `link_bound_tok_s` is B over the bytes the batch really paged per token (prefetches included).
    `paged_overhead_ms_per_step`: how much longer a paged decode step took than a resident one."""
    probe = LLM(device=device)
    cfg = probe.model_config
    e, top_k, layers = cfg.num_experts, cfg.num_experts_per_tok, len(cfg.moe_layers)
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * probe.model.embed.element_size()
    prompts = natural_prompts(probe, max(batches), prompt_tokens)
    del probe
    bandwidth, how = measure_link(device, h2d_mib << 20, repeats)    # best of `repeats` pinned copies
    engines = {"resident": build("resident", None, None, device=device),
               "paged": build("paged", e // 4, None, prefetch=True, device=device),
               "paged_no_prefetch": build("paged", e // 4, None, prefetch=False, device=device)}
    runs, summary = [], {}
    for b in batches:
        trials: dict[str, list] = {name: [] for name in engines}
        for llm in engines.values():
            decode_rate(llm, prompts[:b], 4)        # warm-up, not timed
        for _ in range(repeats):
            for name, llm in engines.items():
                trials[name].append(decode_rate(llm, prompts[:b], tokens))
        res, paged, plain = (row(llm, "resident" if n == "resident" else "paged", b, median_trial(trials[n]))
                             for n, llm in engines.items())
        runs += [res, paged, plain]
        miss = 1.0 - paged["hit_rate"]
        summary[f"b{b}"] = {
            "paged_vs_resident": paged["tok_s"] / res["tok_s"], "hit_rate": paged["hit_rate"],
            "paged_no_prefetch_vs_resident": plain["tok_s"] / res["tok_s"],
            "paged_tok_s": paged["tok_s"], "resident_tok_s": res["tok_s"],
            "paged_overhead_ms_per_step": (b / paged["tok_s"] - b / res["tok_s"]) * 1e3,
            "link_bound_tok_s_per_seq": bandwidth / (layers * top_k * miss * expert_bytes) if miss > 0 else None,
            "link_bound_tok_s": bandwidth / paged["bytes_per_token"] if paged["bytes_per_token"] else None}
    return {"device": device, "emulated": False, "num_experts": e, "top_k": top_k, "moe_layers": layers,
            "expert_bytes": expert_bytes, "K": e // 4, "h2d_pinned_gbps": bandwidth / 1e9, "link_measured_by": how,
            "tokens": tokens, "repeats": repeats, "units": "GB/s (1e9 bytes/s)", "runs": runs, "summary": summary}


# --format names -> the layouts written (engine/quant/presets.py)
FORMATS = {"fp8": "fp8-block", "int4": "gptq-int4", "mxfp4": "mxfp4", "awq": "awq-int4", "int8": "gptq-int8"}


def store_bytes(llm: LLM) -> tuple[int, int]:
    """(bytes of one routed expert, all MoE layers' host stores) as the engine holds them."""
    stores = [e.slots.store for e in llm.paged_experts().values()]
    return stores[0].bytes_per_expert, sum(s.bytes_per_expert * s.num_experts for s in stores)


def format_run(formats: list[str], tokens: int, prompt_tokens: int, ratio: float, repeats: int = 7) -> dict[str, Any]:
    """bf16 experts, then each format's, at one emulated link: its bandwidth makes copying every
    routed expert of one token take `ratio` times the bf16 resident decode step of this run
    (bf16 bytes; the same link for every format, never recalibrated).  Per format at batch 1:
    resident, paged (K = E/4) and stream_all, bytes per expert and the host store.  Every engine
    is built first and the runs alternate between them, `repeats` rounds, so drift in a shared
    machine hits all alike; each figure is the median of its rounds."""
    import tempfile

    from engine.quant.pack import quantize_checkpoint
    from engine.quant.presets import preset
    probe = LLM(dtype="bfloat16", compile=False)
    cfg = probe.model_config
    e, quarter = cfg.num_experts, cfg.num_experts // 4
    prompts = natural_prompts(probe, 1, prompt_tokens)
    del probe
    out: dict[str, Any] = {"formats": {}, "summary": {}}
    with tempfile.TemporaryDirectory() as tmp:
        models = {"bf16": str(SHIPPED)}
        for name in formats:
            models[name] = f"{tmp}/{name}"
            quantize_checkpoint(SHIPPED, models[name], preset(FORMATS[name]))
        settings: dict[str, dict[str, Any]] = {
            name: {"model": path, "dtype": "bfloat16", "compile_buckets": (1,)} for name, path in models.items()}
        engines = {(name, "resident"): build("resident", None, None, **kw) for name, kw in settings.items()}
        base = engines[("bf16", "resident")]
        decode_rate(base, prompts, 4)
        step_s = 1 / median_trial([decode_rate(base, prompts, tokens) for _ in range(3)])[0]
        per_expert, _ = store_bytes(build("paged", quarter, None, **{**settings["bf16"], "compile": False}))
        token_bytes = len(cfg.moe_layers) * cfg.num_experts_per_tok * per_expert
        link = EmulatedLink(token_bytes / (ratio * step_s))     # calibrated on bf16, kept for every format
        for name, kw in settings.items():
            engines[(name, "paged")] = build("paged", quarter, link, **kw)
            engines[(name, "stream_all")] = build("stream_all", quarter, link, **kw)
        trials: dict[tuple[str, str], list] = {key: [] for key in engines}
        for llm in engines.values():
            decode_rate(llm, prompts, 4)                        # warm-up, not timed
        for _ in range(repeats):
            for key, llm in engines.items():
                trials[key].append(decode_rate(llm, prompts, tokens))
        for name, kw in settings.items():
            resident, paged, stream = (row(engines[(name, m)], m, 1, median_trial(trials[(name, m)]))
                                       for m in ("resident", "paged", "stream_all"))
            per_expert, host = store_bytes(build("paged", quarter, None, **{**kw, "compile": False}))
            out["formats"][name] = {
                "layout": "bf16" if name == "bf16" else FORMATS[name], "bytes_per_expert": per_expert,
                "host_store_bytes": host, "hit_rate": paged["hit_rate"], "resident_tok_s": resident["tok_s"],
                "paged_tok_s": paged["tok_s"], "stream_all_tok_s": stream["tok_s"],
                "paged_vs_resident": paged["tok_s"] / resident["tok_s"],
                "paged_vs_stream_all": paged["tok_s"] / stream["tok_s"]}
    bf16 = out["formats"]["bf16"]
    for name in formats:
        f = out["formats"][name]
        out["summary"][f"{name}_vs_bf16_paged_vs_resident"] = f["paged_vs_resident"] / bf16["paged_vs_resident"]
        out["summary"][f"{name}_host_store_ratio"] = f["host_store_bytes"] / bf16["host_store_bytes"]
        out["summary"][f"{name}_resident_vs_bf16_resident"] = f["resident_tok_s"] / bf16["resident_tok_s"]
        out["summary"][f"{name}_paged_vs_bf16_paged"] = f["paged_tok_s"] / bf16["paged_tok_s"]
    out.update({"num_experts": e, "K": quarter, "batch": 1, "copy_cost_ratio": ratio, "emulated": True,
                "link_gbps": link.bytes_per_s * 8 / 1e9, "resident_step_ms_bf16": step_s * 1e3,
                "dtype": "bfloat16", "tokens": tokens, "repeats": repeats})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cpu", help="cuda: real pinned copies, no link emulation")
    ap.add_argument("--copy-cost-ratio", type=float, default=7.0)
    ap.add_argument("--link-gbps", type=float, default=None, help="fix the emulated link instead")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed per run (median of 3 runs)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--format", default=None,
                    help=f"comma-separated quantized formats to compare with bf16 experts: {', '.join(FORMATS)}")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.format:
        names = args.format.split(",")
        if unknown := [n for n in names if n not in FORMATS]:
            ap.error(f"--format {','.join(unknown)}: choose from {', '.join(FORMATS)}")
        print(json.dumps(format_run(names, args.tokens, args.prompt_tokens, args.copy_cost_ratio),
                         indent=2 if args.json else None))
        return
    if args.device != "cpu":
        result = device_run(args.device, tokens=args.tokens, prompt_tokens=args.prompt_tokens)
        print(json.dumps(result, indent=2 if args.json else None))
        return
    probe = LLM()
    cfg = probe.model_config
    e, top_k = cfg.num_experts, cfg.num_experts_per_tok
    prompts = natural_prompts(probe, 16, args.prompt_tokens)
    runs = [run_mode("resident", None, b, prompts, args.tokens, None) for b in BATCHES]
    expert_bytes = (3 * cfg.hidden_size * cfg.moe_intermediate_size) * probe.model.embed.element_size()
    token_bytes = len(cfg.moe_layers) * top_k * expert_bytes
    step_s = 1.0 / runs[0]["tok_s"]
    bytes_per_s = args.link_gbps * 1e9 / 8 if args.link_gbps else token_bytes / (args.copy_cost_ratio * step_s)
    link = EmulatedLink(bytes_per_s)
    quarter = e // 4
    cap_batch = quarter // top_k
    for k in (e // 8, quarter, e // 2):
        batches = sorted(set(BATCHES) | ({cap_batch, 2 * cap_batch + 1} if k == quarter else set()))
        runs += [run_mode("paged", k, b, prompts, args.tokens, link) for b in batches]
    runs += [run_mode("stream_all", quarter, b, prompts, args.tokens, link) for b in BATCHES]
    runs += [run_mode("paged", quarter, b, prompts, args.tokens, link, prefetch=True) for b in (1, 4)]

    def find(mode: str, k: int | None, b: int) -> dict[str, Any]:
        return next(r for r in runs if r["mode"] == mode and r["batch"] == b and (k is None or r["K"] == k)
                    and not r["prefetch"])
    paged_b1 = find("paged", quarter, 1)
    result = {
        "num_experts": e, "top_k": top_k, "link_gbps": bytes_per_s * 8 / 1e9, "emulated": True,
        "copy_cost_ratio": None if args.link_gbps else args.copy_cost_ratio,
        "resident_step_ms_b1": step_s * 1e3, "runs": runs,
        "summary": {
            "hit_rate_b1": paged_b1["hit_rate"],
            "paged_vs_resident_b1": paged_b1["tok_s"] / find("resident", None, 1)["tok_s"],
            "paged_vs_stream_all_b1": paged_b1["tok_s"] / find("stream_all", quarter, 1)["tok_s"],
            "no_cliff_ratio": find("paged", quarter, 2 * cap_batch + 1)["tok_s"]
            / find("paged", quarter, cap_batch)["tok_s"],
            "no_overlap_bound_b1": 1 / (1 + args.copy_cost_ratio * (1 - paged_b1["hit_rate"])),
            "paged_with_prefetch_vs_resident_b1": next(
                r for r in runs if r["prefetch"] and r["batch"] == 1)["tok_s"] / find("resident", None, 1)["tok_s"],
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"link {result['link_gbps']:.3f} Gbit/s (emulated), resident step {step_s * 1e3:.2f} ms")
    for r in runs:
        print(f"{r['mode']:10s} K={r['K']:3d} batch={r['batch']:2d} {r['tok_s']:8.1f} tok/s "
              f"hit {r['hit_rate']:.3f} bytes/token {r['bytes_per_token']:10.0f} waves/step {r['waves_per_step']:.2f}")
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
