"""Paged experts: a MoE layer's experts computed over K resident slots.

Each step: route every token; take the set of experts the step needs; keep the resident
ones; page the missing ones into slots the step does not need, least recently used
first; compute over slots.  When the step needs more than K experts it runs in waves:

    wave 1:  every needed expert already resident + as many missing ones as the slots
             holding unneeded experts can take
    wave n:  the next K missing experts, into slots whose experts earlier waves used

so every needed expert is paged at most once per step and none is evicted before its
wave has run.  Every pair is computed exactly once into one [T*k, H] buffer with a step
plan fixed for the whole step, so the result is bit-identical for any K.  (The gathered plan
runs every wave over all T*k pairs, as all-resident experts do: see `moe_gathered`.)

A compiled step whose batch cannot need more than K experts (bucket * top_k <= K) sets
`on_device`: the decision above, for its single wave, is then made by tensor ops on the device
(`ExpertSlots.device_step`, engine/experts/device_plan.py) inside the step's graph, with the same
slots, page-ins, LRU order and counters as the host's.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from engine.experts.check import ExpertCheckError
from engine.experts.slots import ExpertSlots
from engine.experts.store import ExpertCounters
from engine.kernels.fused_moe import gathered_all, moe_gathered
from engine.moe import StepPlan, expert_outputs


class PagedExperts:
    def __init__(self, slots: ExpertSlots, cache: bool = True, triton: bool = False) -> None:
        """`cache=False` forgets every resident expert before each step (plain weight
        offload: every routed expert is copied at every step), for comparison."""
        self.slots = slots
        self.cache = cache
        self.triton = triton
        self.prefetch_limit: int | None = None  # most experts one prefetch may copy
        self._prefetched: set[int] = set()
        # Set by a compiled decode step (engine/compiled) for its call: the rows that are real
        # requests (the rest are padding: they route nowhere and count nowhere), the plan of
        # every step (gathered), and the gathered compute compiled for the bucket's shape.
        self.rows: int | None = None
        self.plan: StepPlan | None = None
        self.kernel: Callable[..., torch.Tensor] | None = None   # None: gathered_all
        self.on_device = False   # set by a compiled step: decide on the device (single wave)

    @property
    def counters(self) -> ExpertCounters:
        return self.slots.counters

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, H]; ids: [T, k] expert ids; `live` [T] bool: the rows that are requests (a
        compiled step deciding on the device passes it).  Returns y: [T, k, H] (unweighted)."""
        if self.on_device:
            assert live is not None, "a step deciding on the device says which rows are requests"
            slots = self.slots
            slot_ids = slots.device_step(ids, live)
            y = gathered_all(x, slots.w13, slots.w2, slot_ids, b13=slots.b13, b2=slots.b2, act=slots.store.act)
            return y.view(*ids.shape, -1)
        return self._on_host(x, ids)

    # A compiled step runs this between its compiled segments: the paging decision needs the
    # routing on the host (one synchronisation per MoE layer), never inside a graph.
    @torch.compiler.disable
    def _on_host(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        t, k = ids.shape
        if self.rows == 0:
            # a compiled step's warm-up, padding rows only: the kernel runs (and compiles) over a
            # resident slot; nothing is paged, touched or counted
            y = (self.kernel or gathered_all)(x, self.slots.w13, self.slots.w2, torch.zeros_like(ids),
                                              b13=self.slots.b13, b2=self.slots.b2, act=self.slots.store.act)
            return y.view(t, k, -1)
        live = ids if self.rows is None else ids[:self.rows]  # padding rows route nowhere
        plan = self.plan or StepPlan.for_step(live, self.slots.store.num_experts, self.triton)
        if not self.cache:
            self.slots.forget_all()
        needed = sorted(set(live.reshape(-1).tolist()))
        waves = self.plan_waves(needed)
        if len(waves) == 1 and plan.strategy == "gathered":  # the decode fast path
            used = self._page_in(waves[0])
            slot_ids = self._padded(self.slots.slot_table[ids], 0)  # padding rows: any slot, dropped
            kernel = self.kernel or gathered_all
            for _ in self._guarded(used):
                y = kernel(x, self.slots.w13, self.slots.w2, slot_ids,
                           b13=self.slots.b13, b2=self.slots.b2, act=self.slots.store.act)
            self.slots.mark_used()
            return y.view(t, k, -1)
        out = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
        if self.rows is not None and self.rows < t:
            # padding rows route nowhere, so no wave writes their rows: zero them (uninitialised
            # memory could be non-finite, and their K/V lands in the scratch page, which every
            # real row's padded page table masks: 0 * NaN would still poison the real rows)
            out[self.rows * k:] = 0
        for wave in waves:
            used = self._page_in(wave)
            slot_ids = self._padded(self.slots.slot_lookup(wave)[ids], -1)  # [T, k], -1 outside the wave
            for _ in self._guarded(used):
                if plan.strategy == "gathered":
                    moe_gathered(x, self.slots.w13, self.slots.w2, slot_ids, out, b13=self.slots.b13,
                                 b2=self.slots.b2, act=self.slots.store.act, kernel=self.kernel)
                else:
                    expert_outputs(x, self.slots.w13, self.slots.w2, slot_ids, out, plan,
                                   b13=self.slots.b13, b2=self.slots.b2, act=self.slots.store.act)
            self.slots.mark_used()  # the next wave's page-ins must not overtake this compute
        return out.view(t, k, -1)

    def _padded(self, slot_ids: torch.Tensor, fill: int) -> torch.Tensor:
        """`slot_ids` [T, k] with the padding rows' entries set to `fill`."""
        if self.rows is not None and self.rows < slot_ids.shape[0]:
            slot_ids[self.rows:] = fill
        return slot_ids

    def _guarded(self, used: list[int], tries: int = 3) -> Iterator[None]:
        """Run the body once; in verify mode check the slots it read afterwards (a flip before
        or during the compute) and run it again over repaired slots.  Raises ExpertCheckError
        when the slots keep changing (failing memory)."""
        for _ in range(tries):
            yield
            if not (self.slots.verify_on_use and self.slots.verify(used)):
                return
        raise ExpertCheckError(f"expert slots {used} changed under {tries} computes in a row")

    def plan_waves(self, needed: list[int]) -> list[list[int]]:
        """Split the step's experts into waves (see the module doc) and count hits/misses."""
        slots, c = self.slots, self.slots.counters
        slot_of = slots.slot_of
        resident = [e for e in needed if slot_of[e] >= 0]
        missing = [e for e in needed if slot_of[e] < 0]
        c.steps += 1
        c.hits += len(resident)
        c.misses += len(missing)
        if self._prefetched:
            hit_prefetch = self._prefetched.intersection(resident)
            c.prefetch_hits += len(hit_prefetch)
            c.prefetch_wasted_bytes += (len(self._prefetched) - len(hit_prefetch)) * slots.store.bytes_per_expert
            self._prefetched.clear()
        k = slots.num_slots
        if len(needed) <= k:
            waves = [needed]
        else:
            room = k - len(resident)
            rest = missing[room:]
            waves = [resident + missing[:room]] + [rest[i:i + k] for i in range(0, len(rest), k)]
        c.waves += len(waves)
        return waves

    def _page_in(self, wave: list[int]) -> list[int]:
        slots = self.slots
        slot_of = slots.slot_of
        where = [slot_of[e] for e in wave]
        missing = [e for e, s in zip(wave, where) if s < 0]
        if missing:
            protect = {s for s in where if s >= 0}
            slots.load(list(zip(missing, slots.policy.victims(len(missing), protect))))
        wave_slots = [slots.slot_of[e] for e in wave] if missing else where
        slots.wait(wave_slots)
        slots.touch(wave_slots)
        return wave_slots

    def prefetch(self, experts: list[int]) -> None:
        """Start copying `experts` (a prediction for this layer's next step, most confident
        first; at most `prefetch_limit` of them) into the least
        recently used slots that hold none of them, only while the copy engine is idle
        (a wrong guess must never delay a page-in).  Does not wait for the copies."""
        if not self.cache or not self.slots.copier.idle():
            return
        slots = self.slots
        slot_of = slots.slot_of
        wanted = [e for e in dict.fromkeys(experts) if slot_of[e] < 0]
        protect = {slot_of[e] for e in experts if slot_of[e] >= 0}
        room = slots.num_slots - len(protect)
        wanted = wanted[:room if self.prefetch_limit is None else min(room, self.prefetch_limit)]
        # Prefetched slots keep their place in the LRU order (measured: marking them recently
        # used evicts more useful experts than it saves; see docs/benchmarks.md).
        slots.load(list(zip(wanted, slots.policy.victims(len(wanted), protect))), prefetch=True)
        self._prefetched.update(wanted)
        slots.counters.prefetched += len(wanted)
