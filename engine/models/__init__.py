"""Model registry: architecture name (config.json `architectures[0]`) -> its family module.

A family module provides:
    expected_tensors(cfg) -> {name: shape}   every tensor the checkpoint must hold
    ignorable(cfg, name) -> bool             tensors checkpoints carry that are not used
    is_routed_expert(name) -> bool           a routed expert's tensor (paged experts keep it on the host)
    expert_bytes(cfg, element_size) -> int   one routed expert's weights, all its tensors
    assemble(cfg, tensors, attention, make_experts, moe_triton) -> DecoderModel
and optionally:
    keeps_fp32(name) -> bool                 tensors loaded in fp32 whatever the serving dtype
    kernel_variants(cfg) -> set of str       the attention/expert kernel variants it runs

Importing this module imports the family modules (and torch).
"""

from __future__ import annotations

from types import ModuleType

from engine.config import ModelConfig
from engine.models import deepseek_v3, glm4_moe, gpt_oss, mixtral, qwen2_moe, qwen3_moe

REGISTRY: dict[str, ModuleType] = {
    "Qwen3MoeForCausalLM": qwen3_moe,
    "Qwen2MoeForCausalLM": qwen2_moe,
    "MixtralForCausalLM": mixtral,
    "Glm4MoeForCausalLM": glm4_moe,
    "DeepseekV3ForCausalLM": deepseek_v3,   # also Kimi-K2-shaped configs
    "GptOssForCausalLM": gpt_oss,
}


def kernel_variants(cfg: ModelConfig) -> frozenset[str]:
    """The kernel variants the model runs ("window", "sinks", "latent", "clamped_swiglu"), from
    its family module's optional `kernel_variants(cfg)`: start-up compiles and checks only those."""
    declared = getattr(spec_for(cfg.architecture), "kernel_variants", None)
    return frozenset(declared(cfg)) if declared else frozenset()


def spec_for(architecture: str) -> ModuleType:
    if architecture not in REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(REGISTRY)}")
    return REGISTRY[architecture]
