"""Reading a Tandem gateway's /metrics before and after a run: expert hit rate and KV
transfer refusals of the run.  A metric that should be there and is not stops the run: a
zero that was not seen is never reported."""

from __future__ import annotations

import re
import urllib.request

LINE = re.compile(r'^(\w+)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN)$')


def scrape(url: str) -> dict[str, float] | None:
    """`name{labels}` -> value; None when the server has no /metrics (not Tandem)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out if any(k.startswith("tandem_requests_total") for k in out) or "tandem_queue_length" in out else None


class MissingMetric(RuntimeError):
    pass


def _sum(metrics: dict[str, float], name: str) -> float:
    keys = [k for k in metrics if k == name or k.startswith(name + "{")]
    if not keys:
        raise MissingMetric(f"the server's /metrics has no {name}: cannot report it for this run")
    return sum(metrics[k] for k in keys)


def run_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    """Expert hit rate and transfer refusals (by reason) between two scrapes."""
    hits = _sum(after, "tandem_worker_expert_hits") - _sum(before, "tandem_worker_expert_hits")
    misses = _sum(after, "tandem_worker_expert_misses") - _sum(before, "tandem_worker_expert_misses")
    _sum(after, "tandem_worker_kv_used_tokens")       # present whenever workers report
    refusals: dict[str, float] = {}
    for k, v in after.items():
        m = re.match(r'tandem_worker_transfer_refusals\{.*reason="([^"]+)".*\}', k)
        if m:
            refusals[m.group(1)] = refusals.get(m.group(1), 0) + v - before.get(k, 0.0)
    return {"expert_hit_rate": hits / (hits + misses) if hits + misses else None,
            "expert_lookups": hits + misses, "transfer_refusals": refusals}


def _role_sum(metrics: dict[str, float], name: str, role: str) -> float:
    """`name` summed over the workers of `role`; MissingMetric when no such worker reports it."""
    keys = [k for k in metrics if k.startswith(name + "{") and f'role="{role}"' in k]
    if not keys:
        raise MissingMetric(f"the server's /metrics has no {name} of a {role} worker: cannot report it for this run")
    return sum(metrics[k] for k in keys)


def cache_delta(before: dict[str, float], after: dict[str, float], requests: int) -> dict:
    """The decode workers' prefix-cache figures between two scrapes: KV bytes they accepted from
    prefill (total and per request) and their cache's hit share (hit / query prompt tokens).  A
    figure missing before the run counts as 0 (a worker reports from its start, counting from 0,
    once the gateway has read its Stats); missing after it: MissingMetric."""
    def delta(name: str) -> float:
        after_sum = _role_sum(after, name, "decode")
        try:
            return after_sum - _role_sum(before, name, "decode")
        except MissingMetric:
            return after_sum
    kv = delta("tandem_worker_transfer_bytes_accepted")
    hit, query = delta("tandem_worker_cache_hit_tokens"), delta("tandem_worker_cache_query_tokens")
    return {"kv_bytes": kv, "kv_bytes_per_request": kv / requests if requests else None,
            "decode_cache_hit_tokens": hit, "decode_cache_query_tokens": query,
            "decode_cache_hit_share": hit / query if query else None}


def workers_up(metrics: dict[str, float], role: str) -> int:
    """How many workers of `role` answered the gateway's last health check."""
    return sum(1 for k, v in metrics.items()
               if k.startswith("tandem_worker_up{") and f'role="{role}"' in k and v == 1)
