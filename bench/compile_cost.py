"""The compiled decode step against eager (issue 22), read by `bench.engine`; run alone, this
module is the child process that times one start-up compilation.

Compiled and eager engines decode the same prompts, greedy, EOS ignored, the two alternating
run by run (the machine's drift touches both alike); each figure is the best of `repeats`
timed runs after a warm-up of each:
  engine_compiled_single_tok_s, engine_compiled_batch16_tok_s   `LLM(compile=True)`
  engine_eager_single_tok_s, engine_eager_batch16_tok_s         `LLM(compile=False)`
  compiled_over_eager_single, compiled_over_eager_batch16       compiled / eager tokens/s
  per_bucket (`--per-bucket`)   per batch bucket b: eager_tok_s, compiled_tok_s, ratio of b
                                concurrent requests (`--bucket-tokens` tokens each), aggregate

compile_s / compile_cached_s: the start-up compilation of the compiled step for `compile_buckets`
(default: the engine's, for its default max_num_seqs), every expert resident or K of each MoE
layer (`compile_resident`, bench.engine's `--compile-resident K`), as the engine measures it
(`runner.compiled.compile_s`), in a child process with an empty cache directory
(`TANDEM_CACHE_DIR` a new temporary directory, TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR unset),
then in a second child on that same directory (the cache a restart finds);
compile_wall_s / compile_cached_wall_s: the whole `LLM(...)` construction in each child
(loading the model included); compile_cache_counters: inductor's and AOT autograd's cache
hit/miss counters in each child (the warm one should only hit).  Raises RuntimeError when a
child's inductor cache is not under its TANDEM_CACHE_DIR (the cold figure would be warm).

    python -m bench.compile_cost [--device cpu] [--threads 2] [--buckets 1,2] [--resident K]
prints that child's JSON line: compile_s, wall_s, buckets, cache_dir, cache (the counters).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from engine import LLM, SamplingParams
from engine.compiled.buckets import parse_buckets

ROOT = Path(__file__).resolve().parents[1]


def batch_prompts(prompts: Sequence[str], n: int) -> list[str]:
    """n prompts, cycling through `prompts`."""
    return [prompts[i % len(prompts)] for i in range(n)]


def _generate(llm: LLM, prompts: list[str], tokens: int) -> Callable[[], None]:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)

    def run() -> None:
        outs = llm.generate(prompts, params)
        assert all(len(o.token_ids) == tokens for o in outs)
    return run


def alternate(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Best seconds of each of `runs` over `repeats` rounds, after one warm-up of each; each
    round runs every one once, the order reversed every other round."""
    names = list(runs)
    for name in names:
        runs[name]()
    best = dict.fromkeys(names, float("inf"))
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            start = time.perf_counter()
            runs[name]()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def compiled_and_eager(compiled: LLM, eager: LLM, prompts: Sequence[str], tokens: int, batch: int,
                       repeats: int) -> tuple[float, float]:
    """Aggregate tokens/s of `batch` concurrent requests, compiled and eager, alternating."""
    p = batch_prompts(prompts, batch)
    best = alternate({"compiled": _generate(compiled, p, tokens), "eager": _generate(eager, p, tokens)}, repeats)
    return tokens * batch / best["compiled"], tokens * batch / best["eager"]


def compiled_vs_eager(compiled: LLM, eager: LLM, prompts: Sequence[str], tokens: int,
                      repeats: int) -> dict[str, float]:
    """The engine_compiled_* / engine_eager_* keys, one stream and 16 concurrent."""
    out = {}
    for batch, name in ((1, "single"), (16, "batch16")):
        c, e = compiled_and_eager(compiled, eager, prompts, tokens, batch, repeats)
        out[f"engine_compiled_{name}_tok_s"], out[f"engine_eager_{name}_tok_s"] = c, e
        out[f"compiled_over_eager_{name}"] = c / e
    return out


def per_bucket(compiled: LLM, eager: LLM, prompts: Sequence[str], buckets: Sequence[int], tokens: int,
               repeats: int) -> dict[str, dict[str, float]]:
    """Per batch bucket b: tokens/s of b concurrent requests, eager and compiled (a batch of
    exactly b rows runs as bucket b with no padding row)."""
    out = {}
    for b in buckets:
        c, e = compiled_and_eager(compiled, eager, prompts, tokens, b, repeats)
        out[str(b)] = {"eager_tok_s": e, "compiled_tok_s": c, "ratio": c / e}
        print(f"bucket {b}: eager {e:.1f} tok/s, compiled {c:.1f} tok/s", file=sys.stderr, flush=True)
    return out


def engine_speeds(default: LLM, args: argparse.Namespace, prompts: Sequence[str]) -> dict[str, Any]:
    """The default engine (`LLM()`: compiled unless TANDEM_COMPILE=0) and one of the other kind,
    alternating: engine_single_tok_s / engine_batch16_tok_s (the default's), engine_default,
    the compiled and eager keys, and with `--per-bucket` every bucket of the compiled one."""
    other = LLM(device=args.device, compile=not default.config.compile, compile_buckets=args.compile_buckets)
    compiled, eager = (default, other) if default.config.compile else (other, default)
    kind = "compiled" if default.config.compile else "eager"
    both = compiled_vs_eager(compiled, eager, prompts, args.tokens, args.repeats)
    out: dict[str, Any] = {"engine_single_tok_s": both[f"engine_{kind}_single_tok_s"],
                           "engine_batch16_tok_s": both[f"engine_{kind}_batch16_tok_s"], "engine_default": kind,
                           **both}
    if args.per_bucket:
        step = compiled.core.runner.compiled
        assert step is not None
        out["per_bucket"] = per_bucket(compiled, eager, prompts, args.buckets or step.buckets, args.bucket_tokens,
                                       args.repeats)
    return out


def add_compile_flags(ap: argparse.ArgumentParser) -> None:
    """`bench.engine`'s flags for the compiled step (its docstring says what each does)."""
    ap.add_argument("--compile-only", action="store_true", help="compile_s and compile_cached_s only")
    ap.add_argument("--compile-buckets", type=parse_buckets, default=None,
                    help="the compiled engines' buckets, e.g. 1,2 (default: the engine's)")
    ap.add_argument("--compile-resident", type=int, default=None, metavar="K",
                    help="compile_s with paged experts, K resident per layer (default: all resident)")
    ap.add_argument("--per-bucket", action="store_true", help="compiled and eager tokens/s per bucket too")
    ap.add_argument("--buckets", type=parse_buckets, default=None, help="--per-bucket at these sizes only")
    ap.add_argument("--bucket-tokens", type=int, default=32, help="tokens per request in --per-bucket")
    ap.add_argument("--profile", action="store_true", help="profile a compiled single-stream generation only")
    ap.add_argument("--profile-top", type=int, default=25, help="entries in --profile's table")


def child_env(cache_dir: str) -> dict[str, str]:
    """The environment of a compile child: Tandem's cache under `cache_dir` and no other."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["TANDEM_CACHE_DIR"] = cache_dir
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _child(cache_dir: str, device: str, threads: int, buckets: Sequence[int] | None, resident: int | None) -> dict:
    cmd = [sys.executable, "-m", "bench.compile_cost", "--device", device, "--threads", str(threads)]
    if buckets is not None:
        cmd += ["--buckets", ",".join(map(str, buckets))]
    if resident is not None:
        cmd += ["--resident", str(resident)]
    done = subprocess.run(cmd, env=child_env(cache_dir), cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compile child {cmd} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compile_cost(device: str, threads: int, buckets: Sequence[int] | None,
                 resident: int | None = None) -> dict[str, object]:
    """compile_s (cold cache) and compile_cached_s (warm), each a child process's own figure
    (see the module docstring); `buckets` None: the engine's default set; `resident`: paged
    experts, that many resident per layer (None: all resident)."""
    with tempfile.TemporaryDirectory(prefix="tandem-compile-") as cache:
        cold = _child(cache, device, threads, buckets, resident)
        warm = _child(cache, device, threads, buckets, resident)
    for child in (cold, warm):
        if not str(child["cache_dir"]).startswith(cache):
            raise RuntimeError(f"the compile child's inductor cache is {child['cache_dir']}, not under its "
                               f"TANDEM_CACHE_DIR {cache}: a cold figure would be a warm one")
    assert cold["buckets"] == warm["buckets"]
    return {"compile_buckets": cold["buckets"], "compile_resident": resident,
            "compile_s": cold["compile_s"], "compile_wall_s": cold["wall_s"],
            "compile_cached_s": warm["compile_s"], "compile_cached_wall_s": warm["wall_s"],
            "compile_cache_counters": {"cold": cold["cache"], "warm": warm["cache"]}}


def main() -> None:
    """The compile child: build `LLM(compile=True)` and print its compilation's figures."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--buckets", type=parse_buckets, default=None, help="e.g. 1,2,4 (default: the engine's)")
    ap.add_argument("--resident", type=int, default=None, help="paged experts, K resident (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    llm = LLM(device=args.device, compile=True, compile_buckets=args.buckets,
              paged_experts_num_resident=args.resident)
    wall = time.perf_counter() - start
    step = llm.core.runner.compiled
    assert step is not None
    from torch._dynamo.utils import counters
    hits = {k: v for k, v in {**counters["inductor"], **counters["aot_autograd"]}.items() if "cache" in k}
    print(json.dumps({"compile_s": step.compile_s, "wall_s": wall, "buckets": list(step.buckets),
                      "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"), "cache": hits}))


if __name__ == "__main__":
    main()
