"""`tandem status`: every worker of a running deployment, its node, health, KV usage and
expert hit rate (read from the registry, then from each worker's own `Stats`), as a table or,
with `--json`, as one JSON object for operators and scripts:

    {"workers": [{"worker_id": "decode-0", "role": "decode", "node_ip": "10.0.0.7",
                  "node_id": "...", "address": "10.0.0.7:50052",
                  "transfer_endpoint": "grpc://10.0.0.7:50061", "tls": true,
                  "health": "ok", "running": 0, "draining": false, "requests_drained": 0,
                  "kv_tokens_used": 0, "kv_tokens_capacity": 8192,
                  "expert_hit_rate": 0.93, "expert_formats": ["gptq int4 g128 sym"],
                  "cache_pages": 120, "cache_hit_tokens": 30720,
                  "cache_query_tokens": 40960, "cache_evictions": 0}, ...]}

`expert_formats` names how its MoE layers hold their routed experts (a dtype, or a quantized
format: engine/quant/); `transfer_endpoint` is where prefill pushes KV to a decode worker (null on a prefill worker);
`tls` whether its services run mutual TLS; `health` is "ok" or the gRPC status
name of a worker that did not answer (then the numbers are null); `running` its requests in
the batch now; `draining` whether it is
draining (`tandem drain`, a scale-down, a SIGTERM: it admits nothing new) and
`requests_drained` how many requests its drains ended and the gateway moved on.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import grpc
import ray

from deploy import registry as reg
from deploy.local_ray import keep_loopback
from proto import worker_pb2 as wpb

WorkerReport = dict[str, Any]
ReadStats = Callable[[dict], dict[str, Any]]     # a registry entry -> its live fields


def status(address: str, as_json: bool = False) -> int:
    undo_loopback = keep_loopback(address)     # a local `tandem serve`'s Ray listens on loopback only
    ray.init(address=address, namespace=reg.NAMESPACE, log_to_driver=False,
             logging_level="ERROR")  # type: ignore[arg-type]  # ray takes a level name too (its default is "info")
    try:
        try:
            workers: list[dict] = ray.get(reg.lookup().workers.remote())
        except ValueError:
            print("tandem: no deployment is running on this Ray cluster")
            return 1
        reports = [worker_report(w, read_stats) for w in workers]
        print(format_json(reports) if as_json else format_text(reports))
        return 0
    finally:
        ray.shutdown()
        undo_loopback()


def worker_report(w: dict, stats: ReadStats) -> WorkerReport:
    """One worker's registry entry joined with what `stats` reads from the worker itself."""
    return {"worker_id": w["worker_id"], "role": w["role"], "node_ip": w.get("node_ip"),
            "node_id": w.get("node_id"), "address": w["address"],
            "transfer_endpoint": w.get("transfer_endpoint"), "tls": w.get("tls"), **stats(w)}


def read_stats(w: dict) -> dict[str, Any]:
    """The worker's health, KV tokens used/capacity and expert hit rate, from its `Stats` RPC.
    Every worker RPC needs the cluster secret, which this driver does not hold: the worker's
    own actor (named `tandem-WORKER_ID`) makes the call and returns the reply."""
    try:
        actor = ray.get_actor(f"tandem-{w['worker_id']}", namespace=reg.NAMESPACE)
        s = wpb.StatsReply.FromString(ray.get(actor.stats.remote(), timeout=10))
        hits, misses = sum(e.hits for e in s.experts), sum(e.misses for e in s.experts)
        return {"health": "ok", "running": s.running, "draining": s.draining, "requests_drained": s.requests_drained,
                "kv_tokens_used": s.kv_tokens_used, "kv_tokens_capacity": s.kv_tokens_capacity,
                "expert_hit_rate": hits / (hits + misses) if hits + misses else None,
                "expert_formats": sorted({e.format for e in s.experts}),
                "cache_pages": s.kv_pages_cached, "cache_hit_tokens": s.cache_hit_tokens,
                "cache_query_tokens": s.cache_query_tokens, "cache_evictions": s.cache_evictions}
    except Exception as e:  # no such actor, the actor or the worker does not answer
        cause = getattr(e, "cause", None) or e        # a RayTaskError carries the grpc.RpcError
        code = cause.code().name.lower() if isinstance(cause, grpc.RpcError) else type(cause).__name__.lower()
        return {"health": code, "running": None, "draining": None, "requests_drained": None,
                "kv_tokens_used": None, "kv_tokens_capacity": None,
                "expert_hit_rate": None, "expert_formats": None, "cache_pages": None, "cache_hit_tokens": None,
                "cache_query_tokens": None, "cache_evictions": None}


def format_json(reports: list[WorkerReport]) -> str:
    return json.dumps({"workers": reports}, indent=2)


def format_text(reports: list[WorkerReport]) -> str:
    lines = [f"{'worker':14s} {'role':10s} {'node':15s} {'address':22s} {'health':8s} {'draining':8s} "
             f"{'KV used/capacity':>22s} "
             f"{'expert hit rate':>15s} {'cache pages':>11s} {'cache hit/query tokens':>24s} {'evictions':>9s} "
             "experts"]
    for r in reports:
        kv = f"{r['kv_tokens_used']}/{r['kv_tokens_capacity']}" if r["kv_tokens_capacity"] is not None else "-"
        rate = f"{r['expert_hit_rate']:.3f}" if r["expert_hit_rate"] is not None else "-"
        known = r.get("cache_pages") is not None
        pages = str(r["cache_pages"]) if known else "-"
        hits = f"{r['cache_hit_tokens']}/{r['cache_query_tokens']}" if known else "-"
        evicted = str(r["cache_evictions"]) if known else "-"
        draining = "-" if r.get("draining") is None else "yes" if r["draining"] else "no"
        lines.append(f"{r['worker_id']:14s} {r['role']:10s} {r['node_ip'] or '-':15s} {r['address']:22s} "
                     f"{r['health'][:8]:8s} {draining:8s} {kv:>22s} {rate:>15s} {pages:>11s} {hits:>24s} {evicted:>9s} "
                     f"{', '.join(r.get('expert_formats') or []) or '-'}")
    return "\n".join(lines)
