"""`bench.serve --compare`: Tandem on the shipped model twice in one invocation — colocated
(one worker doing both), then disaggregated (one prefill and one decode worker) — each worker
pinned to one CPU core of its own, the same sweep and the interference test against each."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from bench.serve_load import Target
from bench.serve_prompts import PromptMaker
from engine import env as tandem_env
from engine.config import SHIPPED_MODEL
from gateway.server import _free_port

# bench.serve.measure: one mode's sweep, interference result and Tandem metrics delta
Measure = Callable[[Target, PromptMaker, str, argparse.Namespace, tuple[float, float]],
                   tuple[list[dict], dict | None, dict | None]]

MODES = {"colocated": ["--colocated"], "disaggregated": ["--prefill-workers", "1", "--decode-workers", "1"]}


def start_tandem(flags: list[str]) -> tuple[subprocess.Popen[str], str]:
    """`tandem serve` with `flags`, open to the benchmark (no API or admin keys from the
    environment: it sends none, and reads /metrics); returns the process and its base URL."""
    port = _free_port("127.0.0.1")
    tandem = Path(sys.executable).parent / "tandem"
    env = {k: v for k, v in os.environ.items() if k not in (tandem_env.API_KEYS, tandem_env.ADMIN_KEYS)}
    proc = subprocess.Popen([str(tandem), "serve", "--port", str(port), "--worker-cores", "1", *flags],
                            stdout=subprocess.PIPE, text=True, start_new_session=True, env=env)
    assert proc.stdout is not None   # stdout=PIPE
    line = proc.stdout.readline()
    if not line.startswith("Tandem is serving"):
        proc.kill()
        raise RuntimeError(f"tandem serve {' '.join(flags)} did not start: {line!r}")
    return proc, line.split()[-1].rsplit("/v1", 1)[0]


def compare(args: argparse.Namespace, maker: PromptMaker, slo: tuple[float, float], measure: Measure) -> dict:
    runs: list[dict] = []
    inter: list[dict] = []
    tandem: dict[str, dict | None] = {}
    for mode, flags in MODES.items():
        proc, url = start_tandem(flags)
        try:
            target = Target(url, SHIPPED_MODEL.name, None, args.chat, args.timeout)
            r, i, t = measure(target, maker, mode, args, slo)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        assert i is not None   # measure runs the interference test whenever args.compare
        runs += r
        inter.append(i)
        tandem[mode] = t
    report = {"url": "tandem serve (started twice)", "runs": runs, "interference": inter, "tandem": tandem}
    c16 = {r["mode"]: r["output_tok_s"] for r in runs if r["concurrency"] == 16
           and (r["input_len"], r["output_len"]) == tuple(args.shapes[0])}
    itl = {i["mode"]: i["itl_p99_ms"] for i in inter}
    report["summary"] = {
        "itl_p99_ratio": itl["disaggregated"] / itl["colocated"] if itl["colocated"] else None,
        "throughput_ratio_c16": (c16["disaggregated"] / c16["colocated"]) if len(c16) == 2 and c16["colocated"]
        else None}
    return report
