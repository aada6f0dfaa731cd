"""Would compiling prefill chunks pay?  One request's prefill chunk of the shipped model, eager
against the same forward compiled with torch.compile (inductor) for that chunk size, alternating
in one process (issue 22: prefill stays eager unless this says otherwise).

    python -m bench.prefill_compile [--json] [--chunks 64,256] [--repeats 7]

Per chunk size: `eager_ms` and `compiled_ms` (best of --repeats, after one warm-up and the
compilation), `compile_s`, and `max_abs_diff` of the final hidden states.  The compiled forward
uses the static attention plan (`TorchAttention(static=True)`) and, as every compiled step does,
the gathered MoE path (one weight copy per (token, expert) pair); eager picks the MoE path from
the routing (engine/moe.py).  The chunk's K/V goes to pages 1..n of a fresh pool.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.report import emit
from engine import LLM
from engine.attention import TorchAttention
from engine.forward_batch import ForwardBatch, build_batch


def measure(chunks: list[int], repeats: int) -> dict:
    llm = LLM(compile=False, kv_cache_tokens=max(chunks) + 64)
    model, pool = llm.model, llm.pool
    static = TorchAttention(pool.page_size, static=True)
    rows: dict[str, dict] = {}
    for size in chunks:
        pages = list(range(1, 1 + -(-size // pool.page_size)))
        ids = llm.tokenizer.encode("def read_config(path):\n    " * size)[:size]
        fb = build_batch([ids], [0], [pages], pool.page_size, "cpu")

        def forward(*tensors: torch.Tensor, kv: torch.Tensor, n: int = size) -> torch.Tensor:
            ids, pos, slots, table, lens, last, q_index, q_valid = tensors
            batch = ForwardBatch(ids, pos, slots, table, lens, last, is_decode=False, max_seq_len=n,
                                 q_index=q_index, q_valid=q_valid)
            return model.forward(batch, kv, attention=static)

        assert fb.q_index is not None and fb.q_valid is not None
        tensors = (fb.input_ids, fb.positions, fb.slot_mapping, fb.page_table, fb.seq_lens, fb.logits_indices,
                   fb.q_index, fb.q_valid)
        compiled = torch.compile(forward, dynamic=False)
        with torch.inference_mode():
            start = time.perf_counter()
            got = compiled(*tensors, kv=pool.kv)
            compile_s = time.perf_counter() - start
            want = model.forward(fb, pool.kv)
            best = {"eager": float("inf"), "compiled": float("inf")}
            runs = {"eager": lambda: model.forward(fb, pool.kv), "compiled": lambda: compiled(*tensors, kv=pool.kv)}
            for _ in range(repeats):
                for name, run in runs.items():
                    start = time.perf_counter()
                    run()
                    best[name] = min(best[name], time.perf_counter() - start)
        rows[str(size)] = {"eager_ms": best["eager"] * 1e3, "compiled_ms": best["compiled"] * 1e3,
                           "compile_s": compile_s, "max_abs_diff": (got - want).abs().max().item()}
    return {"chunks": rows, "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--chunks", default="64,256")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    emit(measure([int(c) for c in args.chunks.split(",")], args.repeats), args.json)


if __name__ == "__main__":
    main()
