"""PagePool: exact page ids and order, ownership, generations, integrity."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv_pool import PagePool, PoolExhausted


def make_pool(pages: int = 8) -> PagePool:
    return PagePool(pages, page_size=4, num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32)


def test_allocation_order_and_reuse_is_fifo():
    pool = make_pool()
    assert pool.allocate("a", 3) == [0, 1, 2]
    assert pool.allocate("b", 2) == [3, 4]
    assert pool.allocate("a", 1) == [5]
    assert pool.page_table("a") == [0, 1, 2, 5]
    assert pool.free("a") == 4
    assert pool.allocate("c", 4) == [6, 7, 0, 1]
    assert pool.num_free == 2 and pool.num_used == 6
    pool.check_integrity()


def test_generation_bumps_on_every_allocation_and_written_resets():
    pool = make_pool(2)
    pool.allocate("a", 2)
    pool.mark_written("a", [0])
    assert [pool.generation(p) for p in (0, 1)] == [1, 1]
    assert pool.is_written(0) and not pool.is_written(1)
    pool.free("a")
    pool.allocate("b", 2)
    assert [pool.generation(p) for p in (0, 1)] == [2, 2]
    assert not pool.is_written(0)
    assert [(r.page, r.generation) for r in pool.refs("b")] == [(0, 2), (1, 2)]


def test_exhausted_pool_changes_nothing():
    pool = make_pool(4)
    pool.allocate("a", 3)
    with pytest.raises(PoolExhausted, match="needs 2 KV pages, 1 of 4 are free"):
        pool.allocate("b", 2)
    assert not pool.has("b") and pool.num_free == 1
    pool.check_integrity()


def test_mark_written_refuses_a_page_of_another_owner():
    pool = make_pool(4)
    pool.allocate("a", 1)
    pool.allocate("b", 1)
    with pytest.raises(AssertionError, match="not owned by a"):
        pool.mark_written("a", [1])


def test_check_integrity_catches_a_page_owned_twice():
    pool = make_pool(4)
    pool.allocate("a", 2)
    pool._tables.setdefault("b", []).append(0)  # simulate a bug outside the owner
    with pytest.raises(AssertionError, match="page 0"):
        pool.check_integrity()


def test_check_integrity_catches_a_leaked_page():
    pool = make_pool(4)
    pool.allocate("a", 2)
    pool._tables.pop("a")  # pages vanish from every table but are not free
    with pytest.raises(AssertionError, match="free 2 \\+ used 0 \\+ cached 0 != capacity 4"):
        pool.check_integrity()


class PoolMachine(RuleBasedStateMachine):
    """Any interleaving of allocate/write/free keeps the accounting exact."""

    def __init__(self):
        super().__init__()
        self.pool = make_pool(16)
        self.model: dict[str, int] = {}

    @rule(rid=st.sampled_from("abcde"), n=st.integers(0, 6))
    def allocate(self, rid, n):
        free_before = self.pool.num_free
        if n > free_before:
            with pytest.raises(PoolExhausted):
                self.pool.allocate(rid, n)
            assert self.pool.num_free == free_before
        else:
            pages = self.pool.allocate(rid, n)
            assert len(pages) == n
            self.model[rid] = self.model.get(rid, 0) + n

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def write(self, data):
        rid = data.draw(st.sampled_from(sorted(self.model)))
        table = self.pool.page_table(rid)
        if table:
            self.pool.mark_written(rid, table[:1])

    @rule(rid=st.sampled_from("abcde"))
    def free(self, rid):
        assert self.pool.free(rid) == self.model.pop(rid, 0)

    @invariant()
    def accounting(self):
        self.pool.check_integrity()
        assert self.pool.num_used == sum(self.model.values())


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
