"""MoE layers at a published shape with random weights, paged by engine/experts, and one
measured point of `bench.real_shape` (a K, a batch, a paging plan).

Each layer is a router [E, H] and E experts in an `ExpertStore` (w13 [E, 2I, H], w2 [E, H, I],
bf16; page-locked on CUDA) in front of K `ExpertSlots` (copies on `CudaStreamCopy`'s side
streams on CUDA, `DirectCopy` elsewhere: what `engine.experts.paged_factory` builds for the
loader) computed by `PagedExperts` as the compiled decode step sets it up (the gathered plan and
kernel, `gathered_all`, for every call, uncompiled here).  The router's matmul is paid ([T, H] x [H, E]),
but the experts a token uses come from the trace: its probabilities at the trace's ids, renormed,
weight the experts' outputs.  No attention, norms or embeddings: a decode step is every layer's
MoE for the batch's tokens, x <- x + moe(x), layer after layer.  On CUDA a point deciding on the
device runs the step as one captured CUDA graph (`captured_step`), as the engine's decode step
is captured; host-plan points run eagerly (the routing read in every layer).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from bench.expert_trace import Trace, mapped_steps, reference_lru_misses
from engine.experts import CudaStreamCopy, DirectCopy, ExpertSlots, ExpertStore, PagedExperts
from engine.moe import StepPlan, combine

GATHERED = StepPlan("gathered", 0)     # what engine/compiled/step.py sets on paged experts


@dataclass(frozen=True)
class MoeShape:
    layers: int          # the model's MoE layers (published)
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int    # one expert's
    dtype: torch.dtype = torch.bfloat16

    @property
    def expert_bytes(self) -> int:
        """gate, up and down of one expert."""
        return 3 * self.hidden * self.intermediate * torch.empty((), dtype=self.dtype).element_size()

    def scaled(self, factor: int) -> "MoeShape":
        """hidden and intermediate divided by `factor` (experts, top-k and layers kept)."""
        return MoeShape(self.layers, self.num_experts, self.top_k, self.hidden // factor,
                        self.intermediate // factor, self.dtype)


@dataclass(frozen=True)
class StepCounts:
    """Decode steps per point: untimed warm-up, timed, then counted for host syncs (CUDA)."""
    warmup: int
    timed: int
    sync: int

    @property
    def total(self) -> int:
        return self.warmup + self.timed + self.sync


class MoeLayer:
    def __init__(self, router: torch.Tensor, experts: PagedExperts) -> None:
        self.router, self.experts = router, experts     # router: [E, H]

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; ids: [T, k] from the trace; live: [T] bool (all true).  Returns x + moe(x)."""
        logits = F.linear(x, self.router).float()                                   # [T, E]
        # the router's probabilities at the trace's ids, renormed: a softmax over their logits
        # (the same values, and no 0/0 where the trace picks experts this router would not)
        weights = F.softmax(logits.gather(1, ids), dim=-1).to(x.dtype)               # [T, k]
        y = self.experts(x, ids, live) if self.experts.on_device else self.experts(x, ids)
        return x + combine(y, weights)


def random_stores(shape: MoeShape, layers: int, device: torch.device, seed: int = 0
                  ) -> tuple[list[ExpertStore], list[torch.Tensor]]:
    """`layers` host stores of random experts (page-locked when `device` is CUDA: drawn there and
    copied down, far faster than the host's generator at 1.2 GB a layer) and their routers on
    `device`."""
    cuda = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate
    stores, routers = [], []
    for _ in range(layers):
        parts = []
        for dims, fan_in in (((e, 2 * i, h), h), ((e, h, i), i)):
            host = torch.empty(dims, dtype=shape.dtype, pin_memory=cuda)
            for row in range(e):     # one expert at a time: little device memory
                drawn = torch.randn(dims[1:], generator=gen, device=device, dtype=torch.float32)
                host[row].copy_(drawn.mul_(fan_in ** -0.5).to(shape.dtype))
            parts.append(host)
        stores.append(ExpertStore(parts[0], parts[1]))
        router = torch.randn(e, h, generator=gen, device=device, dtype=torch.float32).mul_(h ** -0.5)
        routers.append(router.to(shape.dtype))
    return stores, routers


def build_layers(stores: list[ExpertStore], routers: list[torch.Tensor], k: int, device: torch.device
                 ) -> list[MoeLayer]:
    """Fresh K slots per layer (warm start: experts 0..K-1, as the engine's), LRU, caching on,
    the gathered plan for every step."""
    out = []
    for store, router in zip(stores, routers):
        copier = CudaStreamCopy(device) if device.type == "cuda" else DirectCopy()
        experts = PagedExperts(ExpertSlots(store, k, device, copier=copier))
        experts.plan = GATHERED
        out.append(MoeLayer(router, experts))
    return out


def totals(layers: list[MoeLayer]) -> dict[str, int]:
    """hits, misses, waves, steps summed over the layers (reads the device state back)."""
    keys = ("hits", "misses", "waves", "steps")
    return {key: sum(getattr(layer.experts.counters, key) for layer in layers) for key in keys}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_point(stores: list[ExpertStore], routers: list[torch.Tensor], shape: MoeShape, trace: Trace,
              k: int, batch: int, plan: str, counts: StepCounts, device: torch.device,
              link_bytes_per_s: float) -> dict[str, Any]:
    """Decode `counts.total` steps of `batch` trace sequences over fresh K slots per layer with
    `plan` "host" (PagedExperts' host plan: the routing read back in every layer) or "device"
    (the single-wave decision on the device, as a compiled step makes it; needs batch*top_k <= K).
    Returns the point's figures: tok/s of the timed steps, the engine's misses and the reference
    LRU's on the same steps, the link bound from the reference's, host syncs per step (CUDA)."""
    layers = build_layers(stores, routers, k, device)
    ids = mapped_steps(trace, shape.num_experts, shape.top_k, len(layers), batch, 0, counts.total)
    on_device = [t.to(device) for t in ids]                       # per layer [steps, batch, top_k]
    x = torch.randn(batch, shape.hidden, device=device, dtype=torch.float32).to(shape.dtype)
    live = torch.ones(batch, dtype=torch.bool, device=device)
    if plan == "device":
        assert batch * shape.top_k <= k, "the device decision is for single-wave steps"
        for layer in layers:
            layer.experts.on_device = True
            layer.experts.slots.prepare_device()

    def step(s: int) -> torch.Tensor:
        h = x
        for layer, steps in zip(layers, on_device):
            h = layer(h, steps[s], live)
        if plan == "device":
            for layer in layers:
                layer.experts.slots.device_stepped()
                layer.experts.slots.mark_used()
        return h

    advance = captured_step(layers, on_device, x, live) if plan == "device" and device.type == "cuda" else step

    for s in range(counts.warmup):
        advance(s)
    synchronize(device)
    before = totals(layers)
    start = time.perf_counter()
    for s in range(counts.warmup, counts.warmup + counts.timed):
        out = advance(s)
    synchronize(device)
    elapsed = time.perf_counter() - start
    after = totals(layers)
    syncs = count_syncs(advance, counts, device)
    assert bool(torch.isfinite(out.float()).all()), "the MoE step produced non-finite values"
    return point_figures(ids, k, batch, plan, counts, elapsed, before, after, syncs, shape, link_bytes_per_s)


def captured_step(layers: list[MoeLayer], ids: list[torch.Tensor], x: torch.Tensor, live: torch.Tensor
                  ) -> Callable[[int], torch.Tensor]:
    """CUDA: every layer's MoE step deciding on the device, captured as one CUDA graph (as the
    engine captures a decode bucket), replayed per step after one device copy of that step's
    routing into the graph's static buffer; the host reads nothing.  The warm-up (Triton
    compiles there, never inside the capture) and the capture run step 0's routing: repeating
    a step changes no slot and no LRU order, so the misses of later steps stay the reference's."""
    stacked = torch.stack(ids)                    # [L, steps, batch, top_k]
    static = stacked[:, 0].clone()

    def body() -> torch.Tensor:
        h = x
        for li, layer in enumerate(layers):
            h = layer(h, static[li], live)
        return h
    side = torch.cuda.Stream(device=x.device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize(x.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body()

    def step(s: int) -> torch.Tensor:
        static.copy_(stacked[:, s])
        graph.replay()
        for layer in layers:
            layer.experts.slots.device_stepped()
            layer.experts.slots.mark_used()
        return out
    return step


def count_syncs(step: Any, counts: StepCounts, device: torch.device) -> float | None:
    """Host synchronisations per step over the last `counts.sync` steps (CUDA's sync debug mode;
    None elsewhere or with no steps to count)."""
    if device.type != "cuda" or counts.sync == 0:
        return None
    from engine.compiled.cuda_support import count_host_syncs
    first = counts.warmup + counts.timed
    with count_host_syncs() as found:
        for s in range(first, first + counts.sync):
            step(s)
    synchronize(device)
    return found.count / counts.sync


def point_figures(ids: list[torch.Tensor], k: int, batch: int, plan: str, counts: StepCounts, elapsed: float,
                  before: dict[str, int], after: dict[str, int], syncs: float | None, shape: MoeShape,
                  link_bytes_per_s: float) -> dict[str, Any]:
    timed = slice(counts.warmup, counts.warmup + counts.timed)
    reference = sum(sum(reference_lru_misses(layer.reshape(layer.shape[0], -1).tolist(), k)[timed]) for layer in ids)
    engine = {key: after[key] - before[key] for key in after}
    tok_s = counts.timed * batch / elapsed
    per_token = reference / (counts.timed * batch)
    bound = link_bytes_per_s / (per_token * shape.expert_bytes) if reference else None
    looked = engine["hits"] + engine["misses"]
    return {"K": k, "batch": batch, "plan": plan, "single_wave": batch * shape.top_k <= k,
            "timed_steps": counts.timed, "tok_s": tok_s, "step_ms": elapsed / counts.timed * 1e3,
            "misses_per_step": engine["misses"] / counts.timed,
            "reference_misses_per_step": reference / counts.timed,
            "misses_match_reference": engine["misses"] == reference,
            "misses_per_token": per_token, "hit_rate": engine["hits"] / looked if looked else 1.0,
            "waves_per_layer_step": engine["waves"] / (counts.timed * len(ids)),
            "bound_tok_s": bound, "ratio_to_bound": tok_s / bound if bound else None,
            "host_syncs_per_step": syncs}
