"""The `tandem` command.

    tandem serve [flags]                       # the whole server on Ray: workers and gateway
    tandem status [--address auto] [--json]    # the workers of a running deployment
    tandem drain WORKER [--grace-s 30] [--restart] [--undo]   # drain one worker of it
    tandem generate [--prompt TEXT] ...        # the single-process engine on a few prompts
    tandem preflight --memory-gib 16 [--json]  # what paged experts cost and buy
    tandem certs DIR NAME [NAME ...]           # a cluster CA and certificates for plain processes
    tandem NAME ...                            # a command another package adds (below)

More commands plug in through the entry point group `tandem.commands` (pyproject.toml): each
entry `NAME = "module:function"` adds `tandem NAME ...`, where `function(argv: list[str]) -> int`
gets the arguments after NAME and returns the exit status.  The module is imported only when
its command runs (chaos adds `tandem chaos`; deploy itself never imports it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Collection
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING

from deploy.flags import ENGINE_FLAGS, DefaultsShown, add_serve_flags, serve_fields
from deploy.settings import ServeSettings
from engine import env
from engine.config import DTYPE_NAMES, EngineConfig
from engine.options import add_flag, add_flags, build, default_of, flag_of, given
from kv_transfer.tls import SERVER_NAME, VALIDITY_S

if TYPE_CHECKING:
    from engine import LLM

COMMANDS_GROUP = "tandem.commands"
DAY_S = 86400

DEMO_PROMPTS = [
    "Repeat after me: tandem-canary-7f3a",
    "What does isinstance do?",
    "Please repeat: paged experts keep the hot experts resident",
]


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams
    llm = LLM(**given(args, ENGINE_FLAGS))
    prompts = args.prompt or DEMO_PROMPTS
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed)
    start = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outs):
        print(f"user:      {prompt}\nassistant: {out.text!r}  [{len(out.token_ids)} tokens, {out.finish_reason}]\n")
    tokens = sum(len(o.token_ids) for o in outs)
    print(f"{len(outs)} requests, {tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.0f} tokens/s), "
          f"model {llm.config.model}, attention {llm.attention_backend}, "
          f"KV {llm.pool.capacity_tokens} tokens, decode {_decode_mode(llm)}")
    return 0


def _decode_mode(llm: LLM) -> str:
    """'compiled (buckets 1,2,4,...)' or 'eager'."""
    step = llm.core.runner.compiled
    return "eager" if step is None else f"compiled (buckets {','.join(map(str, step.buckets))})"


def _preflight(args: argparse.Namespace) -> int:
    import json

    from engine.config import SHIPPED_MODEL
    from engine.experts.preflight import preflight, render
    report = preflight(args.model or SHIPPED_MODEL, args.memory_gib, dtype=args.dtype, device=args.device,
                       target_tok_s=args.target_tok_s, concurrency=args.concurrency,
                       link_bytes_per_s=args.link_gbps * 1e9 / 8 if args.link_gbps else None,
                       keep_dense_quantized=getattr(args, "keep_dense_quantized", None))
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from pathlib import Path

    from engine.config import SHIPPED_MODEL
    from engine.quant.pack import quantize_checkpoint
    from engine.quant.presets import preset
    fmt = preset(args.format, args.group_size)
    out = Path(args.out)
    count = quantize_checkpoint(args.model or SHIPPED_MODEL, out, fmt, experts_only=not args.all_linears)
    print(f"tandem: wrote {out} ({fmt.describe()}, {count} linears quantized; serve it with --model {out})")
    return 0


def _certs(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kv_transfer.tls import ClusterCA
    if len(set(args.names)) != len(args.names) or any("/" in n or n.startswith(".") for n in args.names):
        raise ValueError("certificate names must be distinct plain names (no '/', not starting with '.')")
    ca = ClusterCA(validity_s=args.days * DAY_S)
    for name in args.names:
        ca.issue(name, hosts=args.host).write(Path(args.dir) / name)
    print(f"tandem: wrote {len(args.names)} certificate(s) of a new cluster CA under {args.dir} "
          f"(valid {args.days:g} days; the CA's key was not kept)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Every command's options, each with its help and (in --help) its default."""
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem: disaggregated MoE serving")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_serve_parser(sub)
    st = sub.add_parser("status", help="the workers of a running deployment", formatter_class=DefaultsShown)
    st.add_argument("--address", default="auto", help="the Ray cluster: auto (the one on this machine) or HOST:PORT")
    st.add_argument("--json", action="store_true", help="every worker as JSON (for scripts)")
    st.set_defaults(func=lambda a: __import__("deploy.status", fromlist=["status"]).status(a.address, a.json))
    add_drain_parser(sub)
    add_preflight_parser(sub)
    add_quantize_parser(sub)
    ct = sub.add_parser("certs", help="a cluster CA and one certificate per process, for workers run as plain "
                        "processes (python -m deploy.worker --tls-dir DIR/NAME)", formatter_class=DefaultsShown)
    ct.add_argument("dir", help="where to write NAME/{ca,cert,key}.pem (files 0600, directories 0700)")
    ct.add_argument("names", nargs="+", help="one per process: decode-0 prefill-0 gateway ...")
    ct.add_argument("--host", action="append", default=[],
                    help=f"an IP or DNS name every certificate names too (repeatable; default: none, only "
                    f"{SERVER_NAME})")
    ct.add_argument("--days", type=float, default=VALIDITY_S / DAY_S,
                    help="how long the certificates are valid, in days")
    ct.set_defaults(func=_certs)
    add_plugin_parsers(sub)
    return parser


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="run the single-process engine on a few chat prompts",
                         formatter_class=DefaultsShown)
    add_flags(gen, EngineConfig, ENGINE_FLAGS)     # the engine's: EngineConfig's defaults and help
    gen.add_argument("--max-tokens", type=int, default=48, help="tokens to generate per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    gen.add_argument("--seed", dest="sampling_seed", type=int, default=None,
                     help="the sampling seed (default: none, not reproducible)")
    gen.add_argument("--prompt", action="append",
                     help="a user message (repeatable; default: three demo prompts)")
    gen.set_defaults(func=_generate)


def add_preflight_parser(sub: argparse._SubParsersAction) -> None:
    pre = sub.add_parser("preflight", help="what paged experts cost and buy on a device", formatter_class=DefaultsShown)
    pre.add_argument("--model", default=None, help="HF checkpoint directory (default: the shipped tiny-moe)")
    pre.add_argument("--memory-gib", type=float, required=True,
                     help="device memory budget for the model, in GiB (required, no default)")
    pre.add_argument("--dtype", default="bfloat16", choices=DTYPE_NAMES, help="the weights' floating point type")
    pre.add_argument("--device", default=default_of(EngineConfig, "device"),
                     help="where to measure the host-to-device link")
    pre.add_argument("--target-tok-s", type=float, default=50.0, help="the decode speed to size K for, tokens/s")
    pre.add_argument("--concurrency", type=int, default=8, help="the concurrent requests to size K for")
    pre.add_argument("--link-gbps", type=float, default=None,
                     help="use this link speed, in Gbit/s, instead of measuring (default: measured)")
    add_flag(pre, EngineConfig, "keep_dense_quantized")
    pre.add_argument("--json", action="store_true", help="the report as JSON")
    pre.set_defaults(func=_preflight)


def add_quantize_parser(sub: argparse._SubParsersAction) -> None:
    from engine.quant.presets import PRESETS
    qz = sub.add_parser("quantize", help="write a quantized copy of a checkpoint in a published layout (round to "
                        "nearest, no calibration)", formatter_class=DefaultsShown)
    qz.add_argument("--model", default=None, help="HF checkpoint directory (default: the shipped tiny-moe)")
    qz.add_argument("--format", required=True, choices=sorted(PRESETS), help="the layout to write")
    qz.add_argument("--out", required=True, help="the new checkpoint's directory (must not exist or be empty)")
    qz.add_argument("--group-size", type=int, default=None,
                    help="input columns per scale for the int formats (gptq, awq, ct): -1 for one group per row "
                    "(default: the format's, 128; it must divide the input size for awq and ct)")
    qz.add_argument("--all-linears", action="store_true",
                    help="quantize attention and dense MLPs too (default: the routed experts only)")
    qz.set_defaults(func=_quantize)


def add_drain_parser(sub: argparse._SubParsersAction) -> None:
    dr = sub.add_parser("drain", help="drain one worker of a running deployment: it admits nothing new, its "
                        "requests finish or move to another worker", formatter_class=DefaultsShown)
    dr.add_argument("worker", help="the worker's id, as `tandem status` shows it (decode-0, prefill-1, ...)")
    dr.add_argument("--grace-s", type=float, default=default_of(ServeSettings, "drain_grace_s"),
                    help="seconds its live requests may finish before they are ended and moved")
    dr.add_argument("--restart", action="store_true", help="then restart it (a fresh worker registers)")
    dr.add_argument("--undo", action="store_true", help="admit new requests again (a drained worker not restarted)")
    dr.add_argument("--address", default="auto", help="the Ray cluster: auto (the one on this machine) or HOST:PORT")
    dr.set_defaults(func=lambda a: __import__("deploy.drain", fromlist=["drain"]).drain(
        a.address, a.worker, a.grace_s, restart=a.restart, undo=a.undo))


def add_plugin_parsers(sub: argparse._SubParsersAction) -> None:
    """One subcommand per `tandem.commands` entry point not named like a built-in command; its
    arguments go to the entry point's function unparsed (its own --help included)."""
    for ep in entry_points(group=COMMANDS_GROUP):
        if ep.name in sub.choices:
            continue
        cmd = sub.add_parser(ep.name, help=f"{ep.name} commands (from {ep.value.split(':')[0]})", add_help=False)
        cmd.add_argument("rest", nargs=argparse.REMAINDER)
        cmd.set_defaults(func=lambda args, ep=ep: _run_plugin(ep, args.rest))


def _run_plugin(ep: EntryPoint, argv: list[str]) -> int:
    """Import the command's module now and run it on `argv`."""
    command: Callable[[list[str]], int] = ep.load()
    return command(argv)


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    sv = sub.add_parser("serve", help="serve the model: Ray workers and the OpenAI-compatible gateway",
                        formatter_class=DefaultsShown)
    add_serve_flags(sv)            # deploy/flags.py: one row per flag, its default and help the field's
    sv.set_defaults(func=_serve)


def serve_settings(args: argparse.Namespace) -> ServeSettings:
    """The flags as ServeSettings (the fields not given keep their defaults); raises ValueError
    on a conflict or a bad value."""
    from deploy.settings import check_ray_auth
    from gateway.config import api_keys
    values = given(args, serve_fields())
    if values.get("colocated") and {"prefill_workers", "decode_workers"} & values.keys():
        raise ValueError("--colocated workers do both prefill and decode: drop --prefill-workers/--decode-workers "
                         "(use --colocated-workers N)")
    keys = api_keys(args.api_keys_file, args.api_key, env.api_keys())
    if warning := check_ray_auth(values.get("address"), env.ray_auth_mode(), args.allow_insecure_ray):
        print(warning, file=sys.stderr)
    return build(ServeSettings, **values, api_keys=keys, admin_keys=admin_keys(env.admin_keys()))


def admin_keys(value: str | None) -> tuple[str, ...]:
    """TANDEM_ADMIN_KEYS (`value`) as keys (never a flag: `ps` would show it); an empty one is refused."""
    if value is None:
        return ()
    keys = tuple(k.strip() for k in value.split(","))
    if not all(keys):
        raise ValueError(f"{env.ADMIN_KEYS} holds an empty key: it would let anyone in")
    return keys


def _serve(args: argparse.Namespace) -> int:
    settings = serve_settings(args)
    _check_kv(settings, given(args, serve_fields()).keys())
    from deploy.serve import serve
    return serve(settings)


def _check_kv(settings: ServeSettings, flags_given: Collection[str]) -> None:
    """Fail before starting anything when a worker's KV pool cannot hold one full-context
    request (a pool sized by --mem-fraction is known only on the worker, which checks it).
    `flags_given`: the fields the command line set; a pool it left alone is named as the default."""
    from engine.config import ModelConfig
    mc = ModelConfig.from_path(settings.model)
    context = min(settings.engine.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    pools: list[tuple[str, int | None]] = [("prefill_kv_cache_tokens", settings.prefill_kv_cache_tokens)]
    if settings.worker.mem_fraction is None:
        pools.insert(0, ("kv_cache_tokens", settings.engine.kv_cache_tokens))
    for name, tokens in pools:
        if tokens is not None and tokens < context:
            pool = f"{flag_of(ServeSettings, name)} {tokens}"
            raise ValueError(f"{pool if name in flags_given else 'the default ' + pool} cannot hold one request of the "
                             f"maximum context ({context} tokens): raise it to at least {context} or lower "
                             f"--max-model-len")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status: int = args.func(args)
        return status
    except (ValueError, FileNotFoundError, FileExistsError, json.JSONDecodeError) as err:
        print(f"tandem: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
