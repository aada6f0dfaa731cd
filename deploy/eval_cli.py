"""`tandem eval TASK --url URL [--against URL2]`: an accuracy smoke test against any
OpenAI-compatible server (the `tandem.commands` entry point `main`).

It runs a task file (deploy/eval_tasks.py; `stdlib` is the shipped one) against the endpoint
and reports its accuracy; with `--against`, against a second endpoint too (the same model
unpaged, or dequantized), and how far the two are apart: per-token logprob differences
(median, p99, max), the share of multiple-choice picks and of greedy outputs that agree.
Exit status: 0 when everything passed, 1 when a threshold was missed, the endpoints tokenized
a text differently or a request failed, 2 for a bad command line or task file.
"""

from __future__ import annotations

import argparse
import json
import sys

from deploy.eval_client import Answer, Endpoint, EvalError, run
from deploy.eval_report import Accuracy, Comparison, accuracy, compare, report, table, violations
from deploy.eval_tasks import MAX_ITEMS, TASKS, Item, load_tasks, task_path
from engine import env

MAX_CONCURRENCY = 64


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tandem eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("task", help=f"a .jsonl task file, or a shipped task: {', '.join(TASKS)}")
    ap.add_argument("--url", required=True, help="the server, as OpenAI clients take it (http://HOST:PORT/v1)")
    ap.add_argument("--against", default=None, help="a second server to compare with (default: none)")
    ap.add_argument("--model", default=None,
                    help="the model name to send (default: each server's first model in /v1/models)")
    ap.add_argument("--api-key", default=None,
                    help=f"the API key for both servers (default: ${env.OPENAI_API_KEY}; `ps` shows a flag)")
    ap.add_argument("--max-items", type=int, default=MAX_ITEMS,
                    help=f"the first N items of the task (default: all, at most {MAX_ITEMS})")
    ap.add_argument("--concurrency", type=int, default=8,
                    help=f"items in flight per server, 1..{MAX_CONCURRENCY} (default: 8)")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="the limit of each request (default: 120)")
    ap.add_argument("--max-tokens", type=int, default=64,
                    help="max_tokens of a generation item that sets none (default: 64)")
    ap.add_argument("--max-logprob-diff", type=float, default=1e-3,
                    help="with --against: the largest |logprob a - b| of a scored token that passes (default: 1e-3)")
    ap.add_argument("--min-agreement", type=float, default=1.0,
                    help="with --against: the least share of picks and of greedy outputs that must agree "
                    "(default: 1.0)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    return ap


def check(args: argparse.Namespace) -> None:
    """Raises ValueError for a value out of its range."""
    if not 1 <= args.concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"--concurrency {args.concurrency}: it must be in 1..{MAX_CONCURRENCY}")
    if not args.timeout_s > 0 or args.max_tokens < 1:
        raise ValueError("--timeout-s must be > 0 and --max-tokens >= 1")
    if not args.max_logprob_diff >= 0 or not 0 <= args.min_agreement <= 1:
        raise ValueError("--max-logprob-diff must be >= 0 and --min-agreement in 0..1")


def main(argv: list[str] | None = None) -> int:
    """The command on `argv` (default: sys.argv[1:]); returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        check(args)
        path = task_path(args.task)
        items, more = load_tasks(path, args.max_items)
    except (ValueError, OSError) as e:          # TaskError is a ValueError
        print(f"tandem eval: error: {e}", file=sys.stderr)
        return 2
    if more:
        print(f"tandem eval: running the first {len(items)} items of {path} (--max-items)", file=sys.stderr)
    rep = evaluate(args, str(path), items)
    print(json.dumps(rep, indent=1) if args.json else table(rep))
    return 0 if rep["ok"] else 1


def evaluate(args: argparse.Namespace, task: str, items: list[Item]) -> dict[str, object]:
    """Every item run on each server (the second only once the first has answered them all),
    the two compared and judged; the report (`ok` false on any failure)."""
    key = args.api_key or env.openai_api_key()
    rows: list[tuple[str, str, Accuracy]] = []
    answers: list[list[Answer]] = []
    failures: list[str] = []
    for url in [args.url] + ([args.against] if args.against else []):
        try:
            endpoint = Endpoint(url, args.model, key, args.timeout_s)
            answers.append(run(endpoint, items, args.concurrency, args.max_tokens))
        except EvalError as e:
            failures.append(f"a request failed: {e}")
            break
        rows.append((endpoint.url, endpoint.model, accuracy(items, answers[-1])))
    cmp: Comparison | None = None
    if args.against and len(answers) == 2:
        cmp = compare(items, answers[0], answers[1])
        failures += violations(cmp, args.max_logprob_diff, args.min_agreement)
    thresholds = {"max_logprob_diff": args.max_logprob_diff, "min_agreement": args.min_agreement}
    return report(task, items, rows, cmp, thresholds, failures)


if __name__ == "__main__":
    sys.exit(main())
