"""The `tandem` command.

    tandem serve [--model PATH] [--prompt TEXT] ...   # run the shipped model
    tandem preflight --memory-gib 16 [--json]          # what paged experts cost and buy

Until the gateway and workers land, `serve` runs the single-process engine on a few
chat prompts and prints what it generated with its speed; later issues turn it into
the OpenAI-compatible server.
"""

from __future__ import annotations

import argparse
import sys
import time

DEMO_PROMPTS = [
    "Repeat after me: tandem-canary-7f3a",
    "What does isinstance do?",
    "Please repeat: paged experts keep the hot experts resident",
]


def _serve(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams
    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_cache_tokens=args.kv_cache_tokens,
              max_model_len=args.max_model_len, paged_experts_num_resident=args.paged_experts_num_resident)
    prompts = args.prompt or DEMO_PROMPTS
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    start = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outs):
        print(f"user:      {prompt}\nassistant: {out.text!r}  [{len(out.token_ids)} tokens, {out.finish_reason}]\n")
    tokens = sum(len(o.token_ids) for o in outs)
    print(f"{len(outs)} requests, {tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.0f} tokens/s), "
          f"model {llm.config.model}, attention {llm.attention_backend}, "
          f"KV {llm.pool.capacity_tokens} tokens")
    return 0


def _preflight(args: argparse.Namespace) -> int:
    import json

    from engine.config import SHIPPED_MODEL
    from engine.experts.preflight import preflight, render
    report = preflight(args.model or SHIPPED_MODEL, args.memory_gib, dtype=args.dtype, device=args.device,
                       target_tok_s=args.target_tok_s, concurrency=args.concurrency,
                       link_bytes_per_s=args.link_gbps * 1e9 / 8 if args.link_gbps else None)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem: disaggregated MoE serving")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the model (for now: a single-process generation demo)")
    serve.add_argument("--model", default=None, help="HF checkpoint directory (default: the shipped tiny-moe)")
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    serve.add_argument("--device", default="cpu")
    serve.add_argument("--kv-cache-tokens", type=int, default=16384)
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--paged-experts-num-resident", type=int, default=None,
                       help="keep K experts of each MoE layer on the device (default: all)")
    serve.add_argument("--max-tokens", type=int, default=48)
    serve.add_argument("--temperature", type=float, default=0.0)
    serve.add_argument("--seed", type=int, default=None)
    serve.add_argument("--prompt", action="append", help="a user message (repeatable)")
    serve.set_defaults(func=_serve)
    pre = sub.add_parser("preflight", help="what paged experts cost and buy on a device")
    pre.add_argument("--model", default=None, help="HF checkpoint directory (default: the shipped tiny-moe)")
    pre.add_argument("--memory-gib", type=float, required=True, help="device memory budget for the model")
    pre.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    pre.add_argument("--device", default="cpu", help="where to measure the host-to-device link")
    pre.add_argument("--target-tok-s", type=float, default=50.0)
    pre.add_argument("--concurrency", type=int, default=8)
    pre.add_argument("--link-gbps", type=float, default=None, help="use this link speed instead of measuring")
    pre.add_argument("--json", action="store_true")
    pre.set_defaults(func=_preflight)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"tandem: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
