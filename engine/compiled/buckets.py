"""Batch buckets: the sizes a compiled decode step runs at, and padding a decode batch to one.

A decode batch of n requests runs as the smallest bucket b >= n: rows n..b-1 are padding.  A
padding row decodes token 0 at position 0 into the pool's scratch page (`PagePool.scratch_page`,
never owned by a request) and attends to that page only, so it reads and writes nothing of any
request; its outputs are dropped.  The page table is padded in width with the scratch page too
(those keys are masked).  Every row's result depends on its own inputs only, so padding never
changes a real request's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence


def decode_buckets(max_num_seqs: int, wanted: Sequence[int] | None = None) -> tuple[int, ...]:
    """The default buckets 1, 2, 4, ... below `max_num_seqs`, and `max_num_seqs` itself; or
    `wanted` (sorted, deduplicated).  Raises ValueError for a wanted size outside
    1..max_num_seqs or an empty list."""
    if wanted is not None:
        sizes = sorted(set(wanted))
        bad = [b for b in sizes if not 1 <= b <= max_num_seqs]
        if not sizes or bad:
            raise ValueError(f"compile buckets {list(wanted)}: each must be a batch size from 1 to "
                             f"max_num_seqs={max_num_seqs}, and at least one is needed")
        return tuple(sizes)
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return (*out, max_num_seqs)


def parse_buckets(text: str) -> list[int]:
    """"1,2,4,8" -> [1, 2, 4, 8].  Raises ValueError naming the bad entry."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"compile buckets {text!r}: {part!r} is not a positive batch size "
                             "(expected sizes separated by commas, e.g. 1,2,4,8)")
        out.append(int(part))
    return out


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding n rows; None when n exceeds the largest."""
    return next((b for b in buckets if b >= n), None)


def pad_rows(tokens: list[list[int]], starts: list[int], tables: list[list[int]], size: int,
             scratch_page: int) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """A decode batch's rows (one token each, as `build_batch` takes them) padded to `size` rows
    with padding rows on the scratch page.  Raises ValueError for more rows than `size`."""
    n = len(tokens)
    if n > size:
        raise ValueError(f"a decode batch of {n} rows does not fit the bucket of {size}")
    extra = size - n
    return tokens + [[0]] * extra, starts + [0] * extra, tables + [[scratch_page]] * extra
