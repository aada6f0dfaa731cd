"""Paged KV attention against a contiguous-cache reference, on fragmented page tables
with garbage in every page that a request does not own."""

from collections import deque

import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.layers import rms_norm
from engine.models.decoder import DecoderModel


class ContiguousCache:
    """The same model, with K/V in one contiguous [L, T, Hkv, D] tensor per request."""

    def __init__(self, model: DecoderModel):
        self.m = model
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    @torch.inference_mode()
    def feed(self, ids: list[int]) -> torch.Tensor:
        """Append tokens; returns log-probabilities after the last one: [V]."""
        m, cfg = self.m, self.m.cfg
        start = self.k[0].shape[0] if self.k else 0
        pos = torch.arange(start, start + len(ids))
        x = m.embed[torch.tensor(ids)]
        for li, layer in enumerate(m.layers):
            h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            a = layer.attn
            qkv = F.linear(h, a.wqkv).view(len(ids), -1, cfg.head_dim)
            hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
            qk = rms_norm(qkv[:, :hq + hkv], a.qk_norm, cfg.rms_norm_eps)
            qk = a.rope.apply(qk, *a.rope.tables(pos, x.dtype))
            q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:]
            if len(self.k) <= li:
                self.k.append(k)
                self.v.append(v)
            else:
                self.k[li] = torch.cat([self.k[li], k])
                self.v[li] = torch.cat([self.v[li], v])
            total = self.k[li].shape[0]
            mask = torch.arange(total)[None, :] <= pos[:, None]  # [Q, T]
            att = F.scaled_dot_product_attention(q.transpose(0, 1), self.k[li].transpose(0, 1),
                                                 self.v[li].transpose(0, 1), attn_mask=mask,
                                                 scale=a.scale, enable_gqa=True)
            x = x + F.linear(att.transpose(0, 1).reshape(len(ids), -1), a.wo)
            h = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            x = x + layer.mlp(h)
        hidden = rms_norm(x[-1:], m.final_norm, cfg.rms_norm_eps)
        return torch.log_softmax(m.logits(hidden)[0], dim=-1)


def test_paged_matches_contiguous_on_fragmented_pages(random_ckpt):
    llm = LLM(random_ckpt, kv_cache_tokens=64 * 4, page_size=4)
    llm.pool.kv.uniform_(-50.0, 50.0)  # stale "other tenants'" data everywhere
    order = list(range(llm.pool.num_pages))
    torch.manual_seed(0)
    llm.pool._free = deque(order[i] for i in torch.randperm(len(order)).tolist())  # fragment
    prompts = [[11, 12, 13, 14, 15, 16, 17], [900, 5, 6], list(range(100, 130))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=4))
    for prompt, out in zip(prompts, outs):
        ref = ContiguousCache(llm.model)
        logp = ref.feed(prompt)
        for tok, lps in zip(out.token_ids, out.logprobs):
            assert int(logp.argmax()) == tok
            for tid, lp in lps.items():
                assert abs(lp - logp[tid].item()) < 1e-5
            logp = ref.feed([tok])
    llm.pool.check_integrity()
    assert llm.pool.num_free == llm.pool.num_pages
