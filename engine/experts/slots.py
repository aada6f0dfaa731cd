"""One MoE layer's resident experts: K device slots in front of a host store of all E.

`ExpertSlots` is the only code that changes which expert a slot holds.  Everyone else
reads `slot_of` (expert -> slot, -1 when not resident).  Which slot to give up is the
eviction policy's choice (LRU by default).

    store.w13: [E, 2I, H]  store.w2: [E, H, I]   (host; pinned on CUDA)
    w13:       [K, 2I, H]  w2:       [K, H, I]   (device slots)
    b13:       [K, 2I]     b2:       [K, H]      (only when the store has biases: gpt-oss)

w13 and w2 are plain tensors or quantized weights in their published parts (packed values,
scales, zero points, group index: engine/quant/stack.py), in the slots as in the store.
One expert is all its tensors, whatever the format: a page-in, a verify and a fingerprint
cover every part of it and its biases, taken from the layer's own tensors, never a list of
names.

The slot state (which expert each slot holds, the LRU order, the counters) has a host copy, which
the host plan reads and changes, and a device copy (`engine/experts/device_plan.py`), which a
compiled single-wave step decides over without reading anything back.  `ExpertSlots` owns both:
after host changes `prepare_device` pushes them before a device step; after device steps
(`device_stepped`) the host copy is pulled before anything on the host reads it (one
synchronisation on CUDA), including the counters.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Protocol

import torch

from engine.experts.copy import Copy, CopyEngine, CudaStreamCopy, DirectCopy
from engine.experts.device_plan import HITS, MISSES, STEPS, WAVES, DevicePlan
from engine.experts.store import ExpertCounters, ExpertStore
from engine.quant.stack import empty_like, tensors_of

DEVICE_COPIERS = (DirectCopy, CudaStreamCopy)   # copy engines a device step may stand in for


class EvictionPolicy(Protocol):
    def touch(self, slot: int) -> None: ...
    def victims(self, count: int, exclude: set[int]) -> list[int]: ...


class LRUPolicy:
    """Least recently used first; slots start in index order (slot 0 oldest)."""

    def __init__(self, num_slots: int) -> None:
        self._order: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))

    def touch(self, slot: int) -> None:
        self._order.move_to_end(slot)

    def victims(self, count: int, exclude: set[int]) -> list[int]:
        """The `count` least recently used slots outside `exclude`.  Raises RuntimeError
        when fewer are available (a caller bug: waves never ask for more)."""
        if count == 0:
            return []
        out = [s for s in self._order if s not in exclude][:count]
        if len(out) < count:
            raise RuntimeError(f"need {count} slots to evict, only {len(out)} are not protected")
        return out

    def order(self) -> list[int]:
        return list(self._order)

    def reorder(self, order: list[int]) -> None:
        """Take `order` (every slot once, least recently used first) as the LRU order."""
        if sorted(order) != sorted(self._order):
            raise ValueError(f"an LRU order names every slot once, got {order}")
        self._order = OrderedDict((s, None) for s in order)


class ExpertSlots:
    def __init__(self, store: ExpertStore, num_slots: int, device: torch.device | str,
                 copier: CopyEngine | None = None, policy: EvictionPolicy | None = None) -> None:
        e = store.num_experts
        if not 0 < num_slots <= e:
            raise ValueError(f"num_slots={num_slots} must be in 1..{e}")
        self.store = store
        self.num_slots = num_slots
        self.w13 = empty_like(store.w13, num_slots, device)
        self.w2 = empty_like(store.w2, num_slots, device)
        self.b13: torch.Tensor | None = None
        self.b2: torch.Tensor | None = None
        if store.b13 is not None and store.b2 is not None:
            self.b13 = torch.empty((num_slots, *store.b13.shape[1:]), dtype=store.b13.dtype, device=device)
            self.b2 = torch.empty((num_slots, *store.b2.shape[1:]), dtype=store.b2.dtype, device=device)
        self.copier: CopyEngine = copier or DirectCopy()
        self._policy: EvictionPolicy = policy or LRUPolicy(num_slots)
        self._slot_of = [-1] * e                 # expert -> slot
        self._expert_in = [-1] * num_slots       # slot -> expert
        self.device_plan = DevicePlan(e, num_slots, device)
        # slot_of as a device tensor, kept in step with the list (-1: not resident)
        self.slot_table = self.device_plan.slot_table
        self._dirty = True    # the host copy changed since the device copy was pushed
        self._stale = False   # device steps ran since the host copy was pulled
        self._pending: dict[int, list[Copy]] = {}
        self._last_use: torch.cuda.Event | None = None  # CUDA: an event after the last compute that read the slots
        self._counters = ExpertCounters()
        self.verify_on_use = False   # compare slots with the host store after each use and before eviction
        self.load([(s, s) for s in range(num_slots)])  # warm start: experts 0..K-1, not counted
        self.wait(range(num_slots))
        self._counters.bytes_paged = 0

    # ---- the host copy of the state (pulled from the device copy when device steps ran) --------

    @property
    def slot_of(self) -> list[int]:
        self._adopt()
        return self._slot_of

    @property
    def expert_in(self) -> list[int]:
        self._adopt()
        return self._expert_in

    @property
    def policy(self) -> EvictionPolicy:
        self._adopt()
        return self._policy

    @property
    def counters(self) -> ExpertCounters:
        self._adopt()
        return self._counters

    def device_capable(self) -> bool:
        """Whether a device step could ever decide for these slots: LRU eviction (the device
        plan's), a copy engine whose copies the device's page-in op stands for (a plain copy,
        the CUDA copy streams: not an emulated link, whose timing only the host plan keeps)."""
        return isinstance(self._policy, LRUPolicy) and type(self.copier) in DEVICE_COPIERS

    def device_ready(self) -> bool:
        """Whether a device step may decide for these slots now: capable, every slot holding an
        expert, no verify mode (both can change while serving)."""
        # (device steps never empty a slot: while the host copy is out of date, all are full)
        return (self.device_capable() and not self.verify_on_use
                and (self._stale or min(self._expert_in) >= 0))

    def prepare_device(self) -> None:
        """Before a device step: push the host's changes to the device copy (none while the
        device copy is the current one: a host change pulls it first)."""
        if self._dirty and not self._stale:
            assert isinstance(self._policy, LRUPolicy), "the device plan evicts least recently used"
            self.wait(range(self.num_slots))   # host copies land before the device reads the slots
            self.device_plan.push(self._slot_of, self._expert_in, self._policy.order())
            self._dirty = False

    def device_step(self, ids: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """The single-wave decision and page-ins on the device (traced into a compiled step):
        the slot ids [T, k] of `ids`; padding rows (`live` False) on slot 0."""
        return self.device_plan.step(ids, live, self.tensors(), self.store.tensors())

    def device_stepped(self) -> None:
        """After device steps were queued: the host copy is out of date until pulled."""
        self._stale = True

    def _adopt(self) -> None:
        if not self._stale:
            return
        self._stale = False
        slot_of, expert_in, order, tallies = self.device_plan.pull()
        self._slot_of, self._expert_in = slot_of, expert_in
        assert isinstance(self._policy, LRUPolicy)
        self._policy.reorder(order)
        c = self._counters
        c.hits += tallies[HITS]
        c.misses += tallies[MISSES]
        c.steps += tallies[STEPS]
        c.waves += tallies[WAVES]
        c.bytes_paged += tallies[MISSES] * self.store.bytes_per_expert

    def load(self, moves: list[tuple[int, int]], prefetch: bool = False) -> None:
        """Page each (expert, slot) in, evicting whoever holds the slot, as one batch of
        copies that may be in flight until `wait` is called for the slots."""
        if not moves:
            return
        pairs, evicted = [], []
        self._adopt()
        self._dirty = True
        if self.verify_on_use:      # a corrupted slot about to be overwritten is still counted
            self.verify([slot for _, slot in moves])
        for expert, slot in moves:
            assert self.slot_of[expert] < 0, f"expert {expert} is already in slot {self.slot_of[expert]}"
            old = self.expert_in[slot]
            evicted.append(old)
            if old >= 0:
                self.slot_of[old] = -1
            self.expert_in[slot] = expert
            self.slot_of[expert] = slot
            pairs += list(zip(self.slot(slot), self.store.expert(expert)))
        self._sync_table([old for old in evicted if old >= 0] + [e for e, _ in moves])
        done = self.copier.copy(pairs, self._last_use, prefetch)
        for _, slot in moves:
            self._pending.setdefault(slot, []).append(done)
        self._counters.bytes_paged += len(moves) * self.store.bytes_per_expert

    def _sync_table(self, experts: list[int]) -> None:
        pairs = torch.tensor([experts, [self.slot_of[e] for e in experts]], dtype=torch.int64)
        if self.slot_table.is_cuda:
            # from pinned memory without waiting (a pageable copy would synchronise the host;
            # torch's pinned allocator keeps the buffer until the copy is done)
            pairs = pairs.pin_memory().to(self.slot_table.device, non_blocking=True)
        self.slot_table[pairs[0]] = pairs[1]

    def tensors(self) -> list[torch.Tensor]:
        """The slot tensors, [K, ...] each, in the order of `ExpertStore.tensors`."""
        out = tensors_of(self.w13) + tensors_of(self.w2)
        return out + ([self.b13, self.b2] if self.b13 is not None and self.b2 is not None else [])

    def slot(self, s: int) -> list[torch.Tensor]:
        """Every tensor of slot `s`, in the order of `ExpertStore.expert`."""
        return [t[s] for t in self.tensors()]

    def forget_all(self) -> None:
        """Mark every slot empty (no copy): the next step pages in everything it needs."""
        self._adopt()
        self._dirty = True
        self._slot_of = [-1] * len(self._slot_of)
        self._expert_in = [-1] * self.num_slots
        self.slot_table.fill_(-1)

    def mark_used(self) -> None:
        """Called after a step's compute was queued: later copies into these slots must wait
        for it (CUDA), but need not wait for anything queued after it."""
        if self.slot_table.is_cuda:
            self._last_use = torch.cuda.Event()
            self._last_use.record()

    def wait(self, slots: Iterable[int]) -> None:
        """Block until the copies into `slots` have landed (on CUDA: order the compute stream)."""
        if not self._pending:
            return
        for s in slots:
            for c in self._pending.pop(s, ()):
                c.wait()

    def verify(self, slots: Iterable[int]) -> list[int]:
        """Compare each occupied slot with the host copy of the expert it holds and copy the
        host bytes back over any that differ (a slot corrupted after start-up).  Returns the
        repaired slots; each is counted in `counters.corrupt_slots`."""
        bad = []
        for s in slots:
            e = self.expert_in[s]
            if e < 0:
                continue
            self.wait([s])
            pairs = list(zip(self.slot(s), self.store.expert(e)))
            if not all(torch.equal(dst, src.to(dst.device)) for dst, src in pairs):
                for dst, src in pairs:
                    dst.copy_(src)
                bad.append(s)
        self.counters.corrupt_slots += len(bad)
        return bad

    def touch(self, slots: Iterable[int]) -> None:
        policy = self.policy
        self._dirty = True
        for s in slots:
            policy.touch(s)

    def slot_lookup(self, experts: list[int]) -> torch.Tensor:
        """[E] tensor: the slot of each expert in `experts`, -1 for every other expert."""
        lut = torch.full_like(self.slot_table, -1)
        idx = torch.tensor(experts, dtype=torch.int64).to(lut.device)
        lut[idx] = self.slot_table[idx]
        return lut
