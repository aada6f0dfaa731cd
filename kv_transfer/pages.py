"""Moving page bytes between a `PagePool` and frame payloads.

The pool stores `kv[L, 2, P, S, Hkv, D]`; a frame's payload is the contiguous block

    kv[l0:l1, :, page, :n]      # [l1 - l0, 2, n, Hkv, D]

These helpers read such a block out (sender), write one in (receiver) and hash one
where it lies (the receiver's re-checksum after commit).  They never change page
ownership: that belongs to the pool's owner.
"""

from __future__ import annotations

import warnings

import torch

from engine.kv_pool import PagePool

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"KV dtype {dtype} cannot be transferred; supported: {sorted(DTYPES)}")
    return DTYPE_NAMES[dtype]


def block_shape(pool: PagePool, l0: int, l1: int, n: int) -> tuple[int, ...]:
    _, _, _, _, heads, dim = pool.kv.shape
    return (l1 - l0, 2, n, heads, dim)


def block_nbytes(pool: PagePool, l0: int, l1: int, n: int) -> int:
    numel = 1
    for s in block_shape(pool, l0, l1, n):
        numel *= s
    return numel * pool.kv.element_size()


def as_bytes(t: torch.Tensor) -> memoryview:
    """A CPU contiguous tensor's bytes, without a copy."""
    assert t.device.type == "cpu" and t.is_contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def read_block(pool: PagePool, page: int, l0: int, l1: int, n: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy kv[l0:l1, :, page, :n] into `out` (a CPU uint8 tensor of the block's size) or a new
    CPU tensor; returns it with the block's dtype and shape."""
    src = pool.kv[l0:l1, :, page, :n]
    if out is None:
        pin = pool.kv.device.type == "cuda"
        out = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
    else:
        out = out.view(src.dtype).view(src.shape)
    out.copy_(src)
    return out


def view_payload(payload, pool: PagePool, l0: int, l1: int, n: int) -> torch.Tensor:
    """A payload buffer seen as the block it carries (no copy; the caller checked its size)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffers: the tensor is only read
        flat = torch.frombuffer(payload, dtype=torch.uint8)
    return flat.view(pool.kv.dtype).view(block_shape(pool, l0, l1, n))


def write_block(pool: PagePool, page: int, l0: int, l1: int, block: torch.Tensor) -> None:
    """kv[l0:l1, :, page, :n] = block (on the pool's device)."""
    pool.kv[l0:l1, :, page, :block.shape[2]].copy_(block, non_blocking=False)


def block_parts(pool: PagePool, page: int, l0: int, l1: int, n: int) -> list[memoryview]:
    """The bytes of kv[l0:l1, :, page, :n] where they lie, as contiguous parts in payload order."""
    block = pool.kv[l0:l1, :, page, :n]
    if block.device.type != "cpu":
        return [as_bytes(block.cpu())]
    if block.is_contiguous():
        return [as_bytes(block)]
    return [as_bytes(block[i, j]) for i in range(block.shape[0]) for j in range(2)]
