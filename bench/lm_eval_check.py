"""lm-evaluation-harness against a Tandem server, scored beside `tandem eval` on the same items.

    python -m bench.lm_eval_check --url http://127.0.0.1:8000 --lm-eval-python /path/to/python [--json]

The shipped task (deploy/tasks/stdlib-heldout.jsonl) is written out as two local lm-eval tasks:
a `multiple_choice` one (loglikelihood: lm-eval's `local-completions` sends context + choice as
token ids with echo=true, logprobs=1, max_tokens=1 and sums the echoed logprobs of the choice)
and a `generate_until` one (greedy, until "\\n", exact match).  lm-eval runs them against `--url`;
`tandem eval` runs the same items against the same server.  The figures must be equal: lm-eval's
`acc` to tandem eval's multiple-choice accuracy, `exact_match` to its generation accuracy, and
every choice's loglikelihood (lm-eval's samples) to tandem eval's within 1e-5.

lm-eval is not a dependency of the project (it pulls in `datasets`, `evaluate` and more): give
the python of a virtualenv holding `lm-eval[api]==0.4.13` and `transformers` (and the project's torch pin first).  This
is a benchmark run by hand, not part of `make test`; no network is needed (local json tasks,
the checkpoint's own tokenizer).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from deploy.eval_cli import main as tandem_eval
from deploy.eval_client import Endpoint
from deploy.eval_tasks import task_path
from engine.config import SHIPPED_MODEL

MC_TASK, GEN_TASK = "tandem_stdlib_mc", "tandem_stdlib_gen"


def write_tasks(items: list[dict], out: Path) -> tuple[int, int]:
    """The lm-eval task YAMLs and their json data under `out`; returns (choice items, generation items)."""
    mc = [i for i in items if "choices" in i]
    gen = [i for i in items if "expected" in i]
    stops = {tuple(i.get("stop") or ()) for i in gen}
    lengths = {i.get("max_tokens") for i in gen}
    if stops != {("\n",)} or len(lengths) != 1:
        raise SystemExit(f"the generation items must share one stop and max_tokens to be one lm-eval task: "
                         f"{stops}, {lengths}")
    for name, rows in (("mc", mc), ("gen", gen)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: prompt\ntarget_delimiter: \"\"\n"
    (out / "mc.yaml").write_text(
        f"task: {MC_TASK}\n{common}dataset_kwargs:\n  data_files:\n    test: {out / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: choices\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    (out / "gen.yaml").write_text(
        f"task: {GEN_TASK}\n{common}dataset_kwargs:\n  data_files:\n    test: {out / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: expected\n"
        f"generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: {lengths.pop()}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    ignore_case: false\n    ignore_punctuation: false\n")
    return len(mc), len(gen)


def run_lm_eval(python: str, url: str, model: str, key: str, tasks: Path, timeout_s: float
                ) -> tuple[dict[str, float], dict[int, list[float]]]:
    """lm-eval's scores of both tasks (acc, exact_match), and each choice item's loglikelihoods
    (doc index -> one per choice)."""
    out = tasks / "results"
    args = [python, "-m", "lm_eval", "--model", "local-completions",
            "--model_args", f"model={model},base_url={url.rstrip('/')}/v1/completions,tokenizer={SHIPPED_MODEL},"
                            "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1",
            "--tasks", f"{MC_TASK},{GEN_TASK}", "--include_path", str(tasks), "--output_path", str(out),
            "--batch_size", "1", "--log_samples"]
    env = {**os.environ, "OPENAI_API_KEY": key, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"lm_eval failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    (found,) = list(out.rglob("results_*.json"))
    results = json.loads(found.read_text())["results"]
    (samples,) = list(out.rglob(f"samples_{MC_TASK}_*.jsonl"))
    logliks = {}
    for line in samples.read_text().splitlines():
        row = json.loads(line)
        logliks[row["doc_id"]] = [float(r[0]) for r in row["filtered_resps"]]
    return {"acc": results[MC_TASK]["acc,none"], "exact_match": results[GEN_TASK]["exact_match,none"]}, logliks


def tandem_logliks(url: str, model: str, key: str, items: list[dict]) -> list[list[float]]:
    """Each choice item's loglikelihoods as `tandem eval` scores them (echo, max_tokens 0)."""
    endpoint = Endpoint(url.rstrip("/") + "/v1", model, key, 120.0)
    return [[endpoint.score(i["prompt"], c).score for c in i["choices"]] for i in items if "choices" in i]


def run_tandem_eval(url: str, model: str, key: str, capture: Path) -> dict[str, float]:
    """tandem eval's accuracies on the shipped task, against the same server."""
    stdout = sys.stdout
    try:
        with capture.open("w") as sys.stdout:
            rc = tandem_eval(["stdlib", "--url", url.rstrip("/") + "/v1", "--model", model, "--api-key", key,
                              "--json", "--concurrency", "1"])
    finally:
        sys.stdout = stdout
    if rc not in (0, 1):
        raise SystemExit(f"tandem eval failed ({rc}): {capture.read_text()[-2000:]}")
    rep = json.loads(capture.read_text())
    (row,) = rep["endpoints"]
    return {"acc": row["multiple_choice_accuracy"], "exact_match": row["generation_accuracy"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="the server's base URL (http://HOST:PORT)")
    ap.add_argument("--lm-eval-python", default=sys.executable, help="a python with lm-eval 0.4.13")
    ap.add_argument("--model", default="tiny-moe")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""))
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    items = [json.loads(line) for line in task_path("stdlib").read_text().splitlines() if line.strip()]
    with tempfile.TemporaryDirectory(prefix="tandem-lm-eval-") as tmp:
        tasks = Path(tmp)
        n_mc, n_gen = write_tasks(items, tasks)
        lm, lm_logliks = run_lm_eval(args.lm_eval_python, args.url, args.model, args.api_key, tasks,
                                     args.timeout_s)
        te = run_tandem_eval(args.url, args.model, args.api_key, tasks / "tandem-eval.json")
    ours = tandem_logliks(args.url, args.model, args.api_key, items)
    diffs = [abs(a - b) for d, row in enumerate(ours) for a, b in zip(row, lm_logliks[d])]
    worst = max(diffs) if len(diffs) == sum(len(r) for r in ours) else float("inf")
    report = {"items": {"multiple_choice": n_mc, "generation": n_gen}, "lm_eval": lm, "tandem_eval": te,
              "loglikelihood_max_abs_diff": worst,
              "equal": all(abs(lm[k] - te[k]) < 1e-9 for k in lm) and worst <= 1e-5}
    print(json.dumps(report, indent=1) if args.json else
          f"lm-eval {lm}\ntandem eval {te}\n{'EQUAL' if report['equal'] else 'DIFFERENT'}")
    return 0 if report["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
