"""The paging decision made on the device (engine/experts/device_plan.py) against the host plan:
over random routing sequences the same slots, page-ins, LRU order, counters and expert outputs,
with host steps between device steps (the state pushed and pulled across); and
`tandem::page_in_experts` copies only the first `count` entries."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.compiled.step import GATHERED
from engine.experts import ExpertSlots, ExpertStore, PagedExperts
from engine.experts.check import fingerprint
from engine.kernels.expert_copy import page_in_experts

H, INNER = 4, 3


def layer(e: int, k: int, seed: int) -> PagedExperts:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * INNER, H, generator=g)
    w2 = torch.randn(e, H, INNER, generator=g)
    store = ExpertStore(w13, w2, [fingerprint(w13[i], w2[i]) for i in range(e)])
    return PagedExperts(ExpertSlots(store, k, "cpu"))


def state(p: PagedExperts) -> tuple:
    s = p.slots
    c = s.counters
    return (list(s.slot_of), list(s.expert_in), s.policy.order(),   # type: ignore[attr-defined]
            (c.hits, c.misses, c.steps, c.waves, c.bytes_paged))


def host_step(p: PagedExperts, x: torch.Tensor, ids: torch.Tensor, rows: int) -> torch.Tensor:
    """A step as a compiled step's host plan runs it: rows past `rows` are padding."""
    p.rows, p.plan = rows, GATHERED
    try:
        return p(x, ids)
    finally:
        p.rows, p.plan = None, None


def device_step(p: PagedExperts, x: torch.Tensor, ids: torch.Tensor, rows: int) -> torch.Tensor:
    p.slots.prepare_device()
    p.on_device = True
    try:
        return p(x, ids, torch.arange(ids.shape[0]) < rows)
    finally:
        p.on_device = False
        p.slots.device_stepped()


@st.composite
def runs(draw: st.DrawFn) -> tuple[int, int, int, list[tuple[list[list[int]], int, bool]]]:
    """(E, K, top_k, steps); each step: its routing [T, top_k] with T * top_k <= K (a single
    wave), how many rows are requests, and whether the device-plan layer runs it on the host."""
    e = draw(st.integers(4, 24))
    top_k = draw(st.integers(1, min(4, e)))
    k = draw(st.integers(top_k, e))
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        t = draw(st.integers(1, max(1, k // top_k)))
        ids = [draw(st.lists(st.integers(0, e - 1), min_size=top_k, max_size=top_k, unique=True)) for _ in range(t)]
        steps.append((ids, draw(st.integers(0, t)), draw(st.booleans())))
    return e, k, top_k, steps


@settings(max_examples=60, deadline=None)
@given(runs(), st.integers(0, 2**16))
def test_device_decision_equals_the_host_plan(run: tuple, seed: int) -> None:
    e, k, _, steps = run
    host, dev = layer(e, k, seed), layer(e, k, seed)
    for i, (routing, rows, on_host) in enumerate(steps):
        ids = torch.tensor(routing)
        x = torch.randn(ids.shape[0], H, generator=torch.Generator().manual_seed(seed + i))
        want = host_step(host, x, ids, rows)
        got = (host_step if on_host else device_step)(dev, x, ids, rows)
        assert torch.equal(got[:rows], want[:rows]), f"step {i}: expert outputs differ"
        assert torch.isfinite(got).all(), f"step {i}: a padding row's output is not finite"
        assert state(dev) == state(host), f"step {i} ({'host' if on_host else 'device'})"
        for slot, expert in enumerate(dev.slots.expert_in):
            assert all(torch.equal(a, b) for a, b in zip(dev.slots.slot(slot), dev.slots.store.expert(expert))), \
                f"step {i}: slot {slot} does not hold expert {expert}"


def test_a_step_of_padding_rows_only_changes_nothing() -> None:
    p = layer(8, 4, 0)
    before = state(p)
    device_step(p, torch.randn(2, H), torch.tensor([[5, 6], [7, 1]]), rows=0)
    assert state(p) == before


def test_page_in_copies_only_the_first_count_entries() -> None:
    store = [torch.arange(6 * 5, dtype=torch.float32).view(6, 5), torch.arange(6, dtype=torch.int64) * 10]
    slots = [torch.full((3, 5), -1.0), torch.full((3,), -1, dtype=torch.int64)]
    page_in_experts(slots, store, torch.tensor([2, 0, 1]), torch.tensor([4, 1, 5]), torch.tensor([2]))
    assert torch.equal(slots[0][2], store[0][4]) and torch.equal(slots[0][0], store[0][1])
    assert (slots[0][1] == -1).all() and slots[1].tolist() == [10, -1, 40]
