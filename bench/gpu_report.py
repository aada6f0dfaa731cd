"""The one-screen summary of a `bench.gpu_check` report."""

from __future__ import annotations

from typing import Any


def _num(v: Any, fmt: str = ".3g") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def _device(f: dict[str, Any]) -> str:
    where = f.get("name") or f.get("device", "?")
    mem = f" free {_num(f['free_gib'], '.1f')}/{_num(f['total_gib'], '.1f')} GiB" if "free_gib" in f else ""
    return (f"{where}{mem}  torch {f.get('torch')} (CUDA {f.get('torch_cuda')})  triton {f.get('triton')}  "
            f"python {f.get('python')}  driver {f.get('driver', '-')}  grpc {f.get('packages', {}).get('grpc')}")


def _experts(f: dict[str, Any]) -> str:
    parts = [f"link {_num(f.get('h2d_pinned_gbps'))} GB/s ({f.get('link_measured_by')}), K={f.get('K')}"]
    for batch, s in f.get("summary", {}).items():
        parts.append(f"{batch}: paged/resident {_num(s.get('paged_vs_resident'))} hit {_num(s.get('hit_rate'))} "
                     f"bound/seq {_num(s.get('link_bound_tok_s_per_seq'))} tok/s")
    return "; ".join(parts)


def _real_shape(f: dict[str, Any]) -> str:
    parts = [f"link {_num(f.get('h2d_pinned_gbps'))} GB/s, {f.get('layers_run')}/{f.get('layers_published')} layers"]
    for k, s in f.get("summary", {}).items():
        parts.append(f"{k}: b1 {_num(s.get('tok_s_b1'))} tok/s = {_num(s.get('ratio_to_bound_b1'))} of bound, "
                     f"b4/b1 {_num(s.get('b4_over_b1'))}, no-cliff {_num(s.get('no_cliff_ratio'))}")
    return "; ".join(parts)


def _families(f: dict[str, Any]) -> str:
    diffs = ", ".join(f"{name} {_num(v.get('cuda_vs_cpu_max_logprob_diff'), '.1e')}"
                      for name, v in sorted(f.get("families", {}).items()))
    return (f"passed {f.get('passed')} failed {f.get('failed')} errors {f.get('errors')} skipped {f.get('skipped')}"
            + (f"; max |logprob| cuda-cpu: {diffs}" if diffs else ""))


LINES = {
    "device": _device,
    "cuda_tests": lambda f: f"passed {f.get('passed')} failed {f.get('failed')} errors {f.get('errors')} "
                            f"skipped {f.get('skipped')}",
    "families": _families,
    "kernels_interpreted": lambda f: f"passed {f.get('passed')} failed {f.get('failed')} skipped {f.get('skipped')}",
    "attention_bandwidth": lambda f: f"{_num(f.get('achieved_gbps'))} GB/s = {_num(f.get('fraction_of_peak'))} of "
                                     f"peak {_num(f.get('peak_gbps'))}, "
                                     f"{_num(f.get('fraction_of_copy'))} of a d2d copy "
                                     f"({_num(f.get('median_ms'))} ms); same bytes "
                                     + ", ".join(f"{k}: {_num(v)}" for k, v in f.get("same_bytes", {}).items())
                                     + "; split-K/one pass " + ", ".join(
                                         f"{k}: {_num(v.get('split_gbps'))}/{_num(v.get('one_pass_gbps'))}"
                                         for k, v in f.get("split_k", {}).items()),
    "engine": lambda f: f"single {_num(f.get('engine_single_tok_s'))} tok/s, 16 concurrent "
                        f"{_num(f.get('engine_batch16_tok_s'))} tok/s ({f.get('attention_backend')})",
    "experts": _experts,
    "real_shape": _real_shape,
    "transfer": lambda f: f"local {_num(f.get('local_gbps'))} shm {_num(f.get('shm_gbps'))} grpc "
                          f"{_num(f.get('grpc_gbps'))} (4 streams {_num(f.get('grpc4_gbps'))}) GB/s, "
                          f"d2h {_num(f.get('memcpy_gbps'))} GB/s",
}


def summary(report: dict[str, Any], path: str) -> str:
    """Lines: the device, one per step (figures or the reason), the first line of each failure."""
    lines = [f"gpu_check: {_device(report.get('device') or {})}"]
    for s in report["steps"]:
        what = s["reason"] if s["status"] != "ok" or not s["figures"] else LINES[s["name"]](s["figures"])
        lines.append(f"  {s['status']:7s} {s['name']:20s} {s['seconds']:6.1f}s  {what}"[:220])
    for s in report["steps"]:
        for d in s.get("details", [])[:6]:
            first = d.strip().splitlines()[0] if d.strip() else ""
            lines.append(f"  ! {s['name']}: {first}"[:220])
    lines.append(f"{report['failures']} failed step(s) in {report.get('seconds', 0):.0f} s; JSON: {path}")
    return "\n".join(lines)
