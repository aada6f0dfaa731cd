"""Tiny random checkpoints of every model family the registry serves, written by transformers
itself (`save_pretrained` of a small config), with the shipped tokenizer beside them (the tiny
checkpoints carry none of their own)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import transformers

from engine.config import SHIPPED_MODEL

COMMON: dict[str, Any] = dict(vocab_size=4096, hidden_size=64, num_attention_heads=4, rms_norm_eps=1e-6,
                              max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=2,
                              bos_token_id=1, pad_token_id=0)

# family -> (transformers config class, its small settings)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", dict(
        num_hidden_layers=2, num_key_value_heads=2, intermediate_size=32, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=24)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        num_hidden_layers=3, num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        mlp_only_layers=[1], use_sliding_window=True, sliding_window=8, max_window_layers=2)),
    "glm4_moe": ("Glm4MoeConfig", dict(
        num_hidden_layers=3, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.5,
        norm_topk_prob=True, use_qk_norm=True, partial_rotary_factor=0.5, attention_bias=True)),
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=48,
        kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0})),
    "gpt_oss": ("GptOssConfig", dict(
        num_hidden_layers=2, num_key_value_heads=2, head_dim=16, intermediate_size=32,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=131072)),  # its YaRN: factor 32 over 4,096 positions
}


def hf_config(family: str) -> Any:
    cls, settings = FAMILIES[family]
    return getattr(transformers, cls)(**{**COMMON, **settings})


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights with enough spread that routing and attention are far from uniform (transformers'
    initialiser gives near-uniform logits, where greedy choices hang on rounding): matrices
    N(0, 0.08); norms near one; biases, sinks and routing corrections N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        if not p.is_floating_point() or "inv_freq" in name or "original_inv_freq" in name:
            continue
        noise = torch.randn(p.shape, generator=gen)
        if p.dim() >= 2:
            p.copy_(0.08 * noise)
        elif "norm" in name:
            p.copy_(1.0 + 0.1 * noise)
        else:  # biases, sinks, e_score_correction_bias
            p.copy_(0.1 * noise)


def tiny_checkpoint(family: str, path: Path, seed: int = 0) -> Path:
    """`save_pretrained` of a randomised tiny model of `family` in fp32, plus the shipped tokenizer."""
    return write_checkpoint(hf_config(family), path, seed)


def write_checkpoint(config: Any, path: Path, seed: int = 0) -> Path:
    """`save_pretrained` of a randomised model of the transformers `config` in fp32, plus the
    shipped tokenizer."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomise(model, seed)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED_MODEL / name, path / name)
    return path


def hf_model(path: Path) -> Any:
    """The checkpoint as transformers runs it (fp32, eager attention: the reference)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
