"""What asking for prompt logprobs costs a prefill: the same prompt prefilled (max_tokens 0 with
prompt logprobs, max_tokens 1 without) with none, N = 0 and N = 5 alternatives, alternating in
one process with the prefix cache off (every run computes the whole prompt; the engine's
reported cached tokens are checked to be 0).

    python -m bench.prompt_logprobs [--json] [--lengths 128,512,1024] [--repeats 5]

Per length: `none_ms`, `n0_ms`, `n5_ms` (medians of --repeats) and the ratios `n0_vs_none`,
`n5_vs_none`.  Without prompt logprobs the run samples one token (the LM head on one row); with
them it scores every position (the LM head and a log-softmax on every row, 256 at a time).
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.report import emit
from engine import LLM, SamplingParams
from engine.corpus import read_split


def measure(lengths: list[int], repeats: int) -> dict[str, float]:
    llm = LLM(compile=False, enable_prefix_cache=False, max_prefill_tokens=max(lengths))
    _, held = read_split()
    text_ids = llm.tokenizer.encode("\n".join(held))
    kinds = {"none": SamplingParams(max_tokens=1, temperature=0),
             "n0": SamplingParams(max_tokens=0, prompt_logprobs=0),
             "n5": SamplingParams(max_tokens=0, prompt_logprobs=5)}
    out: dict[str, float] = {}
    for n in lengths:
        ids = text_ids[:n]
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(repeats + 1):                      # the first round warms up
            for kind, params in kinds.items():
                t0 = time.perf_counter()
                got = llm.generate([ids], params)[0]
                dt = time.perf_counter() - t0
                if got.num_cached_tokens:
                    raise SystemExit(f"{n} tokens: {got.num_cached_tokens} came from the prefix cache")
                if r:
                    times[kind].append(dt * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        out.update({f"{n}_none_ms": med["none"], f"{n}_n0_ms": med["n0"], f"{n}_n5_ms": med["n5"],
                    f"{n}_n0_vs_none": med["n0"] / med["none"], f"{n}_n5_vs_none": med["n5"] / med["none"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="128,512,1024")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    emit(measure([int(x) for x in args.lengths.split(",")], args.repeats), args.json)


if __name__ == "__main__":
    main()
