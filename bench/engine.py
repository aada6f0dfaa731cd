"""Engine decode speed against transformers, in one run on the shipped checkpoint.

    python -m bench.engine [--json] [--tokens 128] [--repeats 3]

Every figure decodes `--tokens` tokens (EOS ignored) from short prompts, greedy, fp32:
  hf_single_tok_s       transformers `generate`, one stream
  engine_single_tok_s   `engine.LLM`, one stream
  engine_batch16_tok_s  `engine.LLM`, 16 concurrent requests, aggregate tokens/s
Each is the best of `--repeats` timed runs after one warm-up run.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

from bench.report import emit
from engine import LLM, SamplingParams
from engine.config import SHIPPED_MODEL

PROMPTS = [
    "def read_config(path):", "import json\n", "class Cache:\n", "for key, value in items:",
    "# Parse the header", "return os.path.join(", "if __name__ == '__main__':", "try:\n    import zlib",
    "def __repr__(self):", "with open(filename) as f:", "raise TypeError(", "while True:",
    "self._lock = threading.", "assert isinstance(", "lines = text.split(", "def test_basic(self):",
]


def best_rate(fn: Callable[[], None], tokens: int, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return tokens / best


def hf_rate(prompt: str, tokens: int, repeats: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)

    def run() -> None:
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        assert out.shape[1] - ids["input_ids"].shape[1] == tokens
    return best_rate(run, tokens, repeats)


def engine_rate(llm: LLM, prompts: list[str], tokens: int, repeats: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)

    def run() -> None:
        outs = llm.generate(prompts, params)
        assert all(len(o.token_ids) == tokens for o in outs)
    return best_rate(run, tokens * len(prompts), repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM()
    result = {
        "model": str(SHIPPED_MODEL.name), "tokens": args.tokens, "threads": args.threads,
        "attention_backend": llm.attention_backend,
        "hf_single_tok_s": hf_rate(PROMPTS[0], args.tokens, args.repeats),
        "engine_single_tok_s": engine_rate(llm, PROMPTS[:1], args.tokens, args.repeats),
        "engine_batch16_tok_s": engine_rate(llm, PROMPTS[:16], args.tokens, args.repeats),
    }
    result["ratio_single"] = result["engine_single_tok_s"] / result["hf_single_tok_s"]
    result["ratio_batch16"] = result["engine_batch16_tok_s"] / result["hf_single_tok_s"]
    emit(result, args.json)


if __name__ == "__main__":
    main()
