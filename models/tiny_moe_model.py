"""A compact, trainable Qwen3-MoE (the same math as transformers' Qwen3MoeForCausalLM).

Used only to train the shipped checkpoint; serving uses `engine/`.  Parameter names
follow the HF layout so that `state_dict_hf()` writes the on-disk names directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 256
    moe_intermediate_size: int = 64
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_experts: int = 64
    num_experts_per_tok: int = 4
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.q_norm = nn.Parameter(torch.ones(d))
        self.k_norm = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim)
        q = rope(rms_norm(q, self.q_norm, c.rms_norm_eps).transpose(1, 2), cos, sin)
        k = rope(rms_norm(k, self.k_norm, c.rms_norm_eps).transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class SparseMoe(nn.Module):
    """Top-k routed experts; tokens are sorted by expert and each expert runs once."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg = cfg
        self.gate = nn.Linear(h, e, bias=False)
        self.gate_proj = nn.Parameter(torch.randn(e, i, h) * 0.02)
        self.up_proj = nn.Parameter(torch.randn(e, i, h) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(e, h, i) * 0.02 / math.sqrt(2 * cfg.num_hidden_layers))
        self.last_topk: torch.Tensor | None = None
        self.aux_loss = torch.zeros(())
        self.locality_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, H]
        e, k = self.cfg.num_experts, self.cfg.num_experts_per_tok
        probs = F.softmax(self.gate(x).float(), dim=-1)  # [N, E]
        weights, idx = probs.topk(k, dim=-1)  # [N, k]
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        self.last_topk = idx.detach()
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=e).tolist()
        token_of = order // k
        xs = x.index_select(0, token_of)  # [N*k, H]
        outs = []
        for ex, chunk in enumerate(xs.split(counts)):
            if chunk.shape[0] == 0:
                continue
            act = F.silu(chunk @ self.gate_proj[ex].t()) * (chunk @ self.up_proj[ex].t())
            outs.append(act @ self.down_proj[ex].t())
        y = torch.cat(outs) * weights.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros_like(x).index_add(0, token_of, y)
        # Switch-style load-balancing loss: E * sum_e(fraction routed_e * mean prob_e).
        frac = torch.bincount(flat, minlength=e).float() / flat.numel()
        self.aux_loss = e * (frac * probs.mean(0)).sum()
        if self.training and len(shape) == 3:
            self.locality_loss = self._locality(probs.view(*shape[:2], e), idx.view(*shape[:2], k))
        return out.view(shape)

    @staticmethod
    def _locality(probs: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """-log of the router mass token t puts on the experts token t-1 used: rewards
        routing that changes slowly along a sequence.  probs: [B, T, E]; idx: [B, T, k]."""
        prev = torch.zeros_like(probs[:, 1:]).scatter_(-1, idx[:, :-1], 1.0)  # [B, T-1, E]
        mass = (probs[:, 1:] * prev).sum(-1)
        return -torch.log(mass + 1e-6).mean()


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.self_attn = Attention(cfg)
        self.mlp = SparseMoe(cfg)

    def forward(self, x, cos, sin):
        eps = self.cfg.rms_norm_eps
        x = x + self.self_attn(rms_norm(x, self.input_layernorm, eps), cos, sin)
        return x + self.mlp(rms_norm(x, self.post_attention_layernorm, eps))


class TinyMoe(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=0.02)

    def rope_tables(self, t: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.cfg.head_dim
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d))
        freqs = torch.outer(torch.arange(t, device=device).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope_tables(ids.shape[1], ids.device)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(rms_norm(x, self.norm, self.cfg.rms_norm_eps))

    def aux_loss(self) -> torch.Tensor:
        return sum(layer.mlp.aux_loss for layer in self.layers) / len(self.layers)

    def locality_loss(self) -> torch.Tensor:
        return sum(layer.mlp.locality_loss for layer in self.layers) / len(self.layers)

    @torch.no_grad()
    def load_hf(self, tensors: dict[str, torch.Tensor]) -> None:
        """The inverse of `state_dict_hf`: copy HF-named tensors into this model."""
        for li, layer in enumerate(self.layers):
            p = f"model.layers.{li}.mlp.experts."
            for e in range(self.cfg.num_experts):
                for name in ("gate_proj", "up_proj", "down_proj"):
                    getattr(layer.mlp, name)[e].copy_(tensors[p + f"{e}.{name}.weight"])
        for name, target in self.state_dict_hf().items():
            if ".mlp.experts." not in name:
                self._hf_param(name).copy_(tensors[name])

    def _hf_param(self, name: str) -> torch.Tensor:
        table = {"model.embed_tokens.weight": self.embed_tokens.weight, "model.norm.weight": self.norm,
                 "lm_head.weight": self.lm_head.weight}
        if name in table:
            return table[name]
        _, _, li, rest = name.split(".", 3)
        layer = self.layers[int(li)]
        rest = rest.removesuffix(".weight")
        if rest in ("input_layernorm", "post_attention_layernorm"):
            return getattr(layer, rest)
        if rest in ("self_attn.q_norm", "self_attn.k_norm"):
            return getattr(layer.self_attn, rest.split(".")[1])
        if rest == "mlp.gate":
            return layer.mlp.gate.weight
        return getattr(layer.self_attn, rest.split(".")[1]).weight

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """Tensors under the HF Qwen3-MoE names, one tensor per expert projection."""
        out = {"model.embed_tokens.weight": self.embed_tokens.weight,
               "model.norm.weight": self.norm}
        if not self.cfg.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head.weight
        for li, layer in enumerate(self.layers):
            p = f"model.layers.{li}."
            out[p + "input_layernorm.weight"] = layer.input_layernorm
            out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[p + f"self_attn.{name}.weight"] = getattr(layer.self_attn, name).weight
            out[p + "self_attn.q_norm.weight"] = layer.self_attn.q_norm
            out[p + "self_attn.k_norm.weight"] = layer.self_attn.k_norm
            out[p + "mlp.gate.weight"] = layer.mlp.gate.weight
            for e in range(self.cfg.num_experts):
                for name in ("gate_proj", "up_proj", "down_proj"):
                    out[p + f"mlp.experts.{e}.{name}.weight"] = getattr(layer.mlp, name)[e]
        return {k: v.detach().contiguous() for k, v in out.items()}
