"""Multi-head latent attention (DeepSeek-V3, Kimi-K2) on a paged KV cache.

A KV page holds, per token and layer, ONE row shared by every head (kv_geometry (1, 1, r + dr)):

    [ c (kv_lora_rank r) | k_pe (qk_rope_head_dim dr) ]
      c    = RMSNorm(kv_a_proj_with_mqa(h)[:r])        the compressed latent
      k_pe = rope(kv_a_proj_with_mqa(h)[r:])           the decoupled rope key, one for all heads

Per head, kv_b_proj [Hq * (dn + dv), r] expands the latent: k_nope = W_uk c, v = W_uv c
(W_uk = its first dn rows of each head's block, W_uv the last dv).  A head's score is
q_nope . W_uk c + q_pe . k_pe = (W_uk^T q_nope) . c + q_pe . k_pe, so:

  absorbed: query [W_uk^T q_nope | q_pe] (Dk = r + dr) attends over the cached rows as one
      shared KV head (MQA) with V = the row's first r dims (the backend's C == 1, v_dim=r);
      the per-head output o_c [Hq, r] is lifted by W_uv, then o_proj.  Every decode step.
  expanded: every cached latent goes through kv_b_proj into per-head K and V (HF's
      computation), then ordinary causal attention.  The reference.

A prefill runs request by request, each on the path that costs it fewer multiplies
(`expanding_is_cheaper`: long prompts expand, DeepSeek-V3 from ~171 queries), so a request's
numbers never depend on which other requests share its batch (disaggregated prefill batches
differ from the single-process engine's).

The softmax scale is (dn + dr) ** -0.5 times mscale(factor, mscale_all_dim) ** 2 under YaRN
(HF's yarn_apply_mscale); the rope's own attention factor is applied in its cos/sin tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.forward_batch import ForwardBatch
from engine.layers import rms_norm
from engine.models.decoder import StepContext
from engine.quant.dense import DenseWeight, linear
from engine.rope import Rope, rope_params, yarn_softmax_mscale

# DeepSeek's q_a_layernorm and kv_a_layernorm keep HF's RMSNorm default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MlaDims:
    heads: int          # Hq
    q_lora_rank: int    # 0: a plain q_proj
    kv_lora_rank: int   # r
    nope: int           # dn: qk_nope_head_dim
    rope: int           # dr: qk_rope_head_dim
    v: int              # dv: v_head_dim

    @classmethod
    def from_raw(cls, raw: dict[str, Any]) -> "MlaDims":
        return cls(heads=int(raw["num_attention_heads"]), q_lora_rank=int(raw.get("q_lora_rank") or 0),
                   kv_lora_rank=int(raw["kv_lora_rank"]), nope=int(raw["qk_nope_head_dim"]),
                   rope=int(raw["qk_rope_head_dim"]), v=int(raw["v_head_dim"]))

    @property
    def row(self) -> int:
        """One cached row: r + dr."""
        return self.kv_lora_rank + self.rope


def softmax_scale(raw: dict[str, Any]) -> float:
    """HF DeepseekV3Attention.scaling: (dn + dr) ** -0.5, times mscale(factor, mscale_all_dim)
    squared under YaRN."""
    head = int(raw["qk_nope_head_dim"]) + int(raw["qk_rope_head_dim"])
    return float(head ** -0.5 * yarn_softmax_mscale(rope_params(raw)))


@dataclass
class MlaWeights:
    w_a: DenseWeight             # [q_lora + r + dr, H]: q_a_proj rows then kv_a_proj_with_mqa (one matmul)
    b_a: torch.Tensor | None     # [q_lora + r + dr] (attention_bias)
    q_norm: torch.Tensor | None  # [q_lora] q_a_layernorm (None: no q lora)
    w_q: DenseWeight             # [Hq * (dn + dr), q_lora] q_b_proj, or [Hq * (dn + dr), H] q_proj
    kv_norm: torch.Tensor        # [r] kv_a_layernorm
    w_kv_b: torch.Tensor         # [Hq * (dn + dv), r] kv_b_proj
    w_o: DenseWeight             # [H, Hq * dv]
    b_o: torch.Tensor | None     # [H]


class MlaAttention:
    """One layer's latent attention: a `Mixer` (h [T, H] -> [T, H]) that writes the layer's
    cached rows into `kv_layer` [1, P, S, 1, r + dr] at the batch's slots."""

    def __init__(self, w: MlaWeights, dims: MlaDims, rope: Rope, scale: float,
                 absorbed: bool | None = None) -> None:
        """`absorbed`: True or False forces that path (tests); None (serving) takes the
        absorbed one for decode steps and for prefills unless expanding is cheaper."""
        self.w, self.dims, self.rope, self.scale = w, dims, rope, scale
        self.absorbed = absorbed
        per_head = w.w_kv_b.view(dims.heads, dims.nope + dims.v, dims.kv_lora_rank)
        self.w_uk = per_head[:, :dims.nope]   # [Hq, dn, r]
        self.w_uv = per_head[:, dims.nope:]   # [Hq, dv, r]

    def __call__(self, h: torch.Tensor, kv_layer: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        q_nope, q_pe = self._query_and_cache(h, kv_layer, ctx)
        if ctx.plan is not None and self.absorbed is not False:  # a decode step, batched
            out = self._absorbed_decode(q_nope, q_pe, kv_layer, ctx)
        else:
            out = self._per_request(q_nope, q_pe, kv_layer, ctx)
        return linear(out.reshape(h.shape[0], -1), self.w.w_o, self.w.b_o)

    def _query_and_cache(self, h: torch.Tensor, kv_layer: torch.Tensor,
                         ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head query parts ([T, Hq, dn], roped [T, Hq, dr]); writes each token's row."""
        d, t = self.dims, h.shape[0]
        a = linear(h, self.w.w_a, self.w.b_a)  # [T, q_lora + r + dr]
        q_in = h if self.w.q_norm is None else rms_norm(a[:, :d.q_lora_rank], self.w.q_norm, LATENT_NORM_EPS)
        q = linear(q_in, self.w.w_q).view(t, d.heads, d.nope + d.rope)
        latent = rms_norm(a[:, d.q_lora_rank:d.q_lora_rank + d.kv_lora_rank], self.w.kv_norm, LATENT_NORM_EPS)
        cos, sin = ctx.tables(self.rope)
        q_pe = self.rope.apply(q[:, :, d.nope:], cos, sin)                                 # [T, Hq, dr]
        k_pe = self.rope.apply(a[:, None, d.q_lora_rank + d.kv_lora_rank:], cos, sin)     # [T, 1, dr]
        ctx.store(torch.cat((latent, k_pe[:, 0]), dim=-1)[None, :, None])  # [1, T, 1, r + dr]: C == 1, one head
        return q[:, :, :d.nope], q_pe

    def _absorb(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """[W_uk^T q_nope | q_pe]: [T, Hq, r + dr]."""
        return torch.cat((torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1), q_pe), dim=-1)

    def _lift(self, o_lat: torch.Tensor) -> torch.Tensor:
        """Per head W_uv: [T, Hq, r] -> [T, Hq, dv]."""
        return torch.bmm(o_lat.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)

    def _absorbed_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_layer: torch.Tensor,
                         ctx: StepContext) -> torch.Tensor:
        assert ctx.plan is not None  # a decode step
        o_lat = ctx.attention.decode(self._absorb(q_nope, q_pe), kv_layer, ctx.plan, self.scale,
                                     v_dim=self.dims.kv_lora_rank)
        return self._lift(o_lat)

    def _per_request(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_layer: torch.Tensor,
                     ctx: StepContext) -> torch.Tensor:
        """Each request's queries over its own cached rows, absorbed or expanded as it costs
        that request less (or as `absorbed` forces).  Returns [T, Hq, dv]."""
        d = self.dims
        out = q_nope.new_empty(q_nope.shape[0], d.heads, d.v)
        for tokens, length, pages in ctx.shared("mla.requests", lambda: _requests(ctx.batch, kv_layer.shape[2])):
            rows = kv_layer[0, pages].reshape(-1, d.row)[:length]                  # [L, r + dr]
            visible = torch.arange(length, device=rows.device)[None, :] <= ctx.batch.positions[tokens][:, None]
            expand = (not self.absorbed if self.absorbed is not None
                      else expanding_is_cheaper(d, [tokens.shape[0]], [length]))
            if expand:
                out[tokens] = self._expanded(q_nope[tokens], q_pe[tokens], rows, visible)
            else:
                query = self._absorb(q_nope[tokens], q_pe[tokens]).transpose(0, 1)  # [Hq, Tb, r + dr]
                o_lat = F.scaled_dot_product_attention(
                    query, rows.expand(d.heads, length, d.row), rows[:, :d.kv_lora_rank].expand(d.heads, length, -1),
                    attn_mask=visible, scale=self.scale)                          # [Hq, Tb, r]
                out[tokens] = self._lift(o_lat.transpose(0, 1))
        return out

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor,
                  visible: torch.Tensor) -> torch.Tensor:
        """The reference for one request: its cached rows [L, r + dr] expanded by kv_b_proj into
        per-head K/V, attention of its queries under `visible` [Tb, L].  Returns [Tb, Hq, dv]."""
        d, length = self.dims, rows.shape[0]
        kv = F.linear(rows[:, :d.kv_lora_rank], self.w.w_kv_b).view(length, d.heads, -1)
        k_pe = rows[:, None, d.kv_lora_rank:].expand(length, d.heads, d.rope)
        k = torch.cat((kv[:, :, :d.nope], k_pe), dim=-1).transpose(0, 1)      # [Hq, L, dn + dr]
        v = kv[:, :, d.nope:].transpose(0, 1)                                  # [Hq, L, dv]
        query = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)             # [Hq, Tb, dn + dr]
        o = F.scaled_dot_product_attention(query, k, v, attn_mask=visible, scale=self.scale)
        return o.transpose(0, 1)


def expanding_is_cheaper(d: MlaDims, queries: list[int], lengths: list[int]) -> bool:
    """Whether the expanded path multiplies less than the absorbed one for requests with
    `queries[b]` queries over `lengths[b]` cached tokens.  Per head and cached token, the
    absorbed path costs each query 2r + dr (scores over r + dr dims, values over r); the
    expanded one costs r (dn + dv) once (kv_b_proj of the row) and each query dn + dr + dv.
    (Lifting queries and outputs through W_uk / W_uv is per query, not per cached token.)"""
    absorbed = sum(q * n * (2 * d.kv_lora_rank + d.rope) for q, n in zip(queries, lengths))
    expanded = sum(n * (d.kv_lora_rank * (d.nope + d.v) + q * (d.nope + d.rope + d.v))
                   for q, n in zip(queries, lengths))
    return expanded < absorbed


def _requests(batch: ForwardBatch, page_size: int) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """Per request: the flat indices of its queries, its cached length and its pages (one host
    sync for the lengths, shared by every layer of the pass)."""
    lengths = batch.seq_lens.tolist()
    if batch.q_index is None or batch.q_valid is None:  # a decode: token b is request b's
        tokens = [torch.tensor([b], device=batch.input_ids.device) for b in range(len(lengths))]
    else:
        tokens = [idx[valid] for idx, valid in zip(batch.q_index, batch.q_valid)]
    return [(t, n, batch.page_table[b, :-(-n // page_size)].long()) for b, (t, n) in enumerate(zip(tokens, lengths))]
