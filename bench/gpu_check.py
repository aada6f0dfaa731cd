"""One command that runs every CUDA path of Tandem and measures it (issue 23).

    python -m bench.gpu_check [--json] [--out PATH] [--quick] [--steps a,b] [--budget-s 380]

Steps, each in its own process with a time limit (a failure is recorded with its traceback and
the check goes on):
  device               versions, the device, driver and free memory
  cuda_tests           `pytest -m cuda tests/test_cuda_paths.py` (compiled kernels, paged experts
                       over CUDA copy streams, workers over gRPC and shared memory with the pool
                       on the device, transfer faults against a CUDA pool), the grammar mask
                       on the device (tests/test_structured_engine.py), and the compiled decode
                       step as CUDA graphs (tests/test_cuda_compiled.py: tokens equal to eager,
                       host synchronisations per step counted, paged experts bit-identical, none
                       in a bucket deciding on the device; its figures under
                       figures["compiled"]), the page-in kernel over pinned host memory
                       (tests/test_kernel_expert_copy.py) and split-K decode attention
                       against the reference and batch-independent
                       (tests/test_kernel_split_attention.py), both interpreted without CUDA;
                       the others skip without CUDA
  families             `pytest -m cuda tests/test_cuda_families.py`: every model family's tiny
                       checkpoint on the device (Triton attention and fused MoE) against the CPU's
                       torch path, paged experts bit-identical to resident, bf16, the compiled
                       attention variants, latent pages through CUDA workers; figures per family
                       (max logprob difference from the CPU, ...) under figures["families"]
  quantized            `pytest -m cuda tests/test_cuda_quant.py`: the quantized fused-MoE kernel's
                       cases and start-up checks compiled on the device; every quantized layout
                       against its CPU reference dequantization, paged bit-identical to resident,
                       decode tok/s resident and at K = E/4 (figures under figures["quantized"])
  kernels_interpreted  without CUDA only: the kernel tests (attention variants included) under
                       the Triton interpreter
  attention_bandwidth  Triton paged attention's achieved memory bandwidth (CUDA only)
  real_shape           `bench.real_shape --device cuda` (CUDA only): paged experts at Qwen3-30B-A3B's
                       MoE shape (8 of 48 layers, random bf16 weights, routing from the shipped
                       model's recorded trace), K from preflight at 16 GiB and 24/40/92, batches
                       1/4/16: tok/s, misses, pinned H2D GB/s, ratio to the reference-LRU link
                       bound, no_cliff_ratio, host syncs per step
  engine, experts, transfer   `bench.engine`, `bench.experts`, `bench.transfer` with --device (engine,
                       on CUDA: compiled and eager side by side, compile_s / compile_cached_s)

Writes one JSON (`--out`, default in a new temporary folder):
  {"device": {...}, "steps": [{"name", "status": "ok|failed|skipped", "seconds", "reason",
   "figures", "details"}], "failures": int, ...}
and prints a one-screen summary (on stderr with --json, which puts the JSON on stdout).
Exits 1 when any step failed.  The check needs neither Ray nor FastAPI/uvicorn/pydantic.  When
`cryptography` is missing (the workers' TLS module imports it) or grpcio is older than the one
proto/*_pb2_grpc.py were generated with (they refuse to import), and `.whl/gpu-site` holds
unpacked wheels of them (see docs/operating.md), the steps' processes find them there first.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.gpu_pytest import pytest_step
from bench.gpu_report import summary

ROOT = Path(__file__).resolve().parents[1]
EXTRA_SITE = ROOT / ".whl" / "gpu-site"
MIN_STEP_S = 20.0      # a step is not started with less time than this left in the budget


@dataclass(frozen=True)
class Step:
    name: str
    timeout_s: float
    where: str = "any"        # "any", "cuda" (skipped without CUDA) or "cpu" (skipped with CUDA)
    quick: bool = True        # part of --quick


STEPS = [
    Step("device", 60),
    Step("cuda_tests", 360, quick=False),
    Step("families", 240, where="cuda", quick=False),
    Step("quantized", 240, where="cuda", quick=False),
    Step("kernels_interpreted", 300, where="cpu", quick=False),
    Step("attention_bandwidth", 90, where="cuda"),
    Step("experts", 120),
    Step("real_shape", 300, where="cuda", quick=False),
    Step("engine", 240),
    Step("transfer", 90, quick=False),
]
SKIP_WHY = {"cuda": "needs a CUDA device", "cpu": "on CUDA the compiled kernels run in cuda_tests and families"}
KERNEL_TESTS = ["tests/test_kernel_paged_attention.py", "tests/test_kernel_fused_moe.py",
                "tests/test_kernel_fused_moe_quant.py", "tests/test_kernel_quant_linear.py",
                "tests/test_attention_variants.py", "tests/test_kernel_expert_copy.py",
                "tests/test_kernel_split_attention.py"]


def child_env() -> tuple[dict[str, str], str | None]:
    """The steps' environment: this checkout on the path, plus EXTRA_SITE when a module the
    workers import is missing here and EXTRA_SITE exists."""
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    missing = [m for m in ("cryptography", "_cffi_backend") if importlib.util.find_spec(m) is None]
    extra = str(EXTRA_SITE) if (missing or grpc_too_old()) and EXTRA_SITE.is_dir() else None
    if extra:
        paths.insert(1, extra)      # before the machine's site-packages: its grpcio replaces an old one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TRITON_INTERPRET", None)   # only the kernel tests' own child sets it
    return env, extra


def grpc_too_old() -> bool:
    """Whether the installed grpcio is older than the one proto/*_pb2_grpc.py were generated
    with (they refuse to import then): EXTRA_SITE may carry a newer one."""
    try:
        from importlib.metadata import version
        have = tuple(int(x) for x in version("grpcio").split(".")[:3])
    except Exception:
        return True
    text = (ROOT / "proto" / "worker_pb2_grpc.py").read_text()
    want = text.split("GRPC_GENERATED_VERSION = '", 1)[1].split("'", 1)[0]
    return have < tuple(int(x) for x in want.split(".")[:3])


def run_module_step(name: str, device: str, quick: bool, limit_s: float, env: dict[str, str],
                    tmp: str) -> dict[str, Any]:
    out = os.path.join(tmp, f"{name}.json")
    cmd = [sys.executable, "-m", "bench.gpu_step", name, "--device", device, "--out", out]
    cmd += ["--quick"] if quick else []
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-3000:]
        return {"status": "failed", "reason": f"timed out after {limit_s:.0f} s", "figures": {},
                "details": [tail.decode(errors="replace") if isinstance(tail, bytes) else tail]}
    if os.path.exists(out):
        with open(out) as f:
            return json.load(f)
    return {"status": "failed", "reason": f"the step's process exited with {proc.returncode} and wrote nothing",
            "figures": {}, "details": [proc.stderr[-6000:]]}


def run_step(step: Step, device: str, quick: bool, limit_s: float, env: dict[str, str], tmp: str) -> dict[str, Any]:
    if step.name == "cuda_tests":
        result = pytest_step(["-m", "cuda", "tests/test_cuda_paths.py", "tests/test_structured_engine.py",
                              "tests/test_cuda_compiled.py", "tests/test_kernel_expert_copy.py",
                              "tests/test_kernel_split_attention.py"],
                             limit_s, env, tmp, ROOT, "cuda_tests")
        result["figures"].update(result["figures"].pop("properties", {}))   # "compiled": {...}
        return result
    if step.name == "families":
        result = pytest_step(["-m", "cuda", "tests/test_cuda_families.py"], limit_s, env, tmp, ROOT, "families")
        result["figures"]["families"] = result["figures"].pop("properties", {})
        return result
    if step.name == "quantized":
        result = pytest_step(["-m", "cuda", "tests/test_cuda_quant.py"], limit_s, env, tmp, ROOT, "quantized")
        result["figures"]["quantized"] = result["figures"].pop("properties", {})
        return result
    if step.name == "kernels_interpreted":
        return pytest_step(KERNEL_TESTS, limit_s, env, tmp, ROOT, "kernels_interpreted")
    return run_module_step(step.name, device, quick, limit_s, env, tmp)


def skip_reason(step: Step, cuda: bool, quick: bool, chosen: set[str] | None, left_s: float) -> str | None:
    if chosen is not None and step.name not in chosen:
        return "not selected (--steps)"
    if chosen is None and quick and not step.quick:
        return "not part of --quick"
    if (step.where == "cuda" and not cuda) or (step.where == "cpu" and cuda):
        return SKIP_WHY[step.where]
    if left_s < MIN_STEP_S:
        return f"out of time: {left_s:.0f} s of the budget left"
    return None


def timed(name: str, fn: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    result = fn()
    return {"name": name, **result, "seconds": round(time.monotonic() - t0, 2)}


def check(device: str | None, quick: bool, chosen: set[str] | None, budget_s: float) -> dict[str, Any]:
    """Run the device step, then every other step; returns the report (see the module doc)."""
    env, extra = child_env()
    start = time.monotonic()
    report: dict[str, Any] = {"device": {}, "steps": [], "failures": 0, "quick": quick, "budget_s": budget_s,
                              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "extra_site": extra}
    with tempfile.TemporaryDirectory() as tmp:
        first = timed("device", lambda: run_module_step("device", device or "auto", quick, STEPS[0].timeout_s,
                                                        env, tmp))
        report["steps"].append(first)
        report["device"] = first["figures"]
        device = first["figures"].get("device") or device or "cpu"
        cuda = device.startswith("cuda")
        for step in STEPS[1:]:
            left = budget_s - (time.monotonic() - start)
            why = skip_reason(step, cuda, quick, chosen, left)
            if why is not None:
                report["steps"].append({"name": step.name, "status": "skipped", "reason": why, "figures": {},
                                        "details": [], "seconds": 0.0})
                continue
            limit = min(step.timeout_s, left)
            report["steps"].append(timed(step.name, lambda: run_step(step, device, quick, limit, env, tmp)))
    report["failures"] = sum(s["status"] == "failed" for s in report["steps"])
    report["seconds"] = round(time.monotonic() - start, 2)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the JSON on stdout (the summary goes to stderr)")
    ap.add_argument("--out", help="where to write the JSON (default: a new temporary folder)")
    ap.add_argument("--quick", action="store_true", help="small sizes, one repetition, no pytest steps")
    ap.add_argument("--steps", help="comma-separated step names to run (the rest are reported skipped)")
    ap.add_argument("--device", help="cuda or cpu (default: cuda when the device step finds one)")
    ap.add_argument("--budget-s", type=float, default=380.0, help="stop starting steps after this long")
    args = ap.parse_args(argv)
    chosen = set(args.steps.split(",")) if args.steps else None
    unknown = (chosen or set()) - {s.name for s in STEPS}
    if unknown:
        ap.error(f"unknown steps {sorted(unknown)}; choose from {[s.name for s in STEPS]}")
    report = check(args.device, args.quick, chosen, args.budget_s)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu-check-")) / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    text = summary(report, str(out))
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    print(text, file=sys.stderr if args.json else sys.stdout)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
