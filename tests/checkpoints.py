"""Tiny checkpoints that tests generate: random weights in the HF layout."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from engine.checkpoint import save_checkpoint
from engine.config import SHIPPED_MODEL, ModelConfig
from engine.models.qwen3_moe import expected_tensors

# A shape unlike the shipped model's: GQA 4:1, tied embeddings, a dense layer
# (mlp_only_layers), and the transformers-5 spelling of the config keys.
RANDOM_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "vocab_size": 4096, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
    "num_local_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [1], "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 50000.0, "rope_type": "default"},
    "max_position_embeddings": 512, "tie_word_embeddings": True, "attention_bias": False,
    "eos_token_id": 2, "torch_dtype": "float32",
}


def random_tensors(raw_config: dict, seed: int = 0, std: float = 0.08) -> dict[str, torch.Tensor]:
    cfg = ModelConfig.from_dict(raw_config)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_tensors(cfg).items():
        if len(shape) == 1:  # norms: near one, so that they matter
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            out[name] = std * torch.randn(shape, generator=gen)
    return out


def write_random_checkpoint(path: Path, raw_config: dict = RANDOM_CONFIG, seed: int = 0,
                            max_shard_bytes: int | None = None) -> Path:
    save_checkpoint(path, random_tensors(raw_config, seed), raw_config, max_shard_bytes=max_shard_bytes)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED_MODEL / name, path / name)
    return path
