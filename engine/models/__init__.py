"""Model registry: architecture name (config.json `architectures[0]`) -> its weight spec.

Adding a Mixtral- or DeepSeek-style model means one module with `expected_tensors`,
`ignorable` and `assemble`, and one line here.
"""

from __future__ import annotations

from types import ModuleType

from engine.models import qwen3_moe_weights

REGISTRY: dict[str, ModuleType] = {
    "Qwen3MoeForCausalLM": qwen3_moe_weights,
}


def spec_for(architecture: str) -> ModuleType:
    if architecture not in REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(REGISTRY)}")
    return REGISTRY[architecture]
