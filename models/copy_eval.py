"""How well a checkpoint repeats a canary string, greedy, through the chat template.

    python -m models.copy_eval models/tiny-moe [--count 60] [--write]

`--write` records the result in the checkpoint's training_stats.json for its card.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

from engine import LLM, SamplingParams


def canaries(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits
    return ["-".join("".join(rng.choice(alphabet) for _ in range(rng.randint(3, 8)))
                     for _ in range(rng.randint(1, 3))) for _ in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--count", type=int, default=60)
    ap.add_argument("--seed", type=int, default=99)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    llm = LLM(args.model)
    cs = canaries(args.count, args.seed)
    outs = llm.chat([[{"role": "user", "content": f"Repeat after me: {c}"}] for c in cs],
                    SamplingParams(max_tokens=48, temperature=0))
    exact = sum(o.text.strip() == c for o, c in zip(outs, cs))
    near = sum(sum(a == b for a, b in zip(o.text, c)) >= 0.8 * len(c) for o, c in zip(outs, cs))
    note = (f"greedy; {near} of {len(cs)} had at least 80% of characters right in place; "
            f"canaries from `python -m models.copy_eval --seed {args.seed}`")
    print(json.dumps({"copy_exact": f"{exact} of {len(cs)}", "copy_note": note}))
    if args.write:
        path = Path(args.model) / "training_stats.json"
        stats = json.loads(path.read_text())
        stats.update(copy_exact=f"{exact} of {len(cs)}", copy_note=note)
        path.write_text(json.dumps(stats, indent=2) + "\n")


if __name__ == "__main__":
    main()
