"""Model registry: architecture name (config.json `architectures[0]`) -> its family module.

A family module provides:
    expected_tensors(cfg) -> {name: shape}   every tensor the checkpoint must hold
    ignorable(cfg, name) -> bool             tensors checkpoints carry that are not used
    is_routed_expert(name) -> bool           a routed expert's tensor (paged experts keep it on the host)
    expert_bytes(cfg, element_size) -> int   one routed expert's weights, all its tensors
    assemble(cfg, tensors, attention, make_experts, moe_triton) -> DecoderModel

Importing this module imports the family modules (and torch).
"""

from __future__ import annotations

from types import ModuleType

from engine.models import deepseek_v3, glm4_moe, gpt_oss, mixtral, qwen2_moe, qwen3_moe

REGISTRY: dict[str, ModuleType] = {
    "Qwen3MoeForCausalLM": qwen3_moe,
    "Qwen2MoeForCausalLM": qwen2_moe,
    "MixtralForCausalLM": mixtral,
    "Glm4MoeForCausalLM": glm4_moe,
    "DeepseekV3ForCausalLM": deepseek_v3,   # also Kimi-K2-shaped configs
    "GptOssForCausalLM": gpt_oss,
}


def spec_for(architecture: str) -> ModuleType:
    if architecture not in REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(REGISTRY)}")
    return REGISTRY[architecture]
