"""gpt-oss's experts (biases and the clamped SwiGLU) through the shared expert machinery:
every CPU path against a direct per-expert reference on the checkpoint's own fused layout and
against transformers' GptOssExperts; paged experts bit-identical to all-resident; the
start-up check covering the biases.  (MXFP4 checkpoints: tests/test_quant_experts.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine.moe as moe
from engine.config import ModelConfig
from engine.experts import ExpertSlots, ExpertStore, PagedExperts
from engine.experts.check import ExpertCheckError, check_independence, fingerprint, verify_resident
from engine.kernels.fused_moe import ClampedSwiGLU, fused_moe_ref, gathered_all, moe_gathered, moe_padded
from engine.models import gpt_oss
from engine.moe import ResidentExperts, StepPlan, combine

E, H, INTER, TOP_K = 8, 32, 24, 2
ACT = ClampedSwiGLU(alpha=1.702, limit=0.8)  # a low limit, so both clamps bite on these inputs


def fused_layer(seed: int = 0) -> dict[str, torch.Tensor]:
    """One layer's experts as a gpt-oss checkpoint stores them (interleaved gate/up)."""
    g = torch.Generator().manual_seed(seed)
    return {"gate_up": 0.3 * torch.randn(E, H, 2 * INTER, generator=g),
            "gate_up_bias": 0.5 * torch.randn(E, 2 * INTER, generator=g),
            "down": 0.3 * torch.randn(E, INTER, H, generator=g),
            "down_bias": 0.5 * torch.randn(E, H, generator=g)}


def stacked(layer: dict[str, torch.Tensor], prints: bool = True):
    return gpt_oss.stack_fused_experts(layer["gate_up"], layer["gate_up_bias"], layer["down"],
                                       layer["down_bias"], prints)


def direct(x: torch.Tensor, ids: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' per-expert formula on the fused layout, one pair at a time: [T, k, H]."""
    out = torch.empty(*ids.shape, H)
    for t in range(ids.shape[0]):
        for r in range(ids.shape[1]):
            e = int(ids[t, r])
            gu = x[t] @ layer["gate_up"][e] + layer["gate_up_bias"][e]
            gate, up = gu[::2].clamp(max=ACT.limit), gu[1::2].clamp(-ACT.limit, ACT.limit)
            out[t, r] = ((up + 1) * (gate * torch.sigmoid(gate * ACT.alpha))) @ layer["down"][e] \
                + layer["down_bias"][e]
    return out


def step(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(tokens)])
    return x, ids


def test_the_activation_clamps_as_transformers_does() -> None:
    gate = torch.tensor([-2.0, 0.1, 0.5, 3.0])
    up = torch.tensor([-3.0, 0.2, 0.9, 5.0])
    from engine.kernels.fused_moe import glu
    got = glu(gate, up, ClampedSwiGLU(1.702, 0.8))
    g, u = torch.tensor([-2.0, 0.1, 0.5, 0.8]), torch.tensor([-0.8, 0.2, 0.8, 0.8])
    assert torch.equal(got, (u + 1) * (g * torch.sigmoid(g * 1.702)))
    assert torch.equal(glu(gate, up), F.silu(gate) * up)  # no activation given: silu, unchanged


@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_every_cpu_path_matches_the_direct_reference(tokens: int) -> None:
    layer = fused_layer()
    w13, w2, b13, b2, _ = stacked(layer, prints=False)
    x, ids = step(tokens, seed=tokens)
    want = direct(x, ids, layer).view(tokens * TOP_K, H)
    extra = dict(b13=b13, b2=b2, act=ACT)
    cap = int(torch.bincount(ids.reshape(-1), minlength=E).max())
    outs = {"ref": fused_moe_ref(x, w13, w2, ids, torch.empty(tokens * TOP_K, H), **extra),
            "gathered_all": gathered_all(x, w13, w2, ids, **extra),
            "gathered": moe_gathered(x, w13, w2, ids, torch.empty(tokens * TOP_K, H), **extra),
            "padded": moe_padded(x, w13, w2, ids, torch.empty(tokens * TOP_K, H), cap, **extra)}
    for name, got in outs.items():
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=name)
    # the biases and the clamps matter on these inputs
    plain = fused_moe_ref(x, w13, w2, ids, torch.empty(tokens * TOP_K, H))
    assert (plain - want).abs().max() > 0.1


def test_skipped_pairs_are_left_untouched_with_biases() -> None:
    layer = fused_layer(1)
    w13, w2, b13, b2, _ = stacked(layer, prints=False)
    x, ids = step(6, seed=3)
    ids[::2, 1] = -1
    cap = int(torch.bincount(ids[ids >= 0], minlength=E).max())
    for fn in (lambda o: fused_moe_ref(x, w13, w2, ids, o, b13=b13, b2=b2, act=ACT),
               lambda o: moe_gathered(x, w13, w2, ids, o, b13=b13, b2=b2, act=ACT),
               lambda o: moe_padded(x, w13, w2, ids, o, cap, b13=b13, b2=b2, act=ACT)):
        out = fn(torch.full((12, H), 7.0))
        skipped = ids.reshape(-1) < 0
        assert bool((out[skipped] == 7.0).all())
        torch.testing.assert_close(out[~skipped], direct(x, ids.clamp(min=0), layer).view(12, H)[~skipped],
                                   atol=2e-5, rtol=2e-5)


def test_resident_experts_match_transformers_gpt_oss_experts() -> None:
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    cfg = GptOssConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=TOP_K,
                       swiglu_alpha=ACT.alpha, swiglu_limit=ACT.limit)
    hf = GptOssExperts(cfg)
    layer = fused_layer(2)
    with torch.no_grad():
        hf.gate_up_proj.copy_(layer["gate_up"])
        hf.gate_up_proj_bias.copy_(layer["gate_up_bias"])
        hf.down_proj.copy_(layer["down"])
        hf.down_proj_bias.copy_(layer["down_bias"])
    w13, w2, b13, b2, _ = stacked(layer, prints=False)
    experts = ResidentExperts(w13, w2, b13=b13, b2=b2, act=ACT)
    x, ids = step(9, seed=5)
    weights = torch.softmax(torch.randn(9, TOP_K, generator=torch.Generator().manual_seed(1)), -1)
    with torch.no_grad():
        want = hf(x, ids, weights)
    torch.testing.assert_close(combine(experts(x, ids), weights), want, atol=2e-5, rtol=2e-5)


def biased_store(seed: int = 0) -> tuple[ExpertStore, dict[str, torch.Tensor]]:
    layer = fused_layer(seed)
    w13, w2, b13, b2, prints = stacked(layer)
    return ExpertStore(w13, w2, prints, b13=b13, b2=b2, act=ACT), layer


def test_fingerprints_are_the_stacked_bytes_and_cover_the_biases() -> None:
    store, _ = biased_store()
    for e in range(E):
        assert fingerprint(*store.expert(e)) == store.fingerprints[e]
    assert len(store.expert(0)) == 4
    cfg = ModelConfig.from_dict({"architectures": ["GptOssForCausalLM"], "vocab_size": 16, "hidden_size": H,
                                 "intermediate_size": INTER, "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": E,
                                 "num_experts_per_tok": TOP_K})
    assert store.bytes_per_expert == gpt_oss.expert_bytes(cfg, 4) == 4 * (3 * H * INTER + 2 * INTER + H)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strategy", ["gathered", "padded", "grouped"])
@pytest.mark.parametrize("k", [TOP_K, E // 2, E])
def test_paged_experts_bit_identical_to_all_resident(k: int, strategy: str, dtype: torch.dtype, monkeypatch) -> None:
    monkeypatch.setattr(moe, "choose_strategy", lambda *a: strategy)
    monkeypatch.setattr(moe, "GATHER_MAX_PAIRS", 8 if strategy == "gathered" else 0)
    full, _ = biased_store(3)
    store = ExpertStore(*(t.to(dtype) for t in (full.w13, full.w2)), full.fingerprints,
                        b13=full.b13.to(dtype), b2=full.b2.to(dtype), act=ACT)
    resident = ResidentExperts(store.w13, store.w2, b13=store.b13, b2=store.b2, act=store.act)
    paged = PagedExperts(ExpertSlots(store, k, "cpu"))
    sizes = [1, 4, 3, 1, 2] if strategy == "gathered" else [1, 5, 12, 3, 20, 2]
    for i, tokens in enumerate(sizes):
        x, ids = step(tokens, seed=100 + i)
        x = x.to(dtype)
        assert StepPlan.for_step(ids, E).strategy == strategy
        assert torch.equal(paged(x, ids), resident(x, ids)), f"step {i}: {tokens} tokens, K={k}"
    if k < E:
        assert paged.counters.misses > 0
    assert paged.counters.bytes_paged % store.bytes_per_expert == 0


def test_slots_page_the_biases_with_the_weights() -> None:
    store, _ = biased_store(4)
    slots = ExpertSlots(store, 3, "cpu")
    assert slots.b13 is not None and slots.b2 is not None
    slots.load([(6, 1)])
    assert torch.equal(slots.b13[1], store.b13[6]) and torch.equal(slots.b2[1], store.b2[6])
    check_independence(slots, layer=0)
    slots.b2[1, 0] += 1.0          # a flipped bias in a resident slot
    with pytest.raises(ExpertCheckError, match="slot 1"):
        verify_resident(slots, layer=0)
    assert slots.verify([1]) == [1] and torch.equal(slots.b2[1], store.b2[6])  # repaired from the host


def test_independence_check_catches_swapped_biases() -> None:
    store, _ = biased_store(5)
    b2 = store.b2.clone()
    b2[[2, 5]] = b2[[5, 2]]   # a stacking bug that swaps two experts' down biases only
    bad = ExpertStore(store.w13, store.w2, store.fingerprints, b13=store.b13, b2=b2, act=ACT)
    with pytest.raises(ExpertCheckError, match="expert 2"):
        check_independence(ExpertSlots(bad, 4, "cpu"), layer=3)


def test_store_refuses_half_or_misshapen_biases() -> None:
    store, _ = biased_store()
    with pytest.raises(ValueError, match="pairs"):
        ExpertStore(store.w13, store.w2, b13=store.b13)
    with pytest.raises(ValueError, match="do not fit"):
        ExpertStore(store.w13, store.w2, b13=store.b13[:, :-1], b2=store.b2)


def _raw(**over) -> dict:
    raw = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 64,
           "hidden_size": H, "intermediate_size": INTER, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": E, "num_experts_per_tok": TOP_K,
           "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}
    raw.update(over)
    return raw


def test_layer_windows_follow_layer_types() -> None:
    cfg = ModelConfig.from_dict(_raw(num_hidden_layers=4, layer_types=None, sliding_window=16))
    assert gpt_oss._layer_windows(cfg) == [16, None, 16, None]  # transformers' default alternation
    with pytest.raises(ValueError, match="layer_type 'chunked'"):
        gpt_oss._layer_windows(ModelConfig.from_dict(_raw(layer_types=["chunked", "full_attention"])))
