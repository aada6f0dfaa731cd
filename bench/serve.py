"""A load generator for any OpenAI-compatible server, and Tandem's disaggregation claim measured.

    python -m bench.serve --url http://127.0.0.1:8000 --model tiny-moe \\
        [--concurrency 1,2,4,8,16,32] [--shapes 512x64,64x256] [--requests-per-level N] \\
        [--chat] [--api-key K] [--slo-ttft-ms 1000] [--slo-itl-ms 100] [--seed 0] [--json] [--plot out.png]
    python -m bench.serve --compare [--json] [--plot out.png]   # Tandem colocated vs disaggregated
    python -m bench.serve --url ... --workload shared-prefix|multi-turn [workload flags] [--concurrency 8]
    python -m bench.serve --prefix-compare [workload flags | --quick] [--json]   # Tandem's prefix cache

Every request streams; prompts are held-out standard-library text cut to the shape's input
length, with a prefix unique to the request and to this invocation (so a second run against
one server measures no prefix cache the first one filled); outputs are forced to the shape's
length (`max_tokens` =
`min_tokens`, `ignore_eos`).  TTFT and inter-token latency come from the arrival times of
the stream's chunks.  Against Tandem it also reads /metrics before and after each run.

The prefix workloads (bench/serve_workloads.py) send token-id prompts of exact lengths on
/v1/completions: shared-prefix (a few long system prompts, each request one of them plus its own
question) and multi-turn (each turn resends the conversation so far); their rows add the share of
prompt tokens the server reported cached.  --prefix-compare: bench/serve_prefix.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys

from tqdm import tqdm

from bench.serve_load import Target, interference, run_level
from bench.serve_metrics import MissingMetric, run_delta, scrape
from bench.serve_prompts import PromptMaker
from bench.serve_stats import summarize
from bench.serve_workloads import add_flags, multi_turn, resolve, shared_prefix
from engine.config import SHIPPED_MODEL
from engine.tokenizer import Tokenizer
from gateway.config import GatewaySettings

COLUMNS = ["mode", "concurrency", "input_len", "output_len", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
           "itl_p99_ms", "tpot_p50_ms", "e2e_p50_ms", "output_tok_s", "req_s", "goodput_req_s", "cached_share",
           "errors"]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(x) for x in s.lower().split("x")) for s in text.split(",")]
    except ValueError:
        raise SystemExit(f"--shapes {text!r}: expected INPUTxOUTPUT[,INPUTxOUTPUT...], e.g. 512x64,64x256")
    if any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise SystemExit(f"--shapes {text!r}: each shape is INPUTxOUTPUT with both >= 1")
    return [(inp, out) for inp, out in shapes]   # each has two, checked above


def sweep(target: Target, maker: PromptMaker, mode: str, concurrency: list[int], shapes: list[tuple[int, int]],
          per_level: int | None, slo: tuple[float, float]) -> list[dict]:
    runs: list[dict] = []
    total = sum((per_level or 2 * c) for c in concurrency) * len(shapes)
    with tqdm(total=total, desc=f"{mode} sweep", unit="req", file=sys.stderr) as bar:
        for inp, out in shapes:
            for c in concurrency:
                prompts = [maker.make(inp) for _ in range(per_level or 2 * c)]
                results, wall = asyncio.run(run_level(target, prompts, out, c, bar))
                runs.append({"mode": mode, "concurrency": c, "input_len": inp, "output_len": out,
                             **summarize(results, wall, *slo)})
    return runs


def interference_test(target: Target, maker: PromptMaker, mode: str, slo: tuple[float, float]) -> dict:
    """8 short decodes (32 in, 128 out) at a time while 2 long prompts (1024 in, 1 out) keep arriving."""
    short = [maker.make(32) for _ in range(16)]
    long = [maker.make(1024) for _ in range(8)]
    with tqdm(total=len(short), desc=f"{mode} interference", unit="req", file=sys.stderr) as bar:
        results, wall = asyncio.run(interference(target, short, 128, long, 8, 2, bar))
    return {"mode": mode, "test": "interference", "concurrency": 8, "input_len": 32, "output_len": 128,
            **summarize(results, wall, *slo)}


def measure(target: Target, maker: PromptMaker, mode: str, args: argparse.Namespace,
            slo: tuple[float, float]) -> tuple[list[dict], dict | None, dict | None]:
    before = scrape(target.url)
    if args.workload == "random":
        runs = sweep(target, maker, mode, args.concurrency, args.shapes, args.requests_per_level, slo)
    else:
        from bench.serve_turns import sweep_workload
        make = shared_prefix if args.workload == "shared-prefix" else multi_turn
        runs = [sweep_workload(target, maker, make(args, c), mode, slo) for c in args.concurrency]
    inter = interference_test(target, maker, mode, slo) if args.compare else None
    tandem = None
    if before is not None:
        import time
        time.sleep(2.5)                       # the gateway copies workers' Stats every second
        tandem = run_delta(before, scrape(target.url) or {})
    return runs, inter, tandem


def table(runs: list[dict]) -> str:
    def cell(v: object) -> str:
        return "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)
    lines = [" ".join(f"{c:>13s}" for c in COLUMNS)]
    lines += [" ".join(f"{cell(r.get(c)):>13s}" for c in COLUMNS) for r in runs]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    gateway = GatewaySettings()      # tandem serve's defaults: where it listens, what it serves
    ap.add_argument("--url", default=f"http://{gateway.host}:{gateway.port}")
    ap.add_argument("--model", default=gateway.model_name(None))
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--chat", action="store_true", help="use /v1/chat/completions (default: /v1/completions)")
    ap.add_argument("--concurrency", default=None, help="levels, comma-separated (default 1,2,4,8,16,32; "
                    "prefix workloads: 8, --quick: 4)")
    ap.add_argument("--shapes", default="512x64,64x256")
    ap.add_argument("--requests-per-level", type=int, default=None, help="default: 2 x concurrency")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-itl-ms", type=float, default=200.0)
    ap.add_argument("--seed", type=int, default=0, help="draws the prompts' text; each invocation also marks its "
                    "prompts' first tokens afresh, so a second run against one server hits no prefix cached by the "
                    "first")
    ap.add_argument("--timeout", type=float, default=gateway.request_timeout_s, help="seconds one request may take")
    ap.add_argument("--tokenizer", default=str(SHIPPED_MODEL), help="checkpoint dir whose tokenizer cuts the prompts")
    ap.add_argument("--compare", action="store_true", help="start Tandem colocated, then disaggregated, and compare")
    ap.add_argument("--workload", default="random", choices=["random", "shared-prefix", "multi-turn"],
                    help="random: unique prompts of --shapes (default); the others: token-id prompts sharing "
                    "prefixes (/v1/completions)")
    ap.add_argument("--prefix-compare", action="store_true", help="start Tandem with the prefix cache off and "
                    "on, and with two decode workers under prefix and load routing, on the shared-prefix workload")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot", default=None)
    add_flags(ap)
    args = ap.parse_args(argv)
    if args.concurrency is None and args.workload == "random" and not args.prefix_compare:
        args.concurrency = "1,2,4,8,16,32"
    resolve(args)                         # the prefix workloads' flags left unset (and --concurrency)
    check_modes(ap, args)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.shapes = parse_shapes(args.shapes)
    maker = PromptMaker(Tokenizer(args.tokenizer), args.seed, run=secrets.token_hex(4))
    slo = (args.slo_ttft_ms, args.slo_itl_ms)
    try:
        if args.prefix_compare:
            from bench.serve_prefix import prefix_compare
            report = prefix_compare(args, maker, shared_prefix(args, args.concurrency[0]), slo)
        elif args.compare:
            from bench.serve_compare import compare
            report = compare(args, maker, slo, measure)
        else:
            target = Target(args.url, args.model, args.api_key, args.chat, args.timeout)
            runs, _, tandem = measure(target, maker, "server", args, slo)
            report = {"url": args.url, "runs": runs, **({"tandem": tandem} if tandem else {})}
    except MissingMetric as e:
        print(f"bench.serve: {e}", file=sys.stderr)
        return 2
    if args.plot:
        from bench.serve_plot import plot
        plot(report["runs"], args.plot)
    print(json.dumps(report, indent=2) if args.json else table(report["runs"] + report.get("interference", [])))
    if not args.json and "summary" in report:
        print("\n".join(f"{k:32s} {v}" for k, v in report["summary"].items()))
    return 0


def check_modes(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses flag combinations that cannot run (argparse's error: exit status 2)."""
    if args.compare and args.prefix_compare:
        ap.error("--compare and --prefix-compare are two benchmarks: run one at a time")
    if args.prefix_compare and args.workload == "multi-turn":
        ap.error("--prefix-compare runs the shared-prefix workload: drop --workload multi-turn")
    prefix = args.prefix_compare or args.workload != "random"
    if prefix and args.chat:
        ap.error("the prefix workloads send token-id prompts on /v1/completions: drop --chat")
    if args.prefix_compare and "," in args.concurrency:
        ap.error(f"--prefix-compare runs one concurrency level, got --concurrency {args.concurrency}")
    if args.held_prefixes is not None and not 1 <= args.held_prefixes <= args.num_prefixes:
        ap.error(f"--held-prefixes {args.held_prefixes}: between 1 and --num-prefixes ({args.num_prefixes})")
    if args.compare and args.workload != "random":
        ap.error("--compare runs the random workload: drop --workload (or use --prefix-compare)")


if __name__ == "__main__":
    sys.exit(main())
