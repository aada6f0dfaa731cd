"""Page-ins read from mapped pinned host memory (`tandem::page_in_experts` on CUDA).

One program per (expert j of the step, block of BLOCK words of one tensor's row): it loads the
step's miss count, returns at once when j is past it, else copies its block from the store's
row src[j] to the slot's row dst[j].  The store lives in page-locked host memory, which a CUDA
device with unified addressing reads through its own mapping at the same address: the loads
cross the link, the stores land in device memory, and the host is never asked anything (the
launch is capturable in a CUDA graph).  Rows move as the widest word that divides their bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024    # words per program


@triton.jit
def _page_in_kernel(dst_ptr: tl.tensor, src_ptr: tl.tensor, slot_ptr: tl.tensor, expert_ptr: tl.tensor,
                    count_ptr: tl.tensor, row_words: tl.tensor, BLOCK: tl.constexpr) -> None:
    j = tl.program_id(0)
    n = tl.load(count_ptr)
    if j < n:
        slot = tl.load(slot_ptr + j).to(tl.int64)
        expert = tl.load(expert_ptr + j).to(tl.int64)
        offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_words
        words = tl.load(src_ptr + expert * row_words + offs, mask=mask)
        tl.store(dst_ptr + slot * row_words + offs, words, mask=mask)


class _Mapped:
    """A pinned host tensor as Triton sees a pointer: its address (the device's mapping of it)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()


def words(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` [rows, ...] (contiguous) as [rows, n] of the widest integer word dividing a row."""
    raw = t.reshape(rows, -1).view(torch.uint8)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if raw.shape[1] % size == 0:
            return raw.view(dtype)
    return raw


def page_in_mapped(slots: list[torch.Tensor], store: list[torch.Tensor], dst: torch.Tensor, src: torch.Tensor,
                   count: torch.Tensor) -> None:
    """For j < count[0]: slots[i][dst[j]] = store[i][src[j]] (see the module doc).  On a CPU
    (the interpreter, for tests) the store is an ordinary tensor."""
    m = dst.shape[0]
    for s, h in zip(slots, store, strict=True):
        if not (s.is_contiguous() and h.is_contiguous()):
            raise ValueError("expert slots and store must be contiguous to page in on the device")
        if s.shape[1:] != h.shape[1:] or s.dtype != h.dtype:
            raise ValueError(f"slot rows {tuple(s.shape[1:])} {s.dtype} do not match the store's "
                             f"{tuple(h.shape[1:])} {h.dtype}")
        d, w = words(s, s.shape[0]), words(h, h.shape[0])
        row = d.shape[1]
        source = _Mapped(w) if (s.is_cuda and not w.is_cuda) else w
        _page_in_kernel[(m, triton.cdiv(row, BLOCK))](d, source, dst, src, count, row, BLOCK=BLOCK)


def check_mapped_page_in(device: torch.device | str) -> None:
    """Start-up: page two experts of a small pinned store into slots on `device` and compare.
    Raises RuntimeError when the device cannot read pinned host memory this way (then the
    host plans every paged step)."""
    store = [torch.arange(6 * 40, dtype=torch.float32).view(6, 40).pin_memory(),
             torch.arange(6 * 3, dtype=torch.int16).view(6, 3).pin_memory()]
    slots = [torch.zeros(4, 40, device=device), torch.zeros(4, 3, dtype=torch.int16, device=device)]
    dst, src = torch.tensor([3, 1, 0, 2], device=device), torch.tensor([5, 2, 0, 0], device=device)
    try:
        page_in_mapped(slots, store, dst, src, torch.tensor([2], device=device))
        got = [s.cpu() for s in slots]
    except Exception as e:   # the launch itself refused the pointer
        raise RuntimeError(f"the device cannot page experts in from pinned host memory: {e}") from e
    want = [torch.zeros_like(g) for g in got]
    for w, h in zip(want, store):
        w[3], w[1] = h[5], h[2]
    if not all(torch.equal(g, w) for g, w in zip(got, want)):
        raise RuntimeError("paging experts in from pinned host memory on the device copied wrong bytes")
