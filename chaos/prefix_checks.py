"""The prefix scenarios' rules on their own (chaos.prefix): what a request may be served from
the cache, and which cached pages changed between two readings."""

from __future__ import annotations

from collections.abc import Sequence

from chaos.client import Outcome
from engine.prefix_cache import max_cached_pages

PageDigests = dict[int, tuple[int, str]]     # page -> (generation, digest), ChaosControl.cache_pages


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def own_bound(o: Outcome, others: list[Outcome], page_size: int) -> int:
    """The most cached tokens `o` may be served: the longest prefix of its prompt that another
    request of its own cohort (same tenant, same cache_salt) among `others` held in its prompt
    and output, in whole pages, never reaching the prompt's last token.  Another tenant's or
    another salt's requests count for nothing (I10)."""
    cohort = (o.job.tenant, o.job.cache_salt)
    best = max((common_prefix(o.job.ids, p.job.ids + p.token_ids) for p in others
                if p is not o and (p.job.tenant, p.job.cache_salt) == cohort), default=0)
    return min(best // page_size, max_cached_pages(len(o.job.ids), page_size)) * page_size


def digests_changed(before: PageDigests, after: PageDigests) -> tuple[int, list[int]]:
    """(pages cached in both readings under the same generation, those of them whose bytes
    differ).  A cached page is read-only until evicted, and reusing it bumps its generation."""
    same = [p for p, (gen, _) in before.items() if p in after and after[p][0] == gen]
    return len(same), [p for p in same if after[p][1] != before[p][1]]
