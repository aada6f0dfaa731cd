"""The compiled decode step: the model's decode forward, embedding to logits, compiled with
torch.compile (inductor; on a CPU its C++ backend) for the batch buckets.

With every expert resident the step is one graph with no graph break.  With paged experts, a
bucket whose batch cannot need more experts than a layer has slots (bucket * top_k <= K: a
single wave, whatever the routing) is one graph too: each paged layer decides and pages in on
the device (`PagedExperts.on_device`, engine/experts/device_plan.py), and the host reads nothing
until it asks (counters, a host-plan step).  A larger bucket may need waves, which the host
plans: for it the host decides, per MoE layer, which experts to page in from the routing the
graph computed, so the step runs as explicit parts (`DecoderModel.decode_part`): the layers up to a paged MoE
layer's router, compiled; the host's paging decision and the expert compute over slots
(`PagedExperts.__call__`, its gathered kernel compiled for the bucket's shape); the next part,
which finishes that layer's block.  One host synchronisation per MoE layer.  A bucket that
may decide on the device is compiled both ways at start-up: verify mode, which a worker turns
on after its engine is built, sends it to the host plan.  Sampling stays outside: the step
returns logits.

Shapes on a CPU: bucket 1 has a graph of its own; the buckets above 1 share one graph whose
batch dimension is symbolic, and in every graph the page table's width (the longest request's
pages) is symbolic, so one graph serves every length (the keys past each request's length are
masked: `TorchAttention(static=True)`).  A graph per bucket compiled the default seven buckets
of the shipped model in 535 s cold and 58 s from the cache on this 2-core machine under load,
against 139 s and 22 s this way, at the same speed per step (docs/benchmarks.md).  On CUDA each
bucket is captured as a CUDA graph of its own (`engine.compiled.cuda_graphs`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from engine.attention import TorchAttention
from engine.compiled.buckets import bucket_for, pad_rows
from engine.forward_batch import ForwardBatch, build_batch
from engine.kernels.fused_moe import gathered_all
from engine.kv_pool import PagePool
from engine.models.decoder import DecoderModel, MoeBlock
from engine.moe import StepPlan

log = logging.getLogger(__name__)

MIN_PAGES = 2   # page-table width at least this: dynamo would specialise a width of 1 into a graph of its own
GATHERED = StepPlan("gathered", 0)
# Inductor checks every intermediate buffer's size, stride and alignment on each call by
# default: about 80 Python calls per step of the shipped model, a debugging aid for graphs
# whose shapes could drift, which these (traced for the buckets) cannot.
OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {
    "size_asserts": False, "alignment_asserts": False, "scalar_asserts": False, "cpp_wrapper": True}


class CompiledDecode:
    """Owns the compiled decode graphs of one model and pool (CPU: inductor)."""

    def __init__(self, model: DecoderModel, pool: PagePool, buckets: tuple[int, ...]) -> None:
        self.model, self.pool, self.buckets = model, pool, buckets
        self.attention = TorchAttention(pool.page_size, static=True)
        paged = model.paged_experts()
        self.paged = list(paged.values())
        self.fullgraph = not self.paged
        self.device_paging = True   # False: the host plans every paged step (a comparison)
        self.top_k = model.cfg.num_experts_per_tok
        # with paged experts: parts of layers [first, stop), each but the last ending at a paged
        # MoE layer's router (DecoderModel.decode_part)
        ends = sorted(paged)
        self.parts = list(zip([0] + [e + 1 for e in ends], [e + 1 for e in ends] + [len(model.layers)]))
        _allow_recompiles(len(buckets) * (len(self.parts) + 1) + 8)
        # one code object, one graph per bucket (and part): dynamo's cache keeps them apart by
        # shape (and part number)
        self._whole: Callable[..., Any] = torch.compile(self._forward, fullgraph=True, dynamic=False, options=OPTIONS)
        self._graph: Callable[..., Any] = (self._whole if self.fullgraph else
                                           torch.compile(self._part, fullgraph=True, dynamic=False, options=OPTIONS))
        self._kernel: Callable[..., torch.Tensor] = (
            torch.compile(gathered_all, fullgraph=True, dynamic=False, options=OPTIONS) if self.paged else gathered_all)
        self.compiled: set[int] = set()   # buckets that ran
        self.compile_s = 0.0                # the start-up compilation's seconds (engine.compiled.startup)

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def fits(self, rows: int) -> bool:
        return rows <= self.max_rows

    def may_decide_on_device(self, size: int) -> bool:
        """Whether bucket `size`'s paged layers could ever decide on the device: a single wave
        whatever the routing (size * top_k <= K), LRU eviction, caching on.  Such a bucket is
        compiled for both modes: verify mode, turned on after start-up, sends it to the host plan."""
        return bool(self.paged) and self.device_paging and all(
            e.cache and size * self.top_k <= e.slots.num_slots and e.slots.device_capable() for e in self.paged)

    def on_device(self, size: int) -> bool:
        """Whether bucket `size`'s paged layers decide on the device now (`may_decide_on_device`,
        every slot full, no verify mode)."""
        return self.may_decide_on_device(size) and all(e.slots.device_ready() for e in self.paged)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 page_table: torch.Tensor, seq_lens: torch.Tensor, kv: torch.Tensor,
                 live: torch.Tensor | None = None) -> torch.Tensor:
        batch = ForwardBatch(input_ids, positions, slot_mapping, page_table, seq_lens,
                             logits_indices=positions, is_decode=True, live=live)
        hidden = self.model.forward(batch, kv, attention=self.attention, prefetch=False)
        return self.model.logits(hidden)

    def _part(self, part: int, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
              page_table: torch.Tensor, seq_lens: torch.Tensor, kv: torch.Tensor,
              carry: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, ...]:
        batch = ForwardBatch(input_ids, positions, slot_mapping, page_table, seq_lens,
                             logits_indices=positions, is_decode=True)
        first, stop = self.parts[part]
        return self.model.decode_part(batch, kv, self.attention, first, stop, carry,
                                      route_last=part < len(self.parts) - 1)

    def _segments(self, fb: ForwardBatch, dynamic: bool) -> torch.Tensor:
        """The paged step: each part's graph, then the host's paging decision and the compiled
        expert compute of the layer it ended at (`PagedExperts.__call__`, one synchronisation).
        `dynamic`: the batch dimension is symbolic (the carried tensors' too)."""
        carry: tuple[torch.Tensor, ...] | None = None
        args = (fb.input_ids, fb.positions, fb.slot_mapping, fb.page_table, fb.seq_lens, self.pool.kv)
        for part, (_, stop) in enumerate(self.parts):
            out = self._graph(part, *args, carry)
            if part == len(self.parts) - 1:
                return out[0]
            x, h, weights, ids = out
            block = self.model.layers[stop - 1].mlp
            assert isinstance(block, MoeBlock)  # a part ends at a paged MoE layer
            carry = (x, h, weights, block.experts(h, ids))
            if dynamic:
                for tensor in carry:
                    torch._dynamo.mark_dynamic(tensor, 0)
        raise AssertionError("a compiled step has at least one part")

    def run(self, tokens: list[list[int]], starts: list[int], tables: list[list[int]],
            real: int | None = None, whole: bool | None = None) -> torch.Tensor:
        """Logits [n, V] (fp32) of a decode batch of n <= max_rows requests, each adding its one
        token of `tokens` at `starts` over its pages `tables`; writes their K/V into the pool.
        `real`: how many of the rows are requests (default all; the rest route no expert).
        `whole`: paged experts decide on the device (default: `on_device`; the warm-up compiles
        both modes)."""
        recompile_budget()
        n = len(tokens)
        size = bucket_for(n, self.buckets)
        if size is None:
            raise ValueError(f"a decode batch of {n} requests exceeds the largest compiled bucket {self.max_rows}")
        # each request's pages up to its length after this token: a request reserves pages for
        # its whole output at admission, and the static plan reads every page of the table
        page_size = self.pool.page_size
        tables = [table[:(start + page_size) // page_size] for table, start in zip(tables, starts)]
        t, s, tb = pad_rows(tokens, starts, tables, size, self.pool.scratch_page)
        fb = build_batch(t, s, tb, page_size, self.pool.kv.device, pad_page=self.pool.scratch_page,
                         min_pages=MIN_PAGES)
        torch._dynamo.mark_dynamic(fb.page_table, 1)
        if size > 1:  # every bucket above 1 shares one graph (see the module doc)
            for tensor in (fb.input_ids, fb.positions, fb.slot_mapping, fb.page_table, fb.seq_lens):
                torch._dynamo.mark_dynamic(tensor, 0)
        rows = n if real is None else real
        if whole is None:
            whole = self.on_device(size)
        assert self.fullgraph or not whole or self.may_decide_on_device(size), \
            f"bucket {size} cannot decide on the device"
        with self._paging(rows, whole):
            if self.fullgraph:
                logits = self._graph(fb.input_ids, fb.positions, fb.slot_mapping, fb.page_table, fb.seq_lens,
                                     self.pool.kv)
            elif whole:
                live = torch.arange(size, device=fb.input_ids.device) < rows
                if size > 1:
                    torch._dynamo.mark_dynamic(live, 0)
                logits = self._whole(fb.input_ids, fb.positions, fb.slot_mapping, fb.page_table, fb.seq_lens,
                                     self.pool.kv, live)
            else:
                logits = self._segments(fb, dynamic=size > 1)
        self.compiled.add(size)
        return logits[:n]

    @contextmanager
    def _paging(self, rows: int, on_device: bool = False) -> Iterator[None]:
        """During one step, the paged experts see which rows are real, use the gathered plan
        for every call and the compiled gathered kernel; `on_device`: they decide on the device
        (their host state pushed first, marked out of date after)."""
        for e in self.paged:
            e.rows, e.plan, e.kernel, e.on_device = rows, GATHERED, self._kernel, on_device
            if on_device:
                e.slots.prepare_device()
        try:
            yield
        finally:
            for e in self.paged:
                e.rows, e.plan, e.kernel, e.on_device = None, None, None, False
                if on_device:
                    e.slots.device_stepped()
                    e.slots.mark_used()

    def modes(self, size: int) -> tuple[bool, ...]:
        """The modes bucket `size` may run in (`run`'s `whole`): one graph of the whole forward
        (every expert resident, or paged experts deciding on the device), the parts."""
        if self.fullgraph:
            return (True,)
        return (True, False) if self.may_decide_on_device(size) else (False,)

    def warm_up(self, progress: Callable[[int, int, int], None] | None = None) -> None:
        """Compile every bucket now, in each mode it may run in (`modes`; a step of padding rows
        only: it writes the scratch page and nothing else).  `progress(done, total, bucket)`
        after each."""
        for i, size in enumerate(self.buckets):
            for whole in self.modes(size):
                with torch.inference_mode():
                    self.run([[0]] * size, [0] * size, [[self.pool.scratch_page]] * size, real=0, whole=whole)
            if progress is not None:
                progress(i + 1, len(self.buckets), size)


# dynamo's limits on the graphs of one code object, raised by what every engine of the process
# asks for (`_allow_recompiles`): past them a fullgraph compile raises (`recompile_limit exceeded`)
_LIMITS = ("recompile_limit", "accumulated_recompile_limit")
_BASE = {name: int(getattr(torch._dynamo.config, name)) for name in _LIMITS}
_extra_graphs = 0
_applied = threading.local()


def _allow_recompiles(n: int) -> None:
    """Let dynamo keep `n` more graphs of one function (one per bucket and part) than its
    default: every engine of the process compiles the same code objects."""
    global _extra_graphs
    _extra_graphs += n


def recompile_budget() -> None:
    """Apply the process's graph budget in this thread: dynamo's settings are per thread (a
    setting made in the thread that built the engine is not seen by the one that steps it)."""
    if getattr(_applied, "extra", None) != _extra_graphs:
        cfg = torch._dynamo.config
        for name in _LIMITS:
            setattr(cfg, name, _BASE[name] + _extra_graphs)
        _applied.extra = _extra_graphs
