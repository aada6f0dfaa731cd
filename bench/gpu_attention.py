"""The Triton decode paged-attention kernel's achieved memory bandwidth on a large shape.

Decode attention reads every cached K and V byte once per step, so its speed is bounded by
memory bandwidth.  `attention_bandwidth` times the compiled kernel on (by default) 64
sequences of 4,096 tokens, 8 KV heads of 128, 32 query heads, bf16, 16-token pages in a
shuffled order, and divides the bytes it must read (K, V, q, the page table) and write (out)
by the median time.  It is compared with the device's published peak (PEAK_BYTES_PER_S, with
the source of each figure) and with a device-to-device copy measured in the same run.
`same_bytes` repeats the measurement with the same cache split into fewer, longer sequences
and more, shorter ones: the kernel runs one program per (sequence, KV head, chunk of keys), so
this shows how its bandwidth depends on the number of programs.  Every shape is timed as served
(split-K: `achieved_gbps`) and with splitting off (`one_pass_gbps`, max_splits=1, the kernel
before split-K); `split_k` lists both for the default shape and the one of 4x fewer, 4x longer
sequences (64 x 4,096 and 16 x 16,384 by default).  CUDA only: bench.gpu_check skips it elsewhere.
"""

from __future__ import annotations

from typing import Any

import torch

# Published HBM bandwidth, bytes/s, by a substring of torch.cuda.get_device_name().
#   H200: 4.8 TB/s HBM3e, NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200/)
#   H100 SXM: 3.35 TB/s HBM3, NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100/)
#   A100 80GB SXM: 2.039 TB/s HBM2e, NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100/)
PEAK_BYTES_PER_S = {"H200": (4.8e12, "NVIDIA H200 datasheet: 4.8 TB/s HBM3e"),
                    "H100": (3.35e12, "NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3"),
                    "A100": (2.039e12, "NVIDIA A100 80GB SXM datasheet: 2.039 TB/s HBM2e")}


def published_peak(name: str) -> tuple[float | None, str]:
    """(bytes/s, source) for a device name; (None, why) when the table does not know it."""
    for key, (peak, source) in PEAK_BYTES_PER_S.items():
        if key in name:
            return peak, source
    return None, f"no published peak recorded for {name!r} (bench/gpu_attention.py PEAK_BYTES_PER_S)"


def _median_seconds(fn: Any, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: str, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Device-to-device copy, bytes/s counting the read and the write."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * nbytes / _median_seconds(lambda: b.copy_(a), repeats)


def attention_bandwidth(device: str = "cuda", seqs: int = 64, tokens: int = 4096, kv_heads: int = 8,
                        q_heads: int = 32, head_dim: int = 128, page_size: int = 16,
                        dtype: torch.dtype = torch.bfloat16, repeats: int = 10) -> dict[str, Any]:
    """The figures of the module doc for the stated shape, with `same_bytes`."""
    result = kernel_bandwidth(device, seqs, tokens, kv_heads, q_heads, head_dim, page_size, dtype, repeats)
    name = torch.cuda.get_device_name(torch.device(device))
    peak, source = published_peak(name)
    copy = copy_bandwidth(device)
    achieved = result["achieved_gbps"] * 1e9
    result.update(peak_gbps=peak / 1e9 if peak else None, peak_source=source,
                  fraction_of_peak=achieved / peak if peak else None, d2d_copy_gbps=copy / 1e9,
                  fraction_of_copy=achieved / copy, units="GB/s (1e9 bytes/s)")
    others = {f"{s}x{t}": kernel_bandwidth(device, s, t, kv_heads, q_heads, head_dim, page_size, dtype, repeats)
              for s, t in ((seqs // 4, tokens * 4), (seqs * 4, tokens // 4))}
    result["same_bytes"] = {k: r["achieved_gbps"] for k, r in others.items()}
    result["split_k"] = {f"{r['shape']['seqs']}x{r['shape']['tokens']}": {
        "split_gbps": r["achieved_gbps"], "one_pass_gbps": r["one_pass_gbps"]}
        for r in (result, others[f"{seqs // 4}x{tokens * 4}"])}
    return result


def kernel_bandwidth(device: str, seqs: int, tokens: int, kv_heads: int, q_heads: int, head_dim: int,
                     page_size: int, dtype: torch.dtype, repeats: int) -> dict[str, Any]:
    """Time the kernel on one shape, split-K (as served) and one pass (max_splits=1); checks two
    sequences against the torch reference first (raises AssertionError when they differ)."""
    from engine.kernels.paged_attention import paged_decode_attention_ref
    from engine.kernels.triton.paged_attention import paged_decode_attention
    from engine.kernels.triton.split_combine import MAX_SPLITS
    gen = torch.Generator(device=device).manual_seed(0)
    pages_per_seq = tokens // page_size
    num_pages = seqs * pages_per_seq
    shape = (num_pages, page_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen, device=device, dtype=dtype)      # [P, S, Hkv, D]
    v = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    q = torch.randn(seqs, q_heads, head_dim, generator=gen, device=device, dtype=dtype)   # [B, Hq, D]
    table = torch.randperm(num_pages, generator=gen, device=device).view(seqs, pages_per_seq).to(torch.int32)
    lens = torch.full((seqs,), tokens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    want = paged_decode_attention_ref(q[:2], k, v, table[:2], lens[:2], scale)
    seconds = {}
    for name, max_splits in (("split", MAX_SPLITS), ("one_pass", 1)):
        got = paged_decode_attention(q[:2], k, v, table[:2], lens[:2], scale, max_splits=max_splits)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        seconds[name] = _median_seconds(
            lambda: paged_decode_attention(q, k, v, table, lens, scale, max_splits=max_splits), repeats)
    nbytes = 2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size() + table.numel() * 4
    return {"shape": {"seqs": seqs, "tokens": tokens, "kv_heads": kv_heads, "q_heads": q_heads,
                      "head_dim": head_dim, "page_size": page_size, "dtype": str(dtype).removeprefix("torch.")},
            "bytes_moved": nbytes, "median_ms": seconds["split"] * 1e3, "repeats": repeats,
            "achieved_gbps": nbytes / seconds["split"] / 1e9, "one_pass_ms": seconds["one_pass"] * 1e3,
            "one_pass_gbps": nbytes / seconds["one_pass"] / 1e9}
