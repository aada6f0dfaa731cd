"""`bench.serve --prefix-compare`: the prefix cache measured, in one invocation, on the
shared-prefix workload (bench.serve_workloads.SharedPrefix: by default 16 system prompts of
1,024 tokens, each request one of them round robin plus a unique 64-token question, 64 output
tokens, 256 requests at concurrency 8).  Tandem is started four times, disaggregated, with one
prefill worker:

    cache_off       one decode worker, --no-prefix-cache
    cache_on        one decode worker, the cache on (the default)
    prefix_routing  two decode workers, --routing prefix
    load_routing    two decode workers, --routing load

With one decode worker every pool holds all the prefixes besides the running requests; with two,
each holds about half of them, so where a request lands decides whether its prefix is there
(SharedPrefix.compare_pools: --kv-cache-tokens sizes the decode workers' pools).  The prefill
worker's pool holds every prefix in every run (--prefill-kv-cache-tokens), so the runs differ in
the decode side only: a prefill pool of the decode workers' size would miss on every request of
a round-robin over more prefixes than it holds, and its recomputation, not the decode worker's
cache or the routing, would set the two-worker runs' TTFT.  Every run sends the same prompts,
as token ids.

Per run: the load statistics, the cached-token share of the responses (usage
prompt_tokens_details.cached_tokens over prompt tokens) and the KV bytes the decode workers
accepted per request (tandem_worker_transfer_bytes_accepted, from /metrics before and after)."""

from __future__ import annotations

import argparse
import signal
import time
from dataclasses import asdict, dataclass

from bench.serve_compare import start_tandem
from bench.serve_load import Target
from bench.serve_metrics import MissingMetric, cache_delta, scrape, workers_up
from bench.serve_prompts import PromptMaker
from bench.serve_turns import run_workload
from bench.serve_workloads import PAGE_SIZE, SharedPrefix

STATS_WAIT_S = 2.5      # the gateway copies each worker's Stats every second
READY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class PrefixRun:
    name: str
    decode_workers: int
    prefix_cache: bool
    routing: str | None      # None: the default (one decode worker: nothing to choose)


RUNS = (PrefixRun("cache_off", 1, False, None), PrefixRun("cache_on", 1, True, None),
        PrefixRun("prefix_routing", 2, True, "prefix"), PrefixRun("load_routing", 2, True, "load"))

# summary key -> the value it must reach (prefix_routing_over_least_load: prefix_routing_hit_rate
# over least_load_hit_rate)
TARGETS = {"prefix_ttft_p50_ratio": 3.0, "prefix_kv_bytes_ratio": 5.0, "prefix_routing_hit_rate": 0.8,
           "prefix_routing_over_least_load": 1.5}


def serve_flags(run: PrefixRun, workload: SharedPrefix, pools: dict[str, int]) -> list[str]:
    """`tandem serve` flags of one run (--max-model-len: the workload's request, so that the
    pools of small workloads pass the start-up check against the model's context)."""
    kv = pools["one_decode_worker"] if run.decode_workers == 1 else pools["per_decode_worker"]
    flags = ["--prefill-workers", "1", "--decode-workers", str(run.decode_workers), "--kv-cache-tokens", str(kv),
             "--prefill-kv-cache-tokens", str(pools["one_decode_worker"]),
             "--max-model-len", str(workload.request_tokens)]
    if not run.prefix_cache:
        flags.append("--no-prefix-cache")
    if run.routing is not None:
        flags += ["--routing", run.routing]
    return flags


def wait_ready(url: str, decode_workers: int, timeout_s: float = READY_TIMEOUT_S) -> dict[str, float]:
    """Polls /metrics until the gateway has seen the prefill and every decode worker healthy
    (so that routing has all of them from the first request); returns that scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(url)
        if metrics is None:
            raise MissingMetric(f"{url}/metrics did not answer (an admin key in the environment?)")
        if workers_up(metrics, "decode") >= decode_workers and workers_up(metrics, "prefill") >= 1:
            return metrics
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway at {url} did not see 1 prefill and {decode_workers} decode "
                               f"worker(s) healthy within {timeout_s:.0f}s")
        time.sleep(0.5)


def measure_run(run: PrefixRun, workload: SharedPrefix, prompts: list[list[int]], pools: dict[str, int],
                maker: PromptMaker, args: argparse.Namespace, slo: tuple[float, float]) -> dict:
    flags = serve_flags(run, workload, pools)
    proc, url = start_tandem(flags)
    try:
        before = wait_ready(url, run.decode_workers)
        target = Target(url, args.model, None, False, args.timeout)
        row = run_workload(target, workload, prompts, maker.tok, run.name, slo)
        time.sleep(STATS_WAIT_S)
        row.update(cache_delta(before, scrape(url) or {}, workload.requests))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    return {**row, "decode_workers": run.decode_workers, "prefix_cache": run.prefix_cache,
            "routing": run.routing or "prefix", "kv_cache_tokens": int(flags[flags.index("--kv-cache-tokens") + 1]),
            "serve_flags": flags}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summary(runs: dict[str, dict]) -> dict:
    """The issue's four figures from the runs by name, the targets, and whether each was met
    (None: a figure the server did not report).  prefix_routing_over_least_load is met when the
    prefix-routed share is at least 1.5x the load-routed one (a load-routed share of 0 included)."""
    off, on, pre, load = (runs[r.name] for r in RUNS)
    hit, least = pre.get("cached_share"), load.get("cached_share")
    s: dict = {"prefix_ttft_p50_ratio": _ratio(off.get("ttft_p50_ms"), on.get("ttft_p50_ms")),
               "prefix_kv_bytes_ratio": _ratio(off.get("kv_bytes_per_request"), on.get("kv_bytes_per_request")),
               "prefix_routing_hit_rate": hit, "least_load_hit_rate": least,
               "prefix_routing_over_least_load": _ratio(hit, least)}
    met: dict[str, bool | None] = {k: None if s[k] is None else s[k] >= t for k, t in TARGETS.items()}
    if hit is not None and least is not None:
        met["prefix_routing_over_least_load"] = hit >= TARGETS["prefix_routing_over_least_load"] * least
    errors = sum(int(r.get("errors") or 0) for r in runs.values())
    return {**s, "targets": dict(TARGETS), "met": met, "errors": errors,
            "all_met": errors == 0 and all(m is True for m in met.values())}


def prefix_compare(args: argparse.Namespace, maker: PromptMaker, workload: SharedPrefix,
                   slo: tuple[float, float]) -> dict:
    pools = workload.compare_pools(decode_workers=2, held=args.held_prefixes)
    prompts = workload.prompts(maker)            # the same prompts for every run
    runs = {r.name: measure_run(r, workload, prompts, pools, maker, args, slo) for r in RUNS}
    return {"url": "tandem serve (started four times)",
            "workload": {"name": "shared-prefix", **asdict(workload), "prompt_len": workload.prompt_len,
                         "request_tokens": workload.request_tokens, "page_size": PAGE_SIZE,
                         "kv_cache_tokens": pools},
            "runs": list(runs.values()), "summary": summary(runs)}
