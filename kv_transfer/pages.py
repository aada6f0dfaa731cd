"""Moving page bytes between a `PagePool` and frame payloads.

The pool stores `kv[L, C, P, S, H, D]` (C = 2: K and V; C = 1: an MLA latent row, H = 1);
a frame's payload is the contiguous block

    kv[l0:l1, :, page, :n]      # [l1 - l0, C, n, H, D]

These helpers read such a block out (sender), write one in (receiver) and hash one
where it lies (the receiver's re-checksum after commit).  They never change page
ownership: that belongs to the pool's owner.
"""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.kv_pool import PagePool

if TYPE_CHECKING:
    from kv_transfer.frame import Buffer

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"KV dtype {dtype} cannot be transferred; supported: {sorted(DTYPES)}")
    return DTYPE_NAMES[dtype]


def tokens_in_page(page_size: int, prompt_len: int, index: int) -> int:
    """Prompt tokens in logical page `index` (the last page may be partly filled)."""
    return min(page_size, prompt_len - index * page_size)


def block_shape(pool: PagePool, l0: int, l1: int, n: int) -> tuple[int, ...]:
    components, heads, dim = pool.geometry
    return (l1 - l0, components, n, heads, dim)


def block_nbytes(pool: PagePool, l0: int, l1: int, n: int) -> int:
    numel = 1
    for s in block_shape(pool, l0, l1, n):
        numel *= s
    return numel * pool.kv.element_size()


def as_bytes(t: torch.Tensor) -> memoryview:
    """A CPU contiguous tensor's bytes, without a copy."""
    assert t.device.type == "cpu" and t.is_contiguous()
    # numpy's stubs give ndarray the buffer protocol (__buffer__) only for Python >= 3.12
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


Payload = torch.Tensor | bytes     # a staged uint8 tensor, or bytes for transports that want them


def payload_view(p: Payload) -> memoryview:
    return as_bytes(p) if isinstance(p, torch.Tensor) else memoryview(p)


def read_bytes(pool: PagePool, page: int, l0: int, l1: int, n: int) -> bytes:
    """kv[l0:l1, :, page, :n] gathered straight into a new bytes object (one copy)."""
    if pool.kv.device.type == "cpu":
        return pool_bytes(pool)[l0:l1, :, page, :n].tobytes()
    return as_bytes(read_block(pool, page, l0, l1, n)).tobytes()


def read_block(pool: PagePool, page: int, l0: int, l1: int, n: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy kv[l0:l1, :, page, :n] into `out` (a CPU uint8 tensor of the block's size) or a new
    CPU tensor; returns `out`."""
    if out is None:
        out = torch.empty(block_nbytes(pool, l0, l1, n), dtype=torch.uint8,
                          pin_memory=pool.kv.device.type == "cuda")
    if pool.kv.device.type == "cpu":
        src = pool_bytes(pool)[l0:l1, :, page, :n]
        np.copyto(out.numpy().reshape(src.shape), src)
    else:
        block = pool.kv[l0:l1, :, page, :n]
        out.view(block.dtype).view(block.shape).copy_(block)
    return out


def write_payload(pool: PagePool, page: int, l0: int, l1: int, n: int, payload: Buffer) -> None:
    """kv[l0:l1, :, page, :n] = the block `payload` carries (the caller checked its size)."""
    if pool.kv.device.type == "cpu":
        dst = pool_bytes(pool)[l0:l1, :, page, :n]
        np.copyto(dst, np.frombuffer(payload, dtype=np.uint8).reshape(dst.shape))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffers: the tensor is only read
        flat = torch.frombuffer(payload, dtype=torch.uint8)
    block = flat.view(pool.kv.dtype).view(block_shape(pool, l0, l1, n))
    pool.kv[l0:l1, :, page, :n].copy_(block)


def holds_block(pool: PagePool, page: int, l0: int, l1: int, n: int, payload: Buffer) -> bool:
    """Whether kv[l0:l1, :, page, :n] already holds exactly the block `payload` carries."""
    held = b"".join(bytes(part) for part in block_parts(pool, page, l0, l1, n))
    return held == bytes(payload)


_BYTES: "weakref.WeakKeyDictionary[PagePool, np.ndarray]" = weakref.WeakKeyDictionary()


def pool_bytes(pool: PagePool) -> np.ndarray:
    """The CPU pool's storage as a uint8 array [L, C, P, S, H, D * itemsize] (no copy, cached)."""
    arr = _BYTES.get(pool)
    if arr is None:
        kv = pool.kv
        arr = _BYTES[pool] = kv.view(torch.uint8).numpy().reshape(*kv.shape[:-1], -1)
    return arr


def block_parts(pool: PagePool, page: int, l0: int, l1: int, n: int) -> list[memoryview]:
    """The bytes of kv[l0:l1, :, page, :n] where they lie, as contiguous parts in payload order."""
    if pool.kv.device.type != "cpu":
        return [as_bytes(pool.kv[l0:l1, :, page, :n].cpu())]
    arr = pool_bytes(pool)
    # numpy's stubs give ndarray the buffer protocol (__buffer__) only for Python >= 3.12
    return [memoryview(arr[layer, j, page, :n])  # type: ignore[arg-type]
            for layer in range(l0, l1) for j in range(arr.shape[1])]
