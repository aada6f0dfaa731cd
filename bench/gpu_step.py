"""One measuring step of `bench.gpu_check`, run in its own process (so a crash, a hang or a
CUDA error ends only that step):

    python -m bench.gpu_step NAME --device cuda|cpu [--quick] --out FILE

writes {"status": "ok"|"skipped"|"failed", "reason": str, "figures": {...}, "details": [...]}
to FILE and exits 0, or 1 when the step raised (the traceback is in "details").
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

Figures = dict[str, Any]


def package_versions() -> dict[str, str | None]:
    """The versions this process imports (the check may put .whl/gpu-site first on the path)."""
    out: dict[str, str | None] = {}
    for name in ("grpc", "google.protobuf", "cryptography", "transformers", "safetensors", "tokenizers"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as e:    # recorded: a missing package is what the step reports
            out[name] = f"missing ({type(e).__name__})"
    return out


def device_info(device: str, quick: bool) -> Figures:
    """Versions, the device, its driver and free memory.  `device` "auto": cuda when there is one."""
    import triton
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    info: Figures = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                     "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
                     "cpu_count": os.cpu_count(), "platform": platform.platform(), "device": device,
                     "packages": package_versions()}
    if device == "cpu" or not torch.cuda.is_available():
        return info
    dev = torch.device(device)
    props = torch.cuda.get_device_properties(dev)
    free, total = torch.cuda.mem_get_info(dev)
    info.update(name=props.name, capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                total_gib=total / 2**30, free_gib=free / 2**30, device_count=torch.cuda.device_count())
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total,clocks.max.memory",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = out.stdout.strip() or out.stderr.strip()
        info["driver"] = info["nvidia_smi"].split(",")[0].strip()
    pinned = torch.empty(1 << 20, dtype=torch.uint8).pin_memory()
    info["pinned_host_memory"] = pinned.is_pinned()
    return info


def small(device: str, quick: bool) -> bool:
    """Small sizes and one repetition: --quick, or no accelerator (the check's CPU path)."""
    return quick or not device.startswith("cuda")


ENGINE_BUCKETS = (1, 16)   # the compiled engine's buckets on CUDA: the two batch sizes measured


def engine_speed(device: str, quick: bool) -> Figures:
    """`bench.engine`'s engine figures on `device`: tokens/s of one stream and of 16 at once.
    On CUDA the compiled step (CUDA graphs, buckets ENGINE_BUCKETS) and eager side by side,
    alternating run by run (`bench.compile_cost`): engine_compiled_* / engine_eager_*, the
    engine_* keys = compiled (the default); and, without --quick, compile_s / compile_cached_s
    (start-up compilation with a cold and a warm cache, each in a child process).  Elsewhere the
    engine this environment builds by default (TANDEM_COMPILE), alone."""
    from bench.engine import PROMPTS, engine_rate
    from engine import LLM
    tokens, repeats = (8, 1) if small(device, quick) else (64, 3)
    if not device.startswith("cuda"):
        llm = LLM(device=device)
        return {"device": device, "dtype": llm.config.dtype, "tokens": tokens, "repeats": repeats,
                "attention_backend": llm.attention_backend, "compiled": llm.config.compile,
                "engine_single_tok_s": engine_rate(llm, PROMPTS[:1], tokens, repeats),
                "engine_batch16_tok_s": engine_rate(llm, PROMPTS[:16], tokens, repeats)}
    from bench.compile_cost import compile_cost, compiled_vs_eager
    compiled = LLM(device=device, compile=True, compile_buckets=ENGINE_BUCKETS)
    startup_s = compiled.core.runner.compiled.compile_s if compiled.core.runner.compiled is not None else None
    eager = LLM(device=device, compile=False)
    both = compiled_vs_eager(compiled, eager, PROMPTS, tokens, repeats)
    out: Figures = {"device": device, "dtype": compiled.config.dtype, "tokens": tokens, "repeats": repeats,
                    "attention_backend": compiled.attention_backend, "compiled": True,
                    "compile_buckets": list(ENGINE_BUCKETS), "compile_in_process_s": startup_s,
                    "engine_single_tok_s": both["engine_compiled_single_tok_s"],
                    "engine_batch16_tok_s": both["engine_compiled_batch16_tok_s"], **both}
    del compiled, eager
    if not quick:
        out.update(compile_cost(device, torch.get_num_threads(), ENGINE_BUCKETS))
    return out


def experts_speed(device: str, quick: bool) -> Figures:
    """`bench.experts --device`: real copies, hit rate, paged over resident, the link bound."""
    from bench.experts import device_run
    if quick:
        return device_run(device, batches=(1,), tokens=4, prompt_tokens=16, repeats=1, h2d_mib=16)
    if small(device, quick):
        return device_run(device, batches=(1, 16), tokens=4, prompt_tokens=16, repeats=1, h2d_mib=64)
    return device_run(device)


def transfer_speed(device: str, quick: bool) -> Figures:
    """`bench.transfer --device`: 64 MiB from a pool on `device` through local, shm and gRPC (1 and 4 streams)."""
    from bench.transfer import measure
    from kv_transfer.transport import TransportConfig
    return measure(device, 1 if small(device, quick) else 3, TransportConfig(), extras=False)


def real_shape_speed(device: str, quick: bool) -> Figures:
    """`bench.real_shape --device`: paged experts at Qwen3-30B-A3B's MoE shape against the link
    bound (8 layers; --quick: 2 layers, 4 timed steps a point)."""
    from bench.real_shape import measure
    return measure(device, layers=2, steps=4) if quick else measure(device)


def attention_speed(device: str, quick: bool) -> Figures:
    from bench.gpu_attention import attention_bandwidth
    return attention_bandwidth(device, repeats=3 if quick else 10)


STEPS: dict[str, tuple[Callable[[str, bool], Figures], bool]] = {
    # name: (function, needs CUDA)
    "device": (device_info, False),
    "attention_bandwidth": (attention_speed, True),
    "engine": (engine_speed, False),
    "experts": (experts_speed, False),
    "real_shape": (real_shape_speed, True),
    "transfer": (transfer_speed, False),
}


def run_step(name: str, device: str, quick: bool) -> dict[str, Any]:
    fn, needs_cuda = STEPS[name]
    wants_cuda = needs_cuda or device.startswith("cuda")
    if name != "device" and wants_cuda and not (device.startswith("cuda") and torch.cuda.is_available()):
        return {"status": "skipped", "reason": f"needs a CUDA device (device={device}, "
                f"torch.cuda.is_available()={torch.cuda.is_available()})",
                "figures": {}, "details": []}
    try:
        return {"status": "ok", "reason": "", "figures": fn(device, quick), "details": []}
    except Exception as e:   # recorded, the check goes on with the next step
        return {"status": "failed", "reason": f"{type(e).__name__}: {e}"[:500], "figures": {},
                "details": [traceback.format_exc()[-6000:]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(STEPS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    result = run_step(args.name, args.device, args.quick)
    with open(args.out, "w") as f:
        json.dump(result, f, default=str)
    return 1 if result["status"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
