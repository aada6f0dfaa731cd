"""What one forward pass needs to know about its batch, as tensors.

Tokens of all requests are flattened ([T]); request b's tokens are contiguous and in
order.  A decode batch has exactly one token per request (T == B).  A prefill batch
also carries a padded view for attention:

    q_index [B, Qmax]: flat token index of each request's i-th query (padding -> 0)
    q_valid [B, Qmax]: which entries of q_index are real
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor      # [T] int64
    positions: torch.Tensor      # [T] int64
    slot_mapping: torch.Tensor   # [T] int64: page * page_size + offset, where K/V is written
    page_table: torch.Tensor     # [B, max_pages] int32
    seq_lens: torch.Tensor       # [B] int32: tokens in the cache after this pass
    logits_indices: torch.Tensor  # [R] int64: flat index of the tokens whose hidden states come back:
                                  # each request's last token, or its last `logits_counts[b]` tokens
    is_decode: bool
    max_seq_len: int = 0                  # max(seq_lens), as a Python int
    q_index: torch.Tensor | None = None   # [B, Qmax] int64 (prefill only)
    q_valid: torch.Tensor | None = None   # [B, Qmax] bool (prefill only)
    live: torch.Tensor | None = None      # [B] bool: the rows that are requests (a compiled decode step's)


def build_batch(token_ids: list[list[int]], start_positions: list[int], page_tables: list[list[int]],
                page_size: int, device: torch.device | str, pad_page: int = 0, min_pages: int = 1,
                logits_counts: list[int] | None = None) -> ForwardBatch:
    """Build the tensors for requests that each add `token_ids[b]` at `start_positions[b]`.
    The page table is padded with `pad_page` to the longest request's pages, at least `min_pages`.
    `logits_counts[b]` (default 1): how many of request b's last tokens get their hidden states
    back (the ragged-step seam: prompt logprobs want every position of a chunk)."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    q_rows: list[list[int]] = []
    for toks, start, table in zip(token_ids, start_positions, page_tables):
        first = len(ids)
        for i, tok in enumerate(toks):
            p = start + i
            ids.append(tok)
            pos.append(p)
            slots.append(table[p // page_size] * page_size + p % page_size)
        q_rows.append(list(range(first, len(ids))))
    max_pages = max(min_pages, max(len(t) for t in page_tables))
    tables = [t + [pad_page] * (max_pages - len(t)) for t in page_tables]
    seq_lens = [s + len(t) for s, t in zip(start_positions, token_ids)]
    is_decode = all(len(t) == 1 for t in token_ids)
    counts = logits_counts or [1] * len(q_rows)
    wanted = [i for r, n in zip(q_rows, counts) for i in r[len(r) - n:]]
    # one host-to-device transfer for all three
    flat = torch.tensor([ids, pos, slots], dtype=torch.int64, device=device)
    batch = ForwardBatch(
        input_ids=flat[0], positions=flat[1], slot_mapping=flat[2],
        page_table=torch.tensor(tables, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        logits_indices=torch.tensor(wanted, dtype=torch.int64, device=device),
        is_decode=is_decode, max_seq_len=max(seq_lens))
    if not is_decode:
        qmax = max(len(r) for r in q_rows)
        batch.q_index = torch.tensor([r + [0] * (qmax - len(r)) for r in q_rows],
                                     dtype=torch.int64, device=device)
        batch.q_valid = torch.tensor([[True] * len(r) + [False] * (qmax - len(r)) for r in q_rows],
                                     dtype=torch.bool, device=device)
    return batch
