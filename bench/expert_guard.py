"""What the expert guard (`--verify-experts`) costs: decode tokens/s with paged experts, the
guard off and on, in one run (same prompts, same K, alternating trials).

    python -m bench.expert_guard [--json] [--k 32] [--batches 1,16] [--tokens 48]

The guard compares every slot a MoE compute read with its host copy after the compute (and
every slot before eviction), so its cost is one more read of each step's experts.
"""

from __future__ import annotations

import argparse
import os

import torch

from bench.experts import decode_rate, natural_prompts
from bench.report import emit
from engine import LLM


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.expert_guard")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--k", type=int, default=32, help="resident experts per MoE layer")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--tokens", type=int, default=48, help="decode steps timed per trial")
    ap.add_argument("--trials", type=int, default=3, help="per setting; the median is kept")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(paged_experts_num_resident=args.k)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = natural_prompts(llm, max(batches), 32)
    result: dict = {"K": args.k, "tokens": args.tokens}
    for batch in batches:
        decode_rate(llm, prompts[:batch], 4)                  # warm-up
        rates: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.trials):
            for on in (False, True):                           # alternate: noise hits both alike
                llm.verify_experts(on)
                rates[on].append(decode_rate(llm, prompts[:batch], args.tokens)[0])
        rate_off, rate_on = (sorted(rates[x])[len(rates[x]) // 2] for x in (False, True))
        result[f"b{batch}_tok_s_off"] = rate_off
        result[f"b{batch}_tok_s_on"] = rate_on
        result[f"b{batch}_on_over_off"] = rate_on / rate_off
    llm.verify_experts(False)
    result["corrupt_slots"] = sum(c["corrupt_slots"] for c in llm.expert_stats().values())
    emit(result, args.json, width=22)


if __name__ == "__main__":
    main()
