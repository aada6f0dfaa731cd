"""Page-ins decided on the device: copy up to M experts from the host store into their slots,
as one op a compiled graph (or a captured CUDA graph) can hold.

    page_in_experts(slots, store, dst, src, count)
        for j < count:  slots[i][dst[j]] = store[i][src[j]]   for every tensor i of an expert

`dst` and `src` are [M] int64 (M fixed per graph: the slots' count), `count` a [1] int64 on the
slots' device, all three written by the device-side decision (engine/experts/device_plan.py);
entries past `count` are never read.  The op is opaque to dynamo (`tandem::page_in_experts`):
how it moves the bytes depends on where they are.
  * CPU (store and slots in host memory): a copy of the first `count` rows, `count` read where
    it lies (no device to wait for), so a step copies only its misses;
  * CUDA (store in pinned host memory): a Triton kernel reads the store through the device's
    mapping of pinned memory and writes the slots, every program checking `count` itself, so
    nothing is read back to the host and the launch can be captured (engine/kernels/triton/
    expert_copy.py).
"""

from __future__ import annotations

import torch

# Registered at import, through torch.library.Library rather than `custom_op`: a compiled CPU
# step calls it once per paged MoE layer, and custom_op's wrappers cost ~27 us a call against
# ~4.5 us this way (measured in an inductor graph on the 2-core machine).
_LIB = torch.library.Library("tandem", "FRAGMENT")
_LIB.define("page_in_experts(Tensor(a!)[] slots, Tensor[] store, Tensor dst, Tensor src, Tensor count) -> ()")


def _on_host(slots: list[torch.Tensor], store: list[torch.Tensor], dst: torch.Tensor, src: torch.Tensor,
             count: torch.Tensor) -> None:
    n = count.item()   # where it lies: no device to wait for
    if not n:
        return
    rows, experts = dst[:n], src[:n]
    for s, h in zip(slots, store, strict=True):
        s.index_copy_(0, rows, h.index_select(0, experts))


def _on_cuda(slots: list[torch.Tensor], store: list[torch.Tensor], dst: torch.Tensor, src: torch.Tensor,
             count: torch.Tensor) -> None:
    from engine.kernels.triton.expert_copy import page_in_mapped
    page_in_mapped(slots, store, dst, src, count)


def _fake(slots: list[torch.Tensor], store: list[torch.Tensor], dst: torch.Tensor, src: torch.Tensor,
          count: torch.Tensor) -> None:
    return None


_LIB.impl("page_in_experts", _on_host, "CPU")
_LIB.impl("page_in_experts", _on_cuda, "CUDA")
_LIB.impl("page_in_experts", _fake, "Meta")
torch.library.register_fake("tandem::page_in_experts", _fake)


def page_in_experts(slots: list[torch.Tensor], store: list[torch.Tensor], dst: torch.Tensor, src: torch.Tensor,
                    count: torch.Tensor) -> None:
    """See the module doc.  slots[i]: [K, ...]; store[i]: [E, ...] with the same row shape."""
    torch.ops.tandem.page_in_experts(slots, store, dst, src, count)
