"""Split-K for the Triton decode attention: the rule that cuts a sequence's keys into chunks,
and the kernel that combines the chunks' partial softmaxes.

A sequence whose visible keys (n = seq_len - first, first > 0 only with a window) exceed
SPLIT_TOKENS is cut into `splits` chunks of `chunk` consecutive positions, each attended by its
own program of the decode kernel, which writes a partial (running max m, sum l, unnormalised
accumulator acc; fp32):

    splits0 = min(max(cdiv(n, split_tokens), 1), max_splits)
    chunk   = max(cdiv(cdiv(n, splits0), BLOCK_N), 1) * BLOCK_N    # whole key blocks
    splits  = max(cdiv(n, chunk), 1)                               # no chunk left empty

    keys     first ......................................... seq_len
    chunks   |  0: chunk  |  1: chunk  | ... | splits-1: the rest |

The rule reads only the sequence's own length and constants of the model and the code (the
window, BLOCK_N from the head and page sizes, split_tokens, max_splits), never the batch.  A
sequence with one split is not combined: its one program writes the output itself, exactly as
the one-pass kernel did.  Then

    out = sum_i acc_i * 2^(m_i - M) / sum_i l_i * 2^(m_i - M),   M = max_i m_i

summed in split order.  Sinks enter through split 0's partial (its max starts at the sink logit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Key positions per chunk, before the cap.  1,024 positions of a 128-dim bf16 head read 512 KB
# of K and V per program, against an 8 KB partial for 16 query heads: the partials cost ~2% of the
# traffic, and 16 sequences of 16k (8 KV heads) become 2,048 programs for 132 SMs instead of 128.
SPLIT_TOKENS = 1024
# The most chunks of one sequence (a power of two): longer sequences get longer chunks.  It sizes
# the grid and the fp32 workspace: B * Hq * MAX_SPLITS * (Dv + 2) * 4 bytes per call.
MAX_SPLITS = 16


def split_plan(n_keys: int, block_n: int, split_tokens: int = SPLIT_TOKENS,
               max_splits: int = MAX_SPLITS) -> tuple[int, int]:
    """(chunk, splits) for a sequence with `n_keys` visible keys: the kernels' rule, in Python."""
    splits0 = min(max(-(-n_keys // split_tokens), 1), max_splits)
    chunk = max(-(-(-(-n_keys // splits0)) // block_n), 1) * block_n
    return chunk, max(-(-n_keys // chunk), 1)


@triton.jit
def split_rule(n_keys: tl.tensor, BLOCK_N: tl.constexpr, SPLIT_TOKENS: tl.constexpr,
               MAX_SPLITS: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """(chunk, splits): `split_plan` in the kernels."""
    splits0 = tl.minimum(tl.maximum(tl.cdiv(n_keys, SPLIT_TOKENS), 1), MAX_SPLITS)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(n_keys, splits0), BLOCK_N), 1) * BLOCK_N
    return chunk, tl.maximum(tl.cdiv(n_keys, chunk), 1)


@triton.jit
def visible_keys(sl_ptr: tl.tensor, b: tl.tensor, max_pages: tl.tensor, window: tl.tensor,
                 PAGE_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """(first, seq_len): request b's keys are first .. seq_len - 1."""
    # The reference only sees max_pages * S positions: clamp like it does.
    seq_len = tl.minimum(tl.load(sl_ptr + b), max_pages * PAGE_SIZE)
    first = seq_len * 0
    if HAS_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    return first, seq_len


@triton.jit(do_not_specialize=["max_pages"])  # as the decode kernel's (see there)
def _combine_kernel(
    sl_ptr: tl.tensor, m_ptr: tl.tensor, l_ptr: tl.tensor, acc_ptr: tl.tensor, o_ptr: tl.tensor,
    stride_mb: tl.tensor, stride_mh: tl.tensor,                        # m, l: [B, Hq, MAX_SPLITS]
    stride_ab: tl.tensor, stride_ah: tl.tensor, stride_as: tl.tensor,  # acc:  [B, Hq, MAX_SPLITS, Dv]
    stride_ob: tl.tensor, stride_oh: tl.tensor,                        # o:    [B, Hq, Dv]
    max_pages: tl.tensor, window: tl.tensor,
    PAGE_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr, MAX_SPLITS: tl.constexpr, DV: tl.constexpr, V_DIM: tl.constexpr,
) -> None:
    b = tl.program_id(0)
    head = tl.program_id(1)
    first, seq_len = visible_keys(sl_ptr, b, max_pages, window, PAGE_SIZE, HAS_WINDOW)
    _, splits = split_rule(seq_len - first, BLOCK_N, SPLIT_TOKENS, MAX_SPLITS)
    if splits > 1:  # one split: the decode kernel wrote the output
        offs_s = tl.arange(0, MAX_SPLITS)
        offs_v = tl.arange(0, DV)
        ml_off = b * stride_mb + head * stride_mh
        m_all = tl.load(m_ptr + ml_off + offs_s, mask=offs_s < splits, other=float("-inf"))
        m_max = tl.max(m_all, axis=0)                     # finite: every chunk holds a key
        l_all = tl.load(l_ptr + ml_off + offs_s, mask=offs_s < splits, other=0.0)
        l_sum = tl.sum(l_all * tl.exp2(m_all - m_max), axis=0)
        acc = tl.zeros([DV], tl.float32)
        acc_row = acc_ptr + b * stride_ab + head * stride_ah + offs_v
        for i in range(0, splits):                        # in split order
            w = tl.exp2(tl.load(m_ptr + ml_off + i) - m_max)
            acc += tl.load(acc_row + i * stride_as, mask=offs_v < V_DIM, other=0.0) * w
        out = acc / l_sum
        tl.store(o_ptr + b * stride_ob + head * stride_oh + offs_v, out.to(o_ptr.dtype.element_ty),
                 mask=offs_v < V_DIM)


def partials(bsz: int, hq: int, dv: int, max_splits: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised fp32 workspace (m, l [B, Hq, S]; acc [B, Hq, S, Dv]); only the chunks
    that exist are written, and only those are read."""
    m = torch.empty((bsz, hq, max_splits), dtype=torch.float32, device=device)
    return m, torch.empty_like(m), torch.empty((bsz, hq, max_splits, dv), dtype=torch.float32, device=device)


def combine(seq_lens: torch.Tensor, m: torch.Tensor, l_sum: torch.Tensor, acc: torch.Tensor,
            out: torch.Tensor, max_pages: int, window: int | None, page_size: int, block_n: int,
            split_tokens: int, max_splits: int) -> None:
    """Write out[b] for every request b with more than one chunk; rows of one chunk are left
    as the decode kernel wrote them.  Arguments as the decode kernel's launch got them."""
    bsz, hq, dv = out.shape
    _combine_kernel[(bsz, hq)](
        seq_lens, m, l_sum, acc, out,
        m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
        out.stride(0), out.stride(1), max_pages, window or 0,
        PAGE_SIZE=page_size, HAS_WINDOW=window is not None, BLOCK_N=block_n,
        SPLIT_TOKENS=split_tokens, MAX_SPLITS=max_splits, DV=max(16, triton.next_power_of_2(dv)), V_DIM=dv,
    )
