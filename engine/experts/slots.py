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
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch

from engine.experts.copy import Copy, CopyEngine, DirectCopy
from engine.kernels.fused_moe import ClampedSwiGLU
from engine.quant.stack import ExpertWeight, empty_like, num_rows, tensors_of, weight_format


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


@dataclass
class ExpertCounters:
    hits: int = 0            # needed experts already resident when the step began
    misses: int = 0          # needed experts paged in by the step
    bytes_paged: int = 0     # page-ins and prefetches together
    waves: int = 0
    steps: int = 0
    prefetched: int = 0      # experts copied ahead of their step by the prefetcher
    prefetch_hits: int = 0   # ... that their step did need
    prefetch_wasted_bytes: int = 0
    corrupt_slots: int = 0   # verify mode: slots found not holding their expert's bytes (re-paged)

    def as_dict(self) -> dict[str, int | float]:
        d = dict(self.__dict__)
        looked = self.hits + self.misses
        d["hit_rate"] = self.hits / looked if looked else 0.0
        return d


@dataclass
class ExpertStore:
    """All E experts of one layer in host memory."""
    w13: ExpertWeight   # [E, 2I, H]
    w2: ExpertWeight    # [E, H, I]
    fingerprints: list[int] = field(default_factory=list)  # per expert, from the checkpoint
    b13: torch.Tensor | None = None     # [E, 2I] gate then up biases (gpt-oss), or None
    b2: torch.Tensor | None = None      # [E, H] down bias, or None
    act: ClampedSwiGLU | None = None    # the experts' gated activation (None: silu)

    @property
    def num_experts(self) -> int:
        return num_rows(self.w13)

    @property
    def format(self) -> str:
        """How the experts are stored: a dtype ("bfloat16") or a quantized format ("gptq int4 g128")."""
        return weight_format(self.w13)

    def __post_init__(self) -> None:
        if (self.b13 is None) != (self.b2 is None):
            raise ValueError("expert biases come in pairs: b13 and b2, or neither")
        if self.b13 is not None and self.b2 is not None:
            e, i2, h = self.w13.shape
            if self.b13.shape != (e, i2) or self.b2.shape != (e, h):
                raise ValueError(f"expert biases {tuple(self.b13.shape)}, {tuple(self.b2.shape)} do not fit "
                                 f"w13 {tuple(self.w13.shape)}: expected {(e, i2)}, {(e, h)}")
        self.bytes_per_expert = sum(t.numel() * t.element_size() for t in self.expert(0))

    def expert(self, e: int) -> list[torch.Tensor]:
        """Every tensor of expert `e`, in fingerprint order: w13's, w2's[, b13, b2]."""
        return [t[e] for t in self.tensors()]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the store, [E, ...] each, in fingerprint order."""
        out = tensors_of(self.w13) + tensors_of(self.w2)
        if self.b13 is not None and self.b2 is not None:
            out += [self.b13, self.b2]
        return out


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
        self.policy: EvictionPolicy = policy or LRUPolicy(num_slots)
        self.slot_of = [-1] * e                 # expert -> slot
        self.expert_in = [-1] * num_slots       # slot -> expert
        # slot_of as a device tensor, kept in step with the list (-1: not resident)
        self.slot_table = torch.full((e,), -1, dtype=torch.int64, device=device)
        self._pending: dict[int, list[Copy]] = {}
        self._last_use: torch.cuda.Event | None = None  # CUDA: an event after the last compute that read the slots
        self.counters = ExpertCounters()
        self.verify_on_use = False   # compare slots with the host store after each use and before eviction
        self.load([(s, s) for s in range(num_slots)])  # warm start: experts 0..K-1, not counted
        self.wait(range(num_slots))
        self.counters.bytes_paged = 0

    def load(self, moves: list[tuple[int, int]], prefetch: bool = False) -> None:
        """Page each (expert, slot) in, evicting whoever holds the slot, as one batch of
        copies that may be in flight until `wait` is called for the slots."""
        pairs, evicted = [], []
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
        if not moves:
            return
        self._sync_table([old for old in evicted if old >= 0] + [e for e, _ in moves])
        done = self.copier.copy(pairs, self._last_use, prefetch)
        for _, slot in moves:
            self._pending.setdefault(slot, []).append(done)
        self.counters.bytes_paged += len(moves) * self.store.bytes_per_expert

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
        self.slot_of = [-1] * len(self.slot_of)
        self.expert_in = [-1] * self.num_slots
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
        for s in slots:
            self.policy.touch(s)

    def slot_lookup(self, experts: list[int]) -> torch.Tensor:
        """[E] tensor: the slot of each expert in `experts`, -1 for every other expert."""
        lut = torch.full_like(self.slot_table, -1)
        idx = torch.tensor(experts, dtype=torch.int64).to(lut.device)
        lut[idx] = self.slot_table[idx]
        return lut
