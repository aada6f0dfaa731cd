"""`python -m chaos run` (also `tandem chaos run`, through the `tandem.commands` entry point
`main`): start a real cluster, attack it scenario by scenario, judge every response, print the
table (or JSON), exit 1 on any violation."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from chaos.report import ScenarioResult, table
from chaos.scenario import Scenario
from chaos.scenarios import select, split
from worker.config import TRANSFERS


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m chaos", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run chaos scenarios against a fresh local cluster")
    run.add_argument("--scenarios", default="all", help="all, or names separated by commas")
    run.add_argument("--requests", type=int, default=2000, help="requests over all scenarios")
    run.add_argument("--concurrency", type=int, default=16)
    run.add_argument("--seed", type=int, default=None, help="replays a run (default: a fresh one)")
    run.add_argument("--decode-workers", type=int, default=2)
    run.add_argument("--prefill-workers", type=int, default=1)
    run.add_argument("--transfer", default="grpc", choices=list(TRANSFERS))
    run.add_argument("--no-expert-guard", action="store_true",
                     help="start the workers without --verify-experts (corrupt_expert should then fail)")
    run.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    sub.add_parser("list", help="the scenarios")
    return ap


def main(argv: list[str] | None = None) -> int:
    """The command on `argv` (default: sys.argv[1:]); returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "list":
        from chaos.scenarios import SCENARIOS
        for s in SCENARIOS:
            print(f"{s.name:<18} {s.group:<9} {s.about}")
        return 0
    try:
        scenarios = select(args.scenarios)
        if args.requests < 1 or args.concurrency < 1:
            raise ValueError(f"--requests {args.requests} and --concurrency {args.concurrency} must be >= 1")
        if args.decode_workers < 2 or args.prefill_workers < 1:
            raise ValueError("a chaos cluster needs at least 2 decode workers and 1 prefill worker")
    except ValueError as e:
        print(f"chaos: error: {e}", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    report, results = run(args, scenarios, seed)
    print(json.dumps(report, indent=1) if args.json else table(results) + "\n" + _summary(report))
    if not report["ok"]:
        print(f"chaos: violations found; replay with: {replay_command(args, scenarios, seed)}", file=sys.stderr)
        return 1
    return 0


def replay_command(args: argparse.Namespace, scenarios: list[Scenario], seed: int) -> str:
    cmd = (f"python -m chaos run --scenarios {','.join(s.name for s in scenarios)} --requests {args.requests} "
           f"--concurrency {args.concurrency} --seed {seed}")
    if (args.prefill_workers, args.decode_workers, args.transfer) != (1, 2, "grpc"):
        cmd += f" --prefill-workers {args.prefill_workers} --decode-workers {args.decode_workers} " \
               f"--transfer {args.transfer}"
    return cmd + (" --no-expert-guard" if args.no_expert_guard else "")


def run(args: argparse.Namespace, scenarios: list[Scenario], seed: int) -> tuple[dict[str, Any], list[ScenarioResult]]:
    """The run's totals (the JSON report) and its per-scenario results."""
    from chaos.cluster import ChaosCluster, ClusterShape
    from chaos.oracle import Reference, judge
    from chaos.prompts import PromptMaker
    from chaos.report import totals
    from chaos.runner import ScenarioRunner
    from engine.config import SHIPPED_MODEL
    from engine.tokenizer import Tokenizer
    logging.basicConfig(level=logging.WARNING)
    say: Callable[[str], None] = (lambda m: print(m, file=sys.stderr)) if args.json else print
    t0 = time.monotonic()
    shape = ClusterShape(prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
                         transfer=args.transfer, verify_experts=not args.no_expert_guard)
    maker = PromptMaker(Tokenizer(SHIPPED_MODEL), seed)
    keys = maker.keys()
    cluster = ChaosCluster(shape, keys, seed)
    say(f"chaos: seed {seed}; starting a cluster of {shape.prefill_workers} prefill and "
        f"{shape.decode_workers} decode workers")
    cluster.start()
    results: list[ScenarioResult] = []
    try:
        runner = ScenarioRunner(cluster, maker, keys, cluster.settings.name, args.concurrency, seed)
        for sc, n in zip(scenarios, split(args.requests, scenarios)):
            r = runner.run(sc, n)
            say(f"chaos: {sc.name}: {r.requests} requests, {r.faults_injected} faults, "
                f"{len(r.violations)} violations so far, {r.seconds:.1f}s")
            results.append(r)
    finally:
        cluster.stop()
    say("chaos: checking every response against the single-process reference")
    judge(results, Reference(cluster.settings.model, shape.max_model_len))
    return totals(results, seed, time.monotonic() - t0), results


def _summary(t: dict[str, Any]) -> str:
    return _counts(t) + "".join(f"\n{line}" for line in _ttft_lines(t.get("hostile_ttft", {}))
                                + _migration_lines(t.get("migrations", {})))


def _migration_lines(moved: dict[str, dict[str, float | None]]) -> list[str]:
    """Migrations by cause and the gap they added to the stream, per scenario that had some."""
    rows = {name: f for name, f in moved.items() if f.get("migrations")}
    if not rows:
        return []

    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{x * 1000:.0f} ms"
    return ["migrations (the gateway's counters; the gap from the last token before the break to the first after "
            "it, p50/p99 interpolated within its histogram's buckets): " + "; ".join(
                f"{name} {f['migrations']:.0f} ("
                + ", ".join(f"{k.removeprefix('migrations_')} {v:.0f}" for k, v in sorted(f.items())
                            if k.startswith("migrations_") and v)
                + f"), gap {ms(f.get('migration_gap_p50_s'))} / {ms(f.get('migration_gap_p99_s'))}"
                for name, f in rows.items())]


def _ttft_lines(ttft: dict[str, dict[str, float | None]]) -> list[str]:
    """The other tenants' TTFT p99 without and beside each hostile attack (issue 16: at most 3x)."""
    if not ttft:
        return []

    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{x * 1000:.0f} ms"
    return ["other tenants' TTFT p99 without -> beside the attack (target <= 3x): " + "; ".join(
        f"{name} {ms(f.get('ttft_p99_baseline_s'))} -> {ms(f.get('ttft_p99_attack_s'))}"
        + (f" ({f['ttft_ratio']:.2f}x)" if f.get("ttft_ratio") is not None else "") for name, f in ttft.items())]


def _counts(t: dict[str, Any]) -> str:
    return (f"\n{t['requests']} requests ({t['completed']} completed, {t['failed_explicitly']} failed "
            f"explicitly, {t['aborted']} aborted, {t['silent']} silent); {t['faults_injected']} faults "
            f"injected, {t['faults_detected']} detected, {t['faults_tolerated']} tolerated, "
            f"{t['faults_unaccounted']} neither; transfer faults "
            f"{t['transfer_faults_detected']}/{t['transfer_faults_injected']} detected; leaks {t['leaks']}, "
            f"corrupted {t['corrupted_completions']}, near-ties {t['near_ties']}, pages leaked {t['pages_leaked']}; "
            f"{t['seconds']}s; seed {t['seed']}")
