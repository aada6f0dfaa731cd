"""Throughput and latency against concurrency, one line per (mode, shape)."""

from __future__ import annotations


def plot(runs: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[tuple, list[dict]] = {}
    for r in runs:
        series.setdefault((r["mode"], r["input_len"], r["output_len"]), []).append(r)
    for (mode, inp, out), rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["concurrency"])
        c = [r["concurrency"] for r in rs]
        label = f"{mode} {inp}x{out}"
        ax_t.plot(c, [r["output_tok_s"] for r in rs], marker="o", label=label)
        ax_l.plot(c, [r["itl_p99_ms"] or 0 for r in rs], marker="o", label=f"{label} ITL p99")
        ax_l.plot(c, [r["ttft_p50_ms"] or 0 for r in rs], marker="x", linestyle="--", label=f"{label} TTFT p50")
    for ax, title, unit in ((ax_t, "output throughput", "tokens/s"), (ax_l, "latency", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax_l.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
