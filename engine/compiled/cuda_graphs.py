"""The compiled decode step on CUDA: each batch bucket's step captured as CUDA graphs.

Static buffers.  Each bucket b owns one device tensor `packed` [b, 5 + max_pages] int32, one
row per request: token, position, KV slot, sequence length, whether the row is a request (1)
or padding (0), then its page table (`max_pages` wide: the most pages one request can hold).
`run` fills a pinned host copy of it (only the entries that changed: a request's pages past its
length are never read) and issues one non-blocking host-to-device copy; everything after that
is replays.  Padding rows decode token 0 at position 0 on `pool.scratch_page` (see
`engine.compiled.buckets`).

The graph.  The forward is `torch.compile`d (inductor, `fullgraph` when every expert is
resident) and the compiled call is captured by explicit `torch.cuda.CUDAGraph` capture, after
warm-up iterations on a side stream as PyTorch's CUDA-graph notes prescribe (compilation,
Triton autotuning and lazy initialisation happen there, never inside a capture).  The decode
attention is the model's Triton kernel through a custom op (`tandem::paged_decode_attention`,
opaque to dynamo: its launcher reads data pointers, which dynamo cannot trace); it reads
(page_table, seq_lens) from `packed`, so its shapes are static per bucket.  Every bucket's
graphs share one memory pool (buckets never replay interleaved: one engine loop); the logits are
cloned out of the pool before `run` returns.

All experts resident: one graph per bucket, replayed with zero host synchronisations.

Paged experts, a bucket that decides on the device (`CompiledDecode.on_device`: bucket * top_k
<= K): one graph, as with every expert resident; each paged layer's decision and page-ins are
inside it (engine/experts/device_plan.py; on CUDA the page-ins read the pinned host store from
the device, engine/kernels/triton/expert_copy.py), so a replay makes no host synchronisation.
Before a replay the host pushes its copy of the slot state if it changed (non-blocking, from
pinned memory); after it, the host copy is marked out of date.  A bucket is captured for the
mode it runs in (`Bucket.whole`); a bucket that may run in both is captured for both at
start-up (verify mode, turned on later, sends it to the host plan).

Paged experts, a larger bucket: the host must see each MoE layer's routing to page experts in,
so the step is the base's explicit parts (`CompiledDecode.parts`, `DecoderModel.decode_part`, each compiled
whole) captured one graph each, with a graph of each paged layer's expert compute between them:
A0 = embedding .. first paged router; per paged MoE layer i, E_i (slot ids read from the device
slot table, `slot_table[ids]`, padding rows on slot 0; the compiled gathered kernel) and A_{i+1}
= that layer's combination .. the next paged router (or the logits).  A replay runs A0, then
per layer: the routing to the host (the one synchronisation of the layer), the paging decision
and page-ins (`PagedExperts.plan_waves` / `_page_in`: the same counters, LRU order and copy
streams as the eager path), E_i, A_{i+1}.  A step that needs more experts than slots (waves),
or verify mode, runs that layer's experts eagerly through `PagedExperts` into E_i's output
buffer instead: the same pairs by the same kernel.  All graphs of one bucket share the memory
pool and replay in capture order.  Chosen over inductor's `reduce-overhead` (CUDA graph trees):
the trees would copy the pool's KV (an input it mutates) unless its address is marked static,
re-record on any guard change and keep a memory pool per tree; explicit capture keeps every
address in Tandem's hands and the host's work between the graphs in plain Python.

`engine.compiled.cuda_support.count_host_syncs` counts the host synchronisations of a block of code
(`torch.cuda.set_sync_debug_mode("warn")`), for the tests and `bench.gpu_check`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from engine.attention import TorchAttention, TritonAttention
from engine.compiled.buckets import bucket_for
from engine.compiled.cuda_support import REAL, GraphAttention, blank_rows, fill_rows, unpack
from engine.compiled.step import OPTIONS, CompiledDecode, recompile_budget
from engine.experts.paged import PagedExperts
from engine.kv_pool import PagePool
from engine.models.decoder import DecoderModel, MoeBlock

log = logging.getLogger(__name__)

WARMUP_ITERS = 3                               # eager iterations on a side stream before a capture


# ---- capture and replay ----------------------------------------------------------------------

@dataclass
class Segment:
    """One MoE layer of a captured step: its inputs and output in the graphs' pool, and the
    graph of its expert compute."""
    experts: PagedExperts
    h: torch.Tensor          # [b, H] the layer's normed input
    ids: torch.Tensor        # [b, k]
    y: torch.Tensor          # [b, k, H]
    graph: torch.cuda.CUDAGraph


@dataclass
class Bucket:
    size: int
    staging: torch.Tensor    # pinned [b, PAGES + max_pages] int32
    host: np.ndarray         # staging's memory
    packed: torch.Tensor     # the device copy the graphs read
    copied: torch.cuda.Event | None   # after the last copy out of `staging` (CUDA)
    whole: bool = True       # one graph of the whole forward (resident, or paged deciding on the device)
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)   # A0 .. An (one per part)
    segments: list[Segment] = field(default_factory=list)             # one per MoE layer
    logits: torch.Tensor | None = None


class CudaGraphDecode(CompiledDecode):
    """The compiled decode step of one model and CUDA pool, each bucket captured as CUDA graphs
    (see the module doc).  `max_pages`: the page-table width, the most pages one request can
    hold (default, and at most: every page of the pool); `attention`: the decode attention
    (default: `GraphAttention` for a model served by the Triton kernel, else the base's static
    torch attention); `capture` False: the same step (packed rows, the same compiled segments,
    the same paging decisions) run directly, no graph captured: a comparison, and the part of
    this class a CPU can run."""

    def __init__(self, model: DecoderModel, pool: PagePool, buckets: tuple[int, ...],
                 max_pages: int | None = None, attention: TorchAttention | None = None,
                 capture: bool = True) -> None:
        super().__init__(model, pool, buckets)
        if capture and pool.kv.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a pool on a CUDA device, not {pool.kv.device}")
        if (pool.num_pages + 1) * pool.page_size >= 2**31:
            raise ValueError(f"{pool.num_pages} pages of {pool.page_size} tokens: KV slots past int32")
        self.max_pages = min(max_pages or pool.num_pages, pool.num_pages)
        self.capturing = capture
        if attention is not None:
            self.attention = attention
        elif isinstance(model.attention, TritonAttention):
            self.attention = GraphAttention(pool.page_size)
        # else: the torch attention (static: every page of the table gathered, masked) of the base
        # the compiled callable of this step: the whole forward, or a part (the base's `_graph`
        # takes the unpacked tensors and is dynamic in the batch)
        # no C++ wrapper on CUDA: it saves Python per call, which a replay does not run anyway
        options = {**OPTIONS, "cpp_wrapper": False} if pool.kv.device.type == "cuda" else OPTIONS
        self._packed_whole: Callable[..., Any] = torch.compile(self._packed_forward, fullgraph=True, dynamic=False,
                                                               options=options)
        self._packed: Callable[..., Any] = (
            self._packed_whole if self.fullgraph else
            torch.compile(self._packed_part, fullgraph=True, dynamic=False, options=options))
        self._mempool = torch.cuda.graph_pool_handle() if capture else None
        self._stream = torch.cuda.Stream(device=pool.kv.device) if capture else None
        self._buckets: dict[tuple[int, bool], Bucket] = {}   # (size, whole) -> its graphs
        self._open: torch.cuda.CUDAGraph | None = None   # the graph being captured
        self.staging_waits = 0   # times `run` waited for the previous copy out of a staging buffer

    def _packed_forward(self, packed: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        live = packed[:, REAL] != 0 if self.paged else None
        return self._forward(*unpack(packed), kv, live)

    def _packed_part(self, part: int, packed: torch.Tensor, kv: torch.Tensor,
                     carry: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, ...]:
        return self._part(part, *unpack(packed), kv, carry)

    def _step(self, bk: Bucket, between: Callable[[PagedExperts, torch.Tensor, torch.Tensor], torch.Tensor]
              ) -> torch.Tensor:
        """One pass over the step: the whole compiled forward, or each part with `between(experts,
        h, ids) -> y` at each paged MoE layer.  Returns the logits."""
        kv = self.pool.kv
        if bk.whole:
            for e in self.paged:   # (paged: they decide on the device while the graph is traced)
                e.on_device = True
            try:
                logits: torch.Tensor = self._packed_whole(bk.packed, kv)
            finally:
                for e in self.paged:
                    e.on_device = False
            return logits
        carry: tuple[torch.Tensor, ...] | None = None
        for part, (_, stop) in enumerate(self.parts):
            out: tuple[torch.Tensor, ...] = self._packed(part, bk.packed, kv, carry)
            if part == len(self.parts) - 1:
                return out[0]
            x, h, weights, ids = out
            block = self.model.layers[stop - 1].mlp
            assert isinstance(block, MoeBlock) and isinstance(block.experts, PagedExperts)
            carry = (x, h, weights, between(block.experts, h, ids))
        raise AssertionError("a compiled step has at least one part")

    # ---- capture ----------------------------------------------------------------------------

    def _bucket(self, size: int, whole: bool) -> Bucket:
        host = blank_rows(size, self.max_pages, self.pool.scratch_page, self.pool.page_size)
        device = self.pool.kv.device
        if device.type != "cuda":
            staging = torch.from_numpy(host)
            return Bucket(size, staging, host, staging.clone(), None, whole)
        staging = torch.from_numpy(host).pin_memory()
        bk = Bucket(size, staging, staging.numpy(), staging.to(device), torch.cuda.Event(), whole)
        assert bk.copied is not None
        bk.copied.record()
        return bk

    def capture(self, size: int, whole: bool | None = None) -> Bucket:
        """Warm bucket `size` up on a side stream (compiling it), then capture its graphs, for
        `whole` (default: the mode it runs in now)."""
        recompile_budget()
        bk = self._bucket(size, self._whole_for(size) if whole is None else whole)
        if bk.whole:
            for e in self.paged:   # the warm-up's decisions start from the host's state
                e.slots.prepare_device()
        side = self._stream
        assert side is not None, "a step built with capture=False captures nothing"
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_ITERS):
                self._step(bk, partial(self._split, bk, False))
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            bk.graphs.append(self._begin())
            try:
                bk.logits = self._step(bk, partial(self._split, bk, True))
            finally:
                self._end()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if bk.whole:
            for e in self.paged:
                e.slots.device_stepped()
        self._buckets[size, bk.whole] = bk
        return bk

    def _whole_for(self, size: int) -> bool:
        """Whether bucket `size` runs as one graph now: every expert resident, or paged experts
        deciding on the device."""
        return self.fullgraph or self.on_device(size)

    def _begin(self) -> torch.cuda.CUDAGraph:
        """Begin capturing a graph into the step's pool (on the current, side, stream)."""
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self._mempool, capture_error_mode="thread_local")
        self._open = g
        return g

    def _end(self) -> None:
        """End the capture running now, if any (also after an error inside it)."""
        g, self._open = self._open, None
        if g is not None:
            g.capture_end()

    def _split(self, bk: Bucket, capturing: bool, e: PagedExperts, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """At a paged MoE layer of a capture: end the running graph, capture this layer's expert
        compute as a graph of its own and begin the next.  In warm-up (not `capturing`): the
        same compute, uncaptured (it compiles the kernel for the bucket's shape)."""
        if capturing:
            self._end()     # A_i
            g = self._begin()
        y = self._compute(bk, e, h, ids)
        if capturing:
            self._end()     # E_i
            bk.segments.append(Segment(e, h, ids, y, g))
            bk.graphs.append(self._begin())
        return y

    def _compute(self, bk: Bucket, e: PagedExperts, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """A MoE layer's expert compute over slots, every row's experts resident: slot ids read
        from the device slot table (padding rows on slot 0, dropped), the compiled gathered
        kernel.  y: [b, k, H]."""
        live = bk.packed[:, REAL] != 0
        slot_ids = torch.where(live[:, None], e.slots.slot_table[ids], 0)
        y: torch.Tensor = self._kernel(x, e.slots.w13, e.slots.w2, slot_ids, b13=e.slots.b13, b2=e.slots.b2,
                                       act=e.slots.store.act)
        return y.view(*ids.shape, -1)

    # ---- replay -----------------------------------------------------------------------------

    def run(self, tokens: list[list[int]], starts: list[int], tables: list[list[int]],
            real: int | None = None, whole: bool | None = None) -> torch.Tensor:
        """As `CompiledDecode.run`: logits [n, V] (fp32) of a decode batch of n <= max_rows
        requests; writes their K/V into the pool.  No host synchronisation with every expert
        resident; one per MoE layer with paged experts."""
        recompile_budget()
        n = len(tokens)
        size = bucket_for(n, self.buckets)
        if size is None:
            raise ValueError(f"a decode batch of {n} requests exceeds the largest compiled bucket {self.max_rows}")
        if whole is None:
            whole = self._whole_for(size)
        bk = self._buckets.get((size, whole)) or (self.capture(size, whole) if self.capturing else
                                                  self._bucket(size, whole))
        self._buckets[size, whole] = bk
        if bk.copied is not None and not bk.copied.query():   # the previous step's copy (done by now)
            self.staging_waits += 1
            bk.copied.synchronize()
        rows = n if real is None else real
        fill_rows(bk.host, tokens, starts, tables, self.pool.page_size, self.pool.scratch_page, rows)
        bk.packed.copy_(bk.staging, non_blocking=True)
        if bk.copied is not None:
            bk.copied.record()
        self.compiled.add(size)
        paged_whole = bk.whole and bool(self.paged)
        if paged_whole:
            for e in self.paged:
                e.slots.prepare_device()
        try:
            if not self.capturing:
                return self._step(bk, partial(self._direct, bk, rows))[:n].clone()
            bk.graphs[0].replay()
        finally:
            if paged_whole:
                for e in self.paged:
                    e.slots.device_stepped()
                    e.slots.mark_used()
        if bk.whole:
            assert bk.logits is not None
            return bk.logits[:n].clone()
        for seg, nxt in zip(bk.segments, bk.graphs[1:]):
            if self._page(seg.experts, seg.ids, rows):
                seg.graph.replay()
                seg.experts.slots.mark_used()
            else:
                seg.y.copy_(self._eager_experts(seg.experts, seg.h, seg.ids, rows))
            nxt.replay()
        assert bk.logits is not None
        return bk.logits[:n].clone()

    def _page(self, e: PagedExperts, ids: torch.Tensor, rows: int) -> bool:
        """A MoE layer's paging decision from its routing (read on the host: the layer's one
        synchronisation): True when the step's experts fit the slots and are paged in now (the
        expert graph runs next; hits, misses and the LRU order as PagedExperts counts them), False
        when the layer needs waves or verification (`_eager_experts` runs it)."""
        needed = sorted(set(ids[:rows].reshape(-1).tolist()))
        if len(needed) > e.slots.num_slots or e.slots.verify_on_use:
            return False
        if not e.cache:
            e.slots.forget_all()
        e._page_in(e.plan_waves(needed)[0])
        return True

    def _eager_experts(self, e: PagedExperts, x: torch.Tensor, ids: torch.Tensor, rows: int) -> torch.Tensor:
        """The layer's experts through PagedExperts (waves).  Its waves never write the padding
        rows' pairs (uninitialised memory, NaN at times): zeroed here, or they would reach the
        scratch page's K/V, which masked attention reads (0 * NaN) for every row."""
        with self._paging(rows):
            y: torch.Tensor = PagedExperts.__call__(e, x, ids)
        if rows < y.shape[0]:
            y[rows:] = 0
        return y

    def _direct(self, bk: Bucket, rows: int, e: PagedExperts, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`capture` False: a MoE layer's paging decision and expert compute, as a replay runs them
        (a warm-up's step of padding rows only pages and counts nothing)."""
        if rows == 0:
            return self._compute(bk, e, x, ids)
        if not self._page(e, ids, rows):
            return self._eager_experts(e, x, ids, rows)
        y = self._compute(bk, e, x, ids)
        e.slots.mark_used()
        return y

    def warm_up(self, progress: Callable[[int, int, int], None] | None = None) -> None:
        """Compile and capture every bucket now, in each mode it may run in (`modes`), the
        largest first (the smaller ones then reuse its pool memory).  `progress(done, total,
        bucket)` after each."""
        with torch.inference_mode():
            for i, size in enumerate(reversed(self.buckets)):
                for whole in self.modes(size):
                    if self.capturing:
                        self.capture(size, whole)
                    else:
                        self.run([[0]] * size, [0] * size, [[self.pool.scratch_page]] * size, real=0, whole=whole)
                self.compiled.add(size)
                if progress is not None:
                    progress(i + 1, len(self.buckets), size)
