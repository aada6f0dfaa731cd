"""The decoder every family runs: embedding, then per layer a token mixer (attention over the
paged KV cache) and an MLP (dense, or MoE with optional shared experts), each after an RMSNorm
and added to the residual stream; a final norm and the LM head.

What differs between families lives in the parts: `engine/models/gqa.py` (grouped-query
attention with its options), `engine/models/mla.py` (latent attention), the routers of
`engine/moe.py`, and the experts (resident or paged).  The model itself only orders them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F

from engine.attention import AttentionPlan, TorchAttention
from engine.config import ModelConfig
from engine.experts.paged import PagedExperts
from engine.forward_batch import ForwardBatch
from engine.layers import rms_norm
from engine.moe import Experts, Router, combine
from engine.quant.dense import DenseWeight, linear
from engine.quant.stack import weight_format
from engine.rope import Rope

# A prefetch that guesses wrong holds the link when a demand page-in arrives.  Measured on
# the shipped model (bench.experts, K = 16, emulated link): prefetching every predicted
# expert was right about 35% of the time and slower than demand paging; guesses with at
# least 0.3 of the routing weight were right about 95% of the time, within a few percent
# of demand paging (docs/benchmarks.md).
PREFETCH_MIN_WEIGHT = 0.3


@dataclass
class StepContext:
    """What every layer of one forward pass shares: the batch, the attention backend and its
    decode plan (None for a prefill), and rotary tables computed once per Rope."""
    batch: ForwardBatch
    attention: TorchAttention
    plan: AttentionPlan | None
    dtype: torch.dtype
    kv: torch.Tensor                 # the whole pool [L, C, P, S, H, D]
    layer: int = 0                   # the layer running now (the forward loop sets it)
    _tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _shared: dict[str, Any] = field(default_factory=dict)

    def tables(self, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        key = id(rope)
        if key not in self._tables:
            self._tables[key] = rope.tables(self.batch.positions, self.dtype)
        return self._tables[key]

    def store(self, rows: torch.Tensor) -> None:
        """Write this pass's cache rows of the running layer, [C, T, H, D] (one per token), at
        the batch's slots.  The write goes into the pool tensor itself, never through a view of
        it: a compiled step then writes the rows in place instead of copying the pool back."""
        page_size = self.kv.shape[3]
        pages, offsets, layers = self.shared("store", lambda: (
            (self.batch.slot_mapping // page_size)[None], (self.batch.slot_mapping % page_size)[None],
            torch.arange(self.kv.shape[0], device=self.kv.device)[:, None, None]))
        parts = torch.arange(rows.shape[0], device=rows.device)[:, None]
        self.kv.index_put_((layers[self.layer], parts, pages, offsets), rows)

    def shared(self, key: str, make: Callable[[], Any]) -> Any:
        """What `make` returns, made once per forward pass for every layer that asks by `key`
        (e.g. host-side facts about the batch: one device sync per pass, not per layer)."""
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]


class Mixer(Protocol):
    """A layer's attention: writes its tokens' KV into `kv_layer` at the batch's slots and
    returns its output.  h: [T, H] (normed) -> [T, H]; kv_layer: [C, P, S, heads, dim]."""

    def __call__(self, h: torch.Tensor, kv_layer: torch.Tensor, ctx: StepContext) -> torch.Tensor: ...


class DenseMlp:
    """SiLU-gated MLP: w13 [2I, H] (gate rows, then up rows), w2 [H, I]; plain, or kept quantized
    (engine/quant/dense.py)."""

    def __init__(self, w13: DenseWeight, w2: DenseWeight) -> None:
        self.w13, self.w2 = w13, w2

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = linear(h, self.w13).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.w2)


class MoeBlock:
    """Routed experts, plus always-resident shared experts (optionally gated per token by
    sigmoid(h @ shared_gate.T), Qwen2-MoE) added after them."""

    def __init__(self, router: Router, experts: Experts, shared: DenseMlp | None = None,
                 shared_gate: torch.Tensor | None = None) -> None:
        self.router, self.experts, self.shared, self.shared_gate = router, experts, shared, shared_gate

    def __call__(self, h: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        """`live` [T] bool: which rows are requests, for paged experts deciding on the device
        (a compiled step's padding rows must page and count nothing)."""
        weights, ids = self.router(h)
        if live is not None and isinstance(self.experts, PagedExperts):
            return self.finish(h, self.experts(h, ids, live), weights)
        return self.finish(h, self.experts(h, ids), weights)

    def finish(self, h: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The block's output from its experts' outputs y [T, k, H] and routing weights."""
        out = combine(y, weights)
        if self.shared is None:
            return out
        shared = self.shared(h)
        if self.shared_gate is not None:
            shared = torch.sigmoid(F.linear(h, self.shared_gate)) * shared
        return out + shared


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor   # [H]
    post_norm: torch.Tensor    # [H]
    attn: Mixer
    mlp: MoeBlock | DenseMlp


class DecoderModel:
    def __init__(self, cfg: ModelConfig, layers: list[DecoderLayer], embed: torch.Tensor,
                 final_norm: torch.Tensor, lm_head: torch.Tensor, attention: TorchAttention) -> None:
        self.cfg = cfg
        self.layers = layers
        self.embed = embed            # [V, H]
        self.final_norm = final_norm  # [H]
        self.lm_head = lm_head        # [V, H]
        self.attention = attention
        moe = [i for i, layer in enumerate(layers) if isinstance(layer.mlp, MoeBlock)]
        self._next_moe = dict(zip(moe, moe[1:]))  # MoE layer -> the next MoE layer
        self.prefetch_experts = False  # paged experts: predict the next layer's experts

    def forward(self, batch: ForwardBatch, kv: torch.Tensor,
                on_layer: Callable[[int], None] | None = None,
                attention: TorchAttention | None = None, prefetch: bool = True) -> torch.Tensor:
        """Run every layer, writing this batch's KV into `kv` at `batch.slot_mapping`.
        Call under torch.inference_mode() (the model runner does).  `attention`: the backend for
        this pass (default the model's; a compiled step passes its static one); `prefetch`: False
        turns the experts' prefetch off for this pass (a compiled step: it would cost a second
        host synchronisation per MoE layer).

        kv: [L, C, P, S, heads, dim].  Returns the final hidden states of the tokens named by
        `batch.logits_indices`: [B, H].
        """
        eps = self.cfg.rms_norm_eps
        attention = attention or self.attention
        x = self.embed[batch.input_ids]  # [T, H]
        ctx = StepContext(batch, attention, attention.plan(batch) if batch.is_decode else None, x.dtype, kv)
        for li, layer in enumerate(self.layers):
            ctx.layer = li
            x = x + layer.attn(rms_norm(x, layer.input_norm, eps), kv[li], ctx)
            h = rms_norm(x, layer.post_norm, eps)
            x = x + (layer.mlp(h, batch.live) if isinstance(layer.mlp, MoeBlock) else layer.mlp(h))
            if prefetch and self.prefetch_experts and li in self._next_moe:
                self._prefetch(x, self._next_moe[li])
            if on_layer is not None:
                on_layer(li)           # layer li's KV is in the pool
        last = x if batch.is_decode else x[batch.logits_indices]  # decode: one token per request
        return rms_norm(last, self.final_norm, eps)

    def decode_part(self, batch: ForwardBatch, kv: torch.Tensor, attention: TorchAttention, first: int, stop: int,
                    carry: tuple[torch.Tensor, ...] | None, route_last: bool) -> tuple[torch.Tensor, ...]:
        """Layers [first, stop) of a decode pass: the part of a compiled step between two paged
        MoE layers' expert computations (engine/compiled/step.py).  `carry` (None: start from the
        embedding) is what the previous part returned with its experts' output y appended:
        (x, h, weights, y); layer first-1's block is finished with it first.  `route_last`: layer
        stop-1 has paged experts, the part ends after its router and returns (x, h, weights, ids)
        for the host's paging decision; else it returns (logits [B, V],)."""
        eps = self.cfg.rms_norm_eps
        ctx = StepContext(batch, attention, attention.plan(batch), self.embed.dtype, kv)
        if carry is None:
            x = self.embed[batch.input_ids]
        else:
            x, h, weights, y = carry
            block = self.layers[first - 1].mlp
            assert isinstance(block, MoeBlock)  # a part starts after a paged MoE layer
            x = x + block.finish(h, y, weights)
        for li in range(first, stop):
            ctx.layer = li
            layer = self.layers[li]
            x = x + layer.attn(rms_norm(x, layer.input_norm, eps), kv[li], ctx)
            h = rms_norm(x, layer.post_norm, eps)
            if route_last and li == stop - 1:
                assert isinstance(layer.mlp, MoeBlock)  # a part ends at a paged MoE layer
                weights, ids = layer.mlp.router(h)
                return x, h, weights, ids
            x = x + layer.mlp(h)
        return (self.logits(rms_norm(x, self.final_norm, eps)),)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, H] -> [B, V] in fp32."""
        return F.linear(hidden, self.lm_head).float()

    def paged_experts(self) -> dict[int, PagedExperts]:
        """Layer -> its paged experts (empty when every expert is resident)."""
        return {i: layer.mlp.experts for i, layer in enumerate(self.layers)
                if isinstance(layer.mlp, MoeBlock) and isinstance(layer.mlp.experts, PagedExperts)}

    def expert_formats(self) -> dict[int, str]:
        """MoE layer -> how its routed experts are held: a dtype ("bfloat16") or a quantized
        format ("gptq int4 g128"), resident or paged alike."""
        out = {}
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, MoeBlock):
                e = layer.mlp.experts
                out[i] = e.slots.store.format if isinstance(e, PagedExperts) else weight_format(getattr(e, "w13"))
        return out

    def _prefetch(self, x: torch.Tensor, nxt: int) -> None:
        """Predict layer `nxt`'s experts by applying its router to the residual stream as
        it leaves the current layer (normed as `nxt` will norm it, before `nxt`'s attention
        adds to it) and start their copies, which overlap `nxt`'s attention."""
        target = self.layers[nxt]
        # prefetch_experts is set only when every MoE layer's experts are paged
        assert isinstance(target.mlp, MoeBlock) and isinstance(target.mlp.experts, PagedExperts)
        weights, predicted = target.mlp.router(rms_norm(x, target.post_norm, self.cfg.rms_norm_eps))
        # Most confident first (every token's first choice, then every second choice, ...),
        # and only guesses with at least PREFETCH_MIN_WEIGHT of the token's routing weight (its
        # share of the token's k weights: routers that scale or do not renormalise them, as
        # GLM-4.5's and DeepSeek-V3's do, keep the rule measured on probabilities).
        share = weights / weights.sum(dim=-1, keepdim=True)
        ranked = zip(predicted.t().reshape(-1).tolist(), share.t().reshape(-1).tolist())
        target.mlp.experts.prefetch(list(dict.fromkeys(e for e, w in ranked if w >= PREFETCH_MIN_WEIGHT)))
