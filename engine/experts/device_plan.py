"""The paging decision of a single-wave step made on the device, as tensor ops: no routing read
back to the host, so a compiled step keeps its paged MoE layers inside one graph (a CPU: no
graph break; CUDA: one captured graph per bucket, zero host synchronisations).

It is the host plan (`PagedExperts.plan_waves` / `_page_in` with `LRUPolicy`) for a step whose
experts fit the slots, decided over the same state kept as device tensors:

    slot_table [E]   expert -> slot, -1 when not resident    (each of the three followed by a
    expert_in  [K]   slot -> expert, -1 when empty             dummy entry that masked writes go
    stamps     [K]   when each slot was last used              to, so every write has a fixed size)
    tick       [1]   the stamp the next step starts from
    tallies    [4]   hits, misses, steps, waves since the host last read them
all views of one int64 tensor `state`.

A step: the needed experts (a mask over E from the live rows' routing); the missing ones in
ascending id order (the host's `sorted(set(...))`) take the least recently used slots that hold
no needed expert, in LRU order (the host's `victims`); every needed expert e's slot is then
stamped tick + e (the host touches them in ascending order) and tick moves on by E.  So
the slots, the page-ins and the LRU order equal the host plan's (tests/test_device_plan.py
checks it over random routing).  The copies are
`tandem::page_in_experts` over fixed-size [K] lists of which only the first `count` are real.

The host and the device each hold a copy of the state; `ExpertSlots` owns both and says which
is current (`push` before a device step after host changes, `pull` before the host reads after
device steps).
"""

from __future__ import annotations

import torch

import engine.kernels.expert_copy  # noqa: F401  (registers tandem::page_in_experts)

HITS, MISSES, STEPS, WAVES = range(4)


class DevicePlan:
    """The device copy of one layer's slot state and the single-wave decision over it."""

    def __init__(self, num_experts: int, num_slots: int, device: torch.device | str) -> None:
        e, k = num_experts, num_slots
        self.num_experts, self.num_slots = e, k
        # one tensor, so a compiled step has one input (and guard) per layer for all of it
        self.state = torch.zeros(e + 1 + 2 * (k + 1) + 1 + 4, dtype=torch.int64, device=device)
        # slot_table starts the allocation, so it is kept; the other views are made when needed
        # (the model holds no tensor that starts mid-allocation)
        self.slot_table, expert_in, _, _, _ = self._views(self.state)
        self.slot_table.fill_(-1)
        expert_in.fill_(-1)

    def _views(self, state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """slot_table [E], expert_in [K], stamps [K], tick [1], tallies [4] of `state` (each of
        the first three followed in `state` by its dummy entry)."""
        e, k = self.num_experts, self.num_slots
        return (state[:e], state[e + 1:e + 1 + k], state[e + 2 + k:e + 2 + 2 * k],
                state[e + 3 + 2 * k:e + 4 + 2 * k], state[e + 4 + 2 * k:])

    # ---- the decision (traced into a compiled step) ---------------------------------------------

    def step(self, ids: torch.Tensor, live: torch.Tensor, slots: list[torch.Tensor],
             store: list[torch.Tensor]) -> torch.Tensor:
        """Page in the experts the live rows of `ids` [T, k] need (`live` [T] bool; at most K
        experts: the caller's bucket guarantees it) and return every row's slot ids [T, k]
        (padding rows: slot 0, whose output is dropped)."""
        e, k = self.num_experts, self.num_slots
        # only `state` is named here (never the views kept on self as well): a graph that mutates
        # two aliases of one tensor pays for rebuilding their base on every call
        state = self.state
        slot_ext, expert_ext, stamps_ext = state[:e + 1], state[e + 1:e + 2 + k], state[e + 2 + k:e + 3 + 2 * k]
        _, _, _, tick, tallies = self._views(state)
        dev = ids.device
        needed_ext = torch.zeros(e + 1, dtype=torch.bool, device=dev)
        needed_ext[torch.where(live[:, None], ids, e).reshape(-1)] = True
        needed = needed_ext[:e]
        table = slot_ext[:e]
        resident = needed & (table >= 0)
        missing = needed & (table < 0)
        # Ranks by counting rather than sorting (a sort is a library call of its own per layer in
        # the step's graph; this is a fused loop).  The victims: the slots no needed expert holds,
        # least recently used first (stamps are distinct); victims[j] for j < count.
        protected = torch.zeros(k + 1, dtype=torch.bool, device=dev)
        protected[torch.where(resident, table, k)] = True
        free = ~protected[:k]
        stamps = stamps_ext[:k]
        older = ((stamps[None, :] < stamps[:, None]) & free[None, :]).sum(1)        # [K]
        victims_ext = torch.zeros(k + 1, dtype=torch.int64, device=dev)
        slots_k = torch.arange(k, dtype=torch.int64, device=dev)
        victims_ext[torch.where(free, older, k)] = slots_k
        victims = victims_ext[:k]
        # the missing experts in ascending order: incoming[j] for j < count
        experts = torch.arange(e, dtype=torch.int64, device=dev)
        before = torch.cumsum(missing.to(torch.int64), 0) - 1                       # [E]
        incoming_ext = torch.zeros(k + 1, dtype=torch.int64, device=dev)
        incoming_ext[torch.where(missing, before, k)] = experts
        incoming = incoming_ext[:k]
        count = missing.sum().reshape(1)
        real = slots_k < count
        evicted = expert_ext[victims]
        slot_ext[torch.where(real & (evicted >= 0), evicted, e)] = -1
        slot_ext[torch.where(real, incoming, e)] = victims
        expert_ext[torch.where(real, victims, k)] = torch.where(real, incoming, -1)
        torch.ops.tandem.page_in_experts(slots, store, victims, incoming, count)
        # every needed expert's slot becomes the most recently used, in ascending expert order
        # (the order the host touches them in)
        stamps_ext[torch.where(needed, slot_ext[:e], k)] = tick + experts
        tick.add_(e)
        n = needed.sum()
        ran = (n > 0).to(torch.int64)
        tallies.add_(torch.stack([n - count[0], count[0], ran, ran]))
        return torch.where(live[:, None], slot_ext[:e][ids], 0)

    # ---- the host's copy ------------------------------------------------------------------------

    def push(self, slot_of: list[int], expert_in: list[int], lru_order: list[int]) -> None:
        """Make the device state the host's (slot_of [E], expert_in [K], slots oldest first)."""
        stamps = [0] * self.num_slots
        for age, slot in enumerate(lru_order):
            stamps[slot] = age
        state = torch.tensor(slot_of + expert_in + stamps + [self.num_slots], dtype=torch.int64)
        if self.state.is_cuda:  # from pinned memory, without waiting
            state = state.pin_memory().to(self.state.device, non_blocking=True)
        e, k = self.num_experts, self.num_slots
        table, expert, stamp, tick, _ = self._views(self.state)
        table.copy_(state[:e])
        expert.copy_(state[e:e + k])
        stamp.copy_(state[e + k:e + 2 * k])
        tick.copy_(state[e + 2 * k:])

    def pull(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """The device state for the host: (slot_of, expert_in, slots oldest first, tallies), and
        the tallies start again from zero.  On CUDA one synchronisation."""
        e, k = self.num_experts, self.num_slots
        table, expert, stamp, _, tallies = self._views(self.state)
        state = torch.cat([table, expert, torch.sort(stamp, stable=True).indices, tallies]).tolist()
        tallies.zero_()
        return state[:e], state[e:e + k], state[e + k:e + 2 * k], state[e + 2 * k:]
