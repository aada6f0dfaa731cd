"""The routers and the shared-expert combination against transformers' own modules, on
random inputs: GLM-4.5 / DeepSeek-V3's grouped sigmoid router (group-limited choice, the
correction bias steering the choice but not the weights, renormalisation and
routed_scaling_factor) and the MoE blocks with a shared expert (Qwen2-MoE's sigmoid-gated
one, GLM-4.5's ungated ones)."""

import pytest
import torch
from transformers import Glm4MoeConfig, Qwen2MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE, Glm4MoeTopkRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

from engine.models.decoder import DenseMlp, MoeBlock
from engine.moe import GroupedSigmoidRouter, ResidentExperts, SoftmaxRouter

H = 32


def glm_config(e: int, k: int, n_group: int, topk_group: int, norm: bool, scale: float) -> Glm4MoeConfig:
    return Glm4MoeConfig(vocab_size=64, hidden_size=H, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         n_routed_experts=e, num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
                         norm_topk_prob=norm, routed_scaling_factor=scale, n_shared_experts=2)


def randomise(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * 0.3)


def shared_mlp(mlp: torch.nn.Module) -> DenseMlp:
    """transformers' shared expert (gate_proj, up_proj, down_proj) as the engine's DenseMlp."""
    return DenseMlp(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(), mlp.down_proj.weight.detach())


def hf_router(cfg: Glm4MoeConfig, seed: int) -> Glm4MoeTopkRouter:
    router = Glm4MoeTopkRouter(cfg).eval()
    randomise(router, seed)
    return router


def ours(router: Glm4MoeTopkRouter, cfg: Glm4MoeConfig) -> GroupedSigmoidRouter:
    return GroupedSigmoidRouter(router.weight.detach().clone(), router.e_score_correction_bias.clone(),
                                cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                                cfg.routed_scaling_factor)


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's choices ordered by expert id (both routers choose sets; order is free)."""
    ids, order = ids.sort(dim=-1)
    return weights.float().gather(1, order), ids


def inputs(t: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(t, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


CASES = [  # (experts, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    (16, 4, 4, 2, True, 2.5),     # DeepSeek-V3's shape, scaled down
    (8, 2, 2, 1, True, 1.0),      # GLM-4.5's tiny test shape: two groups, one kept
    (16, 6, 8, 3, False, 1.5),    # no renormalisation
    (16, 4, 1, 1, True, 1.0),     # GLM-4.5's real routing: one group (no group limit)
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "e{}k{}g{}of{}-norm{}-x{}".format(*c))
def test_grouped_sigmoid_router_matches_transformers(case):
    cfg = glm_config(*case)
    ref = hf_router(cfg, seed=1)
    x = inputs(97, seed=2)
    with torch.no_grad():
        _, want_w, want_ids = ref(x)
    got_w, got_ids = ours(ref, cfg)(x)
    assert got_ids.dtype == torch.int64 and got_w.dtype == x.dtype and got_w.shape == (97, cfg.num_experts_per_tok)
    got_w, got_ids = by_expert(got_w, got_ids)
    want_w, want_ids = by_expert(want_w, want_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-6)


def test_choice_is_limited_to_the_best_groups():
    cfg = glm_config(16, 4, 4, 2, True, 1.0)
    ref = hf_router(cfg, seed=3)
    router = ours(ref, cfg)
    x = inputs(200, seed=4)
    _, ids = router(x)
    groups = ids // (16 // 4)  # [T, k]: the group of each choice
    assert all(len(set(row)) <= 2 for row in groups.tolist())
    # The groups kept are the two whose two best biased scores sum highest.
    scores = torch.sigmoid(x @ ref.weight.detach().t()) + ref.e_score_correction_bias
    best = scores.view(-1, 4, 4).topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices  # [T, 2]
    for row, kept in zip(groups.tolist(), best.tolist()):
        assert set(row) <= set(kept)
    # The limit matters on these inputs: a plain top-4 over all experts picks other experts.
    plain = scores.topk(4, dim=-1).indices.sort(-1).values
    assert not torch.equal(plain, ids.sort(-1).values)


def test_correction_bias_steers_the_choice_but_not_the_weights():
    cfg = glm_config(8, 2, 2, 1, False, 1.0)
    ref = hf_router(cfg, seed=5)
    x = inputs(50, seed=6)
    with torch.no_grad():
        ref.e_score_correction_bias.zero_()
        ref.e_score_correction_bias[5] = 10.0  # expert 5 wins every token's choice
    biased = ours(ref, cfg)
    w, ids = biased(x)
    assert (ids == 5).any(dim=-1).all()
    # Weights are the plain sigmoid scores of the chosen experts: the bias is not in them.
    scores = torch.sigmoid(x @ ref.weight.detach().t())
    torch.testing.assert_close(w, scores.gather(1, ids), rtol=0, atol=1e-6)
    assert (w < 1).all()
    _, plain_ids = GroupedSigmoidRouter(ref.weight.detach().clone(), torch.zeros(8), 2, 2, 1, False, 1.0)(x)
    assert not (plain_ids == 5).any(dim=-1).all()


@pytest.mark.parametrize("norm", [True, False])
def test_routed_scaling_factor_scales_the_weights(norm):
    cfg = glm_config(16, 4, 4, 2, norm, 2.5)
    ref = hf_router(cfg, seed=7)
    x = inputs(40, seed=8)
    w, ids = ours(ref, cfg)(x)
    if norm:
        torch.testing.assert_close(w.sum(-1), torch.full((40,), 2.5), rtol=0, atol=1e-5)
    else:
        scores = torch.sigmoid(x @ ref.weight.detach().t())
        torch.testing.assert_close(w, 2.5 * scores.gather(1, ids), rtol=0, atol=1e-6)


def test_grouped_router_on_bf16_activations_routes_in_fp32():
    """The router's weight and bias stay fp32 (transformers keeps them so); bf16 hidden
    states are routed in fp32 and the weights come back in bf16."""
    cfg = glm_config(16, 4, 4, 2, True, 2.5)
    ref = hf_router(cfg, seed=9)
    x = inputs(64, seed=10, dtype=torch.bfloat16)
    with torch.no_grad():
        _, want_w, want_ids = ref(x)
    got_w, got_ids = ours(ref, cfg)(x)
    assert got_w.dtype == torch.bfloat16
    got_w, got_ids = by_expert(got_w, got_ids)
    want_w, want_ids = by_expert(want_w, want_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_qwen2_moe_block_with_a_gated_shared_expert_matches_transformers():
    cfg = Qwen2MoeConfig(vocab_size=64, hidden_size=H, intermediate_size=48, moe_intermediate_size=16,
                         shared_expert_intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)
    ref = Qwen2MoeSparseMoeBlock(cfg).eval()
    randomise(ref, seed=11)
    sh = ref.shared_expert
    block = MoeBlock(SoftmaxRouter(ref.gate.weight.detach(), 2, False),
                     ResidentExperts(ref.experts.gate_up_proj.detach(), ref.experts.down_proj.detach()),
                     shared_mlp(sh),
                     ref.shared_expert_gate.weight.detach())
    x = inputs(37, seed=12)
    with torch.no_grad():
        want = ref(x[None])[0]
    torch.testing.assert_close(block(x), want, rtol=0, atol=1e-5)
    # The gate is per token: sigmoid(h . g) scales the shared expert's output, nothing else.
    routed = MoeBlock(block.router, block.experts, None, None)(x)
    gate = torch.sigmoid(x @ ref.shared_expert_gate.weight.detach().t())  # [T, 1]
    torch.testing.assert_close(block(x) - routed, gate * block.shared(x), rtol=0, atol=1e-5)


def test_glm4_moe_block_with_shared_experts_matches_transformers():
    cfg = glm_config(8, 2, 2, 1, True, 1.8)
    ref = Glm4MoeMoE(cfg).eval()
    randomise(ref, seed=13)
    sh = ref.shared_experts
    assert sh.gate_proj.weight.shape[0] == 2 * 16  # n_shared_experts * moe_intermediate_size
    block = MoeBlock(ours(ref.gate, cfg),
                     ResidentExperts(ref.experts.gate_up_proj.detach(), ref.experts.down_proj.detach()),
                     shared_mlp(sh),
                     None)
    x = inputs(41, seed=14)
    with torch.no_grad():
        want = ref(x[None])[0]
    torch.testing.assert_close(block(x), want, rtol=0, atol=1e-5)
