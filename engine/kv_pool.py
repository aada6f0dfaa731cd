"""The paged KV cache: `PagePool` owns every page and is the only code that changes
the free list, page owners or generations.  Everyone else reads page tables.

Storage of all layers, K and V together:

    kv: [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]

Per page the pool keeps: the owning request (or None when free), a generation
counter bumped on every allocation (a stale writer can be detected), and whether
each page has been written for its current owner.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch


class PoolExhausted(RuntimeError):
    """Not enough free pages; nothing was allocated."""


@dataclass(frozen=True)
class PageRef:
    """A page as a writer saw it: a write is valid only while the generation matches."""
    page: int
    generation: int


class PagePool:
    def __init__(self, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages}: the KV pool needs at least one page")
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv = torch.zeros(num_layers, 2, num_pages, page_size, num_kv_heads, head_dim,
                              dtype=dtype, device=device)
        self._free: deque[int] = deque(range(num_pages))
        self._owner: list[str | None] = [None] * num_pages
        self._generation: list[int] = [0] * num_pages
        self._written: list[bool] = [False] * num_pages
        self._tables: dict[str, list[int]] = {}

    # ---- queries -------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def page_table(self, request_id: str) -> list[int]:
        """The request's pages in position order (a copy)."""
        return list(self._tables[request_id])

    def owner(self, page: int) -> str | None:
        return self._owner[page]

    def generation(self, page: int) -> int:
        return self._generation[page]

    def is_written(self, page: int) -> bool:
        return self._written[page]

    def refs(self, request_id: str) -> list[PageRef]:
        return [PageRef(p, self._generation[p]) for p in self._tables[request_id]]

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    # ---- ownership changes -----------------------------------------------------
    def allocate(self, request_id: str, num_pages: int) -> list[int]:
        """Give `num_pages` more pages to `request_id` (appended to its page table).

        Returns the new page ids.  Raises PoolExhausted, changing nothing, when fewer
        pages are free.
        """
        if num_pages < 0:
            raise ValueError(f"num_pages={num_pages} must be >= 0")
        if num_pages > len(self._free):
            raise PoolExhausted(f"request {request_id} needs {num_pages} KV pages, "
                                f"{len(self._free)} of {self.num_pages} are free")
        pages = [self._free.popleft() for _ in range(num_pages)]
        for p in pages:
            assert self._owner[p] is None, f"page {p} on the free list is owned by {self._owner[p]}"
            self._owner[p] = request_id
            self._generation[p] += 1
            self._written[p] = False
        self._tables.setdefault(request_id, []).extend(pages)
        return pages

    def mark_tokens_written(self, request_id: str, start: int, count: int) -> None:
        """Record that positions [start, start + count) of `request_id` were written."""
        if count > 0:
            first, last = start // self.page_size, (start + count - 1) // self.page_size
            self.mark_written(request_id, self._tables[request_id][first:last + 1])

    def mark_written(self, request_id: str, pages: list[int]) -> None:
        """Record that `pages` now hold data written for `request_id`."""
        for p in pages:
            assert self._owner[p] == request_id, f"page {p} is not owned by {request_id}"
            self._written[p] = True

    def free(self, request_id: str) -> int:
        """Return every page of `request_id` to the free list; returns how many."""
        pages = self._tables.pop(request_id, [])
        for p in pages:
            assert self._owner[p] == request_id, f"page {p} freed by {request_id}, owned by {self._owner[p]}"
            self._owner[p] = None
            self._written[p] = False
            self._free.append(p)
        return len(pages)

    # ---- invariants ------------------------------------------------------------
    def check_integrity(self) -> None:
        """free + used == capacity, no page owned twice, tables agree with owners.

        Raises AssertionError naming the first violation.
        """
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        used: dict[int, str] = {}
        for rid, pages in self._tables.items():
            for p in pages:
                assert p not in used, f"page {p} is in the tables of {used[p]} and {rid}"
                assert p not in free, f"page {p} of {rid} is also on the free list"
                assert self._owner[p] == rid, f"page {p} in {rid}'s table is owned by {self._owner[p]}"
                used[p] = rid
        assert len(free) + len(used) == self.num_pages, \
            f"free {len(free)} + used {len(used)} != capacity {self.num_pages}"
        for p in free:
            assert self._owner[p] is None, f"free page {p} still has owner {self._owner[p]}"
