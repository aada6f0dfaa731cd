"""How the Mixtral, Qwen2-MoE and GLM-4.5 modules read their configs, against transformers'
own reading of the same config.json: every spelling of the options (a published checkpoint's
top-level keys, transformers 5's rope_parameters, defaults when a key is absent) and, for each
option, the checkpoint transformers writes must be exactly the tensors the module expects.
Every family refuses a `hidden_act` it does not run."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import (
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
)

from engine.attention import TorchAttention
from engine.config import ModelConfig
from engine.loader import load_model
from engine.models import REGISTRY, glm4_moe, mixtral, qwen2_moe
from engine.models.decoder import MoeBlock
from engine.moe import GroupedSigmoidRouter
from tests.families import hf_config

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


def written(model: torch.nn.Module, path: Path) -> tuple[ModelConfig, dict[str, tuple[int, ...]]]:
    """Save with transformers; the config as the engine reads it and every tensor's shape."""
    model.save_pretrained(path)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    return ModelConfig.from_dict(json.loads((path / "config.json").read_text())), shapes


@pytest.mark.parametrize("raw", [
    {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_scaling": None},   # published GLM-4.5 spelling
    {"rope_theta": 1e6},                                                         # absent: transformers' 0.5
    {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default", "partial_rotary_factor": 0.75}},
    {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}},
], ids=["top-level", "absent", "rope_parameters", "rope_parameters-without"])
def test_glm_rotary_dims_as_transformers_reads_them(raw):
    raw = {**SMALL, "head_dim": 32, "architectures": ["Glm4MoeForCausalLM"], "n_routed_experts": 4,
           "num_experts_per_tok": 2, **raw}
    want = int(32 * Glm4MoeConfig(**raw).rope_parameters["partial_rotary_factor"])
    assert glm4_moe.rotary_dim(ModelConfig.from_dict(raw)) == want


@pytest.mark.parametrize("raw", [
    {"use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21},  # Qwen1.5-MoE-A2.7B
    {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 3},
    {"use_sliding_window": True, "sliding_window": 64},                                # max_window_layers absent
    {"use_sliding_window": True, "sliding_window": 64,
     "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]},
], ids=["off", "below-max-window-layers", "default-max", "layer-types"])
def test_qwen2_moe_windows_as_transformers_assigns_them(raw):
    raw = {**SMALL, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2, **raw}
    ref = Qwen2MoeConfig(**raw)
    want = [ref.sliding_window if kind == "sliding_attention" else None for kind in ref.layer_types]
    assert qwen2_moe.layer_windows(ModelConfig.from_dict(raw)) == want


@pytest.mark.parametrize("window", [None, 4096])
def test_mixtral_window(window):
    raw = {**SMALL, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2,
           "sliding_window": window}
    assert mixtral.sliding_window(ModelConfig.from_dict(raw)) == MixtralConfig(**raw).sliding_window


CHECKPOINTS = {  # name -> (model class, config): each option away from the parity tests' tiny configs
    "mixtral": (MixtralForCausalLM, MixtralConfig(**SMALL, intermediate_size=16, num_local_experts=4,
                                                  num_experts_per_tok=2, tie_word_embeddings=True)),
    "qwen2_moe-no-bias-sparse-step": (Qwen2MoeForCausalLM, Qwen2MoeConfig(
        **SMALL, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        num_experts=4, num_experts_per_tok=2, qkv_bias=False, decoder_sparse_step=2, mlp_only_layers=[3])),
    "glm4_moe-plain": (Glm4MoeForCausalLM, Glm4MoeConfig(
        **SMALL, head_dim=16, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, first_k_dense_replace=2, n_shared_experts=2, attention_bias=False,
        use_qk_norm=False)),
    "glm4_moe-bias-norm": (Glm4MoeForCausalLM, Glm4MoeConfig(
        **SMALL, head_dim=16, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, first_k_dense_replace=0, attention_bias=True, use_qk_norm=True)),
}
MODULES = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "glm4_moe": glm4_moe}


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_expected_tensors_are_what_transformers_writes(name, tmp_path):
    cls, hf_cfg = CHECKPOINTS[name]
    cfg, shapes = written(cls(hf_cfg), tmp_path)
    module = MODULES[name.split("-")[0]]
    expected = module.expected_tensors(cfg)
    assert {n: s for n, s in shapes.items() if not module.ignorable(cfg, n)} == expected
    routed = {n for n in expected if module.is_routed_expert(n)}
    assert len(routed) == 3 * cfg.num_experts * len(cfg.moe_layers)
    assert all(".experts." in n and "shared" not in n for n in routed)
    assert module.expert_bytes(cfg, 2) * cfg.num_experts * len(cfg.moe_layers) == 2 * sum(
        torch.Size(expected[n]).numel() for n in routed)


def test_glm_router_stays_fp32_in_a_bf16_model(tmp_path):
    """transformers keeps the grouped router in fp32 whatever the dtype; so does the loader
    (`glm4_moe.keeps_fp32`): a bf16 serve routes with the checkpoint's exact bias and weight."""
    cls, hf_cfg = CHECKPOINTS["glm4_moe-bias-norm"]
    model = cls(hf_cfg)
    gate = model.model.layers[0].mlp.gate
    with torch.no_grad():
        gate.e_score_correction_bias.copy_(1 + 1e-3 * torch.randn(4, generator=torch.Generator().manual_seed(0)))
    cfg, _ = written(model, tmp_path)
    loaded = load_model(tmp_path, cfg, torch.bfloat16, "cpu", TorchAttention(16))
    block = loaded.layers[0].mlp
    assert isinstance(block, MoeBlock) and isinstance(block.router, GroupedSigmoidRouter)
    assert torch.equal(block.router.bias, gate.e_score_correction_bias)  # not rounded to bf16
    assert torch.equal(block.router.weight, gate.weight.detach())
    assert block.shared is not None and block.shared.w13.dtype == torch.bfloat16


def family_raw(architecture: str) -> dict[str, object]:
    """A small config.json of the family, as transformers writes it."""
    family = REGISTRY[architecture].__name__.rsplit(".", 1)[-1]
    hf = (Qwen3MoeConfig(**SMALL, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                         num_experts_per_tok=2) if family == "qwen3_moe" else hf_config(family))
    return {**hf.to_dict(), "architectures": [architecture]}


SILU_GATED = sorted(a for a in REGISTRY if a != "GptOssForCausalLM")   # gpt-oss: its clamped SwiGLU


@pytest.mark.parametrize("architecture", SILU_GATED)
def test_a_hidden_act_the_engine_does_not_run_is_refused_by_name(architecture):
    """transformers runs `hidden_act` in every expert and dense MLP of these families; the
    engine runs SiLU, so anything else is refused before a tensor is read (expected_tensors)."""
    cfg = ModelConfig.from_dict({**family_raw(architecture), "hidden_act": "gelu"})
    with pytest.raises(ValueError, match=r"hidden_act='gelu' is not supported.*supported: 'silu', 'swish'"):
        REGISTRY[architecture].expected_tensors(cfg)


@pytest.mark.parametrize("architecture", sorted(REGISTRY))
def test_silu_spellings_and_gpt_oss_any_hidden_act_load(architecture):
    """"silu", "swish" (transformers' ACT2FN: the same torch silu) and an absent hidden_act
    (transformers' default, silu) expect the same tensors; gpt-oss's transformers ignores
    hidden_act (its experts run the clamped SwiGLU), so its module accepts any."""
    module, raw = REGISTRY[architecture], family_raw(architecture)
    want = module.expected_tensors(ModelConfig.from_dict(raw))
    acts = ["silu", "swish"] + (["gelu"] if architecture == "GptOssForCausalLM" else [])
    configs = [{**raw, "hidden_act": act} for act in acts] + [{k: v for k, v in raw.items() if k != "hidden_act"}]
    for c in configs:
        assert module.expected_tensors(ModelConfig.from_dict(c)) == want
