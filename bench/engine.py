"""Engine decode speed against transformers, and the cost of the stop checks per token, in one
run on the shipped checkpoint.

    python -m bench.engine [--json] [--tokens 128] [--repeats 3] [--stop-only] [--prefill-only] [--mask-only]
    python -m bench.engine --json --paged-only [--compile-buckets 1]   # bench.paged_step's keys only
    python -m bench.engine --device cuda [--json]    # the engine and transformers on the GPU
    python -m bench.engine --json --per-bucket [--buckets 1,4] [--bucket-tokens 32]
    python -m bench.engine --json --compile-only     # compile_s and compile_cached_s only
    python -m bench.engine --json --profile [--profile-top 25]
    --compile-buckets 1,2   every compiled engine of the run (and the compile children) with these
                            buckets only, for short smoke runs (default: the engine's, 1..64)

Every speed figure decodes `--tokens` tokens (EOS ignored) from short prompts, greedy, fp32:
  hf_single_tok_s       transformers `generate`, one stream
  engine_single_tok_s   `engine.LLM` as configured by default, one stream
  engine_batch16_tok_s  the same, 16 concurrent requests, aggregate tokens/s
  engine_default        "compiled", or "eager" when TANDEM_COMPILE=0 is set
Each is the best of `--repeats` timed runs after one warm-up run; compiled and eager engines
alternate run by run, and the default's figures are those of its kind.  `bench.compile_cost`
defines the compiled keys (engine_compiled_*, engine_eager_*, compile_s, compile_cached_s, ...,
per_bucket); `bench.step_profile` the `profile` of `--profile`.
The same with a json_schema constraint, and the grammar mask's cost per token at batch 1 and 16
(alone with `--mask-only`): see `bench.mask_cost` (schema_*_tok_s, mask_us_per_token_b1/_b16).
The compiled step with paged experts at K = E/4, decided on the device, against the host's
decision and against all-resident (alone with `--paged-only`): see `bench.paged_step`
(engine_compiled_paged_single_tok_s, paged_over_resident_single, ...).

stop_check (alone with `--stop-only`): one request's stop checks and streamed delta per token,
at 10, 100, 1,000 and 2,000 output tokens, for a fixed token stream with 3 stop strings and 2
stop regexes that never match: `full_us` re-decodes and searches the whole output every token
(the checks before issue 16, `FullDecodeStopChecker`), `incremental_us` is `engine.stop`;
`ratio` = full / incremental; `chars`, `decode_calls`, `decoded_ids`: the incremental
checker's work for that token.  Each time is the best of `--repeats` passes, the median of the
10 tokens around that length.

prefill_ms (alone with `--prefill-only`): one request's prefill with one output token, per
prompt length in PREFILL_LENGTHS (token ids of ordinary code text), single-process
`engine.LLM`: the median of `--prefill-runs` (at least 5) timed rounds over all lengths after
one warm-up round.
`prefill_worst_inversion`: the largest t_i / t_j over all pairs of lengths i < j (1.0 or less
when prefill time never falls as the prompt grows).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

import regex
import torch

from bench.compile_cost import add_compile_flags, compile_cost, engine_speeds
from bench.mask_cost import mask_cost
from bench.paged_step import paged_speeds
from bench.report import emit
from bench.step_profile import profile_decode
from engine import LLM, SamplingParams
from engine.config import SHIPPED_MODEL
from engine.stop import StopChecker
from engine.tokenizer import REPLACEMENT, Tokenizer

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


def hf_rate(prompt: str, tokens: int, repeats: int, device: str = "cpu") -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, dtype=torch.float32).eval().to(device)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).to(device)

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


class FullDecodeStopChecker:
    """The stop checks as they were before issue 16 (the baseline of `stop_check`, and the
    reference `tests/test_stop_bounds.py` compares streaming with): every token re-decodes the
    whole output, each regex searches all of it, the hold-back tries every prefix of every stop
    string.  Only the parts that streaming uses."""

    def __init__(self, params: SamplingParams, tokenizer: Tokenizer, eos_ids: frozenset[int], max_model_len: int):
        self.params, self.tokenizer, self.eos_ids, self.max_model_len = params, tokenizer, eos_ids, max_model_len
        self._regexes = [regex.compile(p) for p in params.stop_regex]
        self._longest = max((len(s) for s in params.stop), default=0)
        self.token_ids: list[int] = []
        self.text = ""
        self.cut: int | None = None
        self.drop_last_token = False
        self.matched_stop: str | int | None = None
        self.finish_reason: str | None = None
        self._emitted = 0

    def append(self, token: int, num_tokens: int) -> str | None:
        before = len(self.text)
        self.token_ids.append(token)
        self.text = self.tokenizer.decode(self.token_ids)
        self.finish_reason = self._check(token, before, num_tokens)
        return self.finish_reason

    def _check(self, token: int, before: int, num_tokens: int) -> str | None:
        p = self.params
        if len(self.token_ids) >= p.min_tokens:
            if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
                self.matched_stop, self.drop_last_token = token, not p.no_stop_trim
                return "stop"
            best: tuple[int, int, str] | None = None
            for s in p.stop:
                i = self.text.find(s, max(0, before - self._longest + 1))
                if i >= 0 and (best is None or i < best[0]):
                    best = (i, i + len(s), s)
            for rx in self._regexes:
                m = rx.search(self.text)
                if m and m.end() > 0 and (best is None or m.start() < best[0]):
                    best = (m.start(), m.end(), rx.pattern)
            if best is not None:
                self.cut, self.matched_stop = (best[1] if p.no_stop_trim else best[0]), best[2]
                return "stop"
        if len(self.token_ids) >= p.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None

    def final_text(self) -> str:
        if self.cut is not None:
            return self.text[:self.cut]
        return self.tokenizer.decode(self.token_ids[:-1]) if self.drop_last_token else self.text

    def delta(self) -> str:
        if self.finish_reason is not None:
            final = self.final_text()
            end = max(self._emitted, len(final))
            out = final[self._emitted:end]
        else:
            end = max(self._emitted, self._safe_end())
            out = self.text[self._emitted:end]
        self._emitted = end
        return out

    def _safe_end(self) -> int:
        text = self.text
        end = len(text.rstrip(REPLACEMENT))
        for s in self.params.stop:
            for k in range(min(len(s) - 1, end), 0, -1):
                if text.endswith(s[:k], 0, end):
                    end -= k
                    break
        for rx in self._regexes:
            m = rx.search(text, partial=True)
            if m is not None and m.partial:
                end = min(end, m.start())
        return end


class Checker(Protocol):
    def append(self, token: int, num_tokens: int) -> str | None: ...

    def delta(self) -> str: ...


STOP_AT = (10, 100, 1000, 2000)
STOP_PARAMS = SamplingParams(max_tokens=4096, stop=("\n\nUser:", "<|im_end|>", "###"),
                             stop_regex=(r"\bEND_OF_ANSWER\b", r"\d{4}-\d{2}-\d{2}T"), ignore_eos=True)


def stop_stream(tokenizer: Tokenizer, count: int) -> list[int]:
    """`count` token ids of ordinary code text (no stop in it)."""
    ids: list[int] = []
    for prompt in PROMPTS * (count // 20 + 1):
        ids += tokenizer.encode(prompt + " result = value + 1\n")
    return ids[:count]


def token_times(make: Callable[[], Checker], ids: list[int]) -> list[float]:
    """Seconds each token's append + delta took, one pass."""
    checker, times = make(), []
    for i, token in enumerate(ids):
        start = time.perf_counter()
        checker.append(token, i + 1)
        checker.delta()
        times.append(time.perf_counter() - start)
    return times


def stop_check(llm: LLM, repeats: int) -> dict[str, dict[str, float]]:
    """The per-token stop-check cost at each length of STOP_AT (see the module docstring)."""
    tok, eos, ctx = llm.tokenizer, llm.eos_ids, 1 << 20
    ids = stop_stream(tok, max(STOP_AT) + 5)
    passes = {name: [token_times(make, ids) for _ in range(repeats)] for name, make in (
        ("full_us", lambda: FullDecodeStopChecker(STOP_PARAMS, tok, eos, ctx)),
        ("incremental_us", lambda: StopChecker(STOP_PARAMS, tok, eos, ctx)))}
    work = StopChecker(STOP_PARAMS, tok, eos, ctx)
    counts = []                                   # (chars, decode calls, decoded ids) after each token
    for i, token in enumerate(ids):
        work.append(token, i + 1)
        work.delta()
        counts.append((work.work.chars, work.detok.decode_calls, work.detok.decoded_ids))
    out: dict[str, dict[str, float]] = {}
    for n in STOP_AT:
        row = {name: 1e6 * min(statistics.median(p[n - 5:n + 5]) for p in runs) for name, runs in passes.items()}
        row["ratio"] = row["full_us"] / row["incremental_us"]
        for k, name in enumerate(("chars", "decode_calls", "decoded_ids")):
            row[name] = counts[n - 1][k] - counts[n - 2][k]
        out[str(n)] = row
    return out


PREFILL_LENGTHS = (16, 32, 64, *range(96, 513, 32), 768, 1024, 1536, 2000)


def prefill_ms(llm: LLM, runs: int) -> dict[str, float]:
    """Median milliseconds of a one-output-token request per prompt length (see the module docstring).

    Each timed round runs every length once, shortest first, so a drift of the machine's speed
    during the sweep touches every length alike."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    ids = stop_stream(llm.tokenizer, max(PREFILL_LENGTHS))
    for n in PREFILL_LENGTHS:  # warm-up at every shape
        llm.generate(ids[:n], params)
    times: dict[int, list[float]] = {n: [] for n in PREFILL_LENGTHS}
    for _ in range(max(5, runs)):
        for n in PREFILL_LENGTHS:
            gc.collect()
            gc.disable()  # as timeit does: no collection inside a timed run
            try:
                start = time.perf_counter()
                llm.generate(ids[:n], params)
                times[n].append(time.perf_counter() - start)
            finally:
                gc.enable()
    return {str(n): 1e3 * statistics.median(t) for n, t in times.items()}


def worst_inversion(times: dict[str, float]) -> float:
    """max over i < j of t_i / t_j, lengths in increasing order."""
    t = [times[k] for k in sorted(times, key=int)]
    return max(t[i] / t[j] for i in range(len(t)) for j in range(i + 1, len(t)))


def prefill_sweep(llm: LLM, runs: int) -> dict[str, object]:
    times = prefill_ms(llm, runs)
    return {"prefill_ms": times, "prefill_worst_inversion": worst_inversion(times)}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--device", default="cpu", help="where the engine and transformers run (cpu, cuda)")
    ap.add_argument("--stop-only", action="store_true", help="measure the stop checks only")
    ap.add_argument("--prefill-only", action="store_true", help="run the prefill sweep only")
    ap.add_argument("--mask-only", action="store_true", help="plain and json_schema-constrained decode only")
    ap.add_argument("--paged-only", action="store_true", help="the compiled paged-experts step only")
    ap.add_argument("--prefill-runs", type=int, default=11, help="timed runs per prompt length (at least 5)")
    add_compile_flags(ap)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    head = {"model": str(SHIPPED_MODEL.name), "tokens": args.tokens, "threads": args.threads, "device": args.device}
    if args.compile_only:
        cost = compile_cost(args.device, args.threads, args.compile_buckets, args.compile_resident)
        emit({**head, **cost}, args.json)
        return
    if args.profile:
        emit({**head, "profile": profile_decode(PROMPTS[0], args.tokens, args.device, args.profile_top)}, args.json)
        return
    if args.paged_only:
        resident = LLM(device=args.device, compile=True, compile_buckets=args.compile_buckets)
        emit({**head, **paged_speeds(resident, args.device, args.compile_buckets, PROMPTS, args.tokens,
                                     args.repeats)}, args.json)
        return
    alone = args.stop_only or args.prefill_only or args.mask_only
    # first: nothing else runs
    cost = {} if alone else compile_cost(args.device, args.threads, args.compile_buckets, args.compile_resident)
    # the stop checks and prefill never run a compiled decode step: no start-up compile for them
    eager = args.stop_only or args.prefill_only
    eager_only: dict[str, Any] = {"compile": False} if eager else {}     # else: the engine's default
    llm = LLM(device=args.device, compile_buckets=args.compile_buckets, **eager_only)
    if alone:
        part = ({"stop_check": stop_check(llm, args.repeats)} if args.stop_only else
                prefill_sweep(llm, args.prefill_runs) if args.prefill_only else
                mask_cost(llm, PROMPTS, args.tokens, args.repeats))
        emit({**head, **part}, args.json)
        return
    hf = hf_rate(PROMPTS[0], args.tokens, args.repeats, args.device)
    speeds = engine_speeds(llm, args, PROMPTS)
    result = {
        **head, "attention_backend": llm.attention_backend, "hf_single_tok_s": hf, **speeds,
        "ratio_single": speeds["engine_single_tok_s"] / hf, "ratio_batch16": speeds["engine_batch16_tok_s"] / hf,
        **cost, "stop_check": stop_check(llm, args.repeats), **prefill_sweep(llm, args.prefill_runs),
        **mask_cost(llm, PROMPTS, args.tokens, args.repeats),
        **paged_speeds(llm, args.device, args.compile_buckets, PROMPTS, args.tokens, args.repeats),
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
