"""Per-level statistics of a load run: latency percentiles, throughput, goodput."""

from __future__ import annotations

from collections.abc import Sequence

from bench.http_stream import StreamResult


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000


def summarize(results: Sequence[StreamResult], wall_s: float, slo_ttft_ms: float,
              slo_itl_ms: float) -> dict[str, float | None]:
    """TTFT, ITL (every gap between text chunks, pooled), TPOT ((e2e - ttft) / (tokens - 1) per
    request), e2e; output tokens/s and requests/s over the level's wall time; goodput: requests/s
    whose TTFT and TPOT both meet the SLOs.  Errors are counted, never timed."""
    ok = [r for r in results if r.error is None and r.chunk_times]   # a reply with no text has no timing
    ttft = [t for r in ok if (t := r.ttft) is not None]             # every one of ok: each has chunks
    itl = [x for r in ok for x in r.itls]
    tokens = [r.output_tokens or len(r.chunk_times) for r in ok]
    tpot = [(r.end - r.start - t) / (n - 1) for r, t, n in zip(ok, ttft, tokens) if n > 1]
    e2e = [r.end - r.start for r in ok]
    good = sum(1 for r, t, n in zip(ok, ttft, tokens)
               if t * 1000 <= slo_ttft_ms and (n <= 1 or (r.end - r.start - t) / (n - 1) * 1000 <= slo_itl_ms))
    out: dict[str, float | None] = {"requests": len(results), "errors": sum(r.error is not None for r in results)}
    for name, values in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e", e2e)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = _ms(percentile(values, q))
    out["output_tok_s"] = sum(tokens) / wall_s if wall_s > 0 else 0.0
    out["req_s"] = len(ok) / wall_s if wall_s > 0 else 0.0
    out["goodput_req_s"] = good / wall_s if wall_s > 0 else 0.0
    return out


def cache_share(results: Sequence[StreamResult]) -> dict[str, float | None]:
    """Prompt tokens, cached prompt tokens and their ratio over the responses that reported
    `usage.prompt_tokens_details.cached_tokens` (None when no response did: a share that was not
    seen is never reported as 0)."""
    seen = [r for r in results if r.error is None and r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in seen)
    cached = sum(r.cached_tokens or 0 for r in seen)
    return {"prompt_tokens": prompt if seen else None, "cached_tokens": cached if seen else None,
            "cached_share": cached / prompt if seen and prompt else None}
