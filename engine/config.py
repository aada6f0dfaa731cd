"""Frozen configuration: the model's (read from config.json) and the engine's.

Importing this module loads no torch (the gateway reads ModelConfig and SHIPPED_MODEL):
torch is imported where a dtype is made, in `parse_dtype` and EngineConfig's default."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPES", "SHIPPED_MODEL", "EngineConfig", "ModelConfig", "parse_dtype"]


def _shipped_model() -> Path:
    """The checkpoint that ships with Tandem: models/tiny-moe in a checkout (also with no
    install, on PYTHONPATH=.), engine/tiny-moe/ in an installed wheel (setup.py puts it there)."""
    here = Path(__file__).resolve().parent
    checkout, installed = here.parent / "models" / "tiny-moe", here / "tiny-moe"
    return installed if not checkout.is_dir() and installed.is_dir() else checkout


SHIPPED_MODEL = _shipped_model()

# the dtype names accepted on command lines and in configs -> the torch attribute they name
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16",
          "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A dtype name (see DTYPES) or a torch.dtype as a torch.dtype; ValueError names the choices."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    dtype: torch.dtype = getattr(torch, DTYPES[name])
    return dtype


def _float32() -> torch.dtype:
    return parse_dtype("float32")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture, as the checkpoint's config.json states it."""
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = field(default=())
    first_k_dense_replace: int = 0            # GLM-4.5 / DeepSeek-V3: the first k layers are dense
    num_shared_experts: int = 0               # always-resident experts beside the routed ones
    shared_expert_intermediate_size: int = 0  # all shared experts together
    # the whole config.json: each family module reads its own specifics (routing, latent
    # attention, windows, sinks) from it
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"1..num_experts={self.num_experts}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    def is_moe_layer(self, layer: int) -> bool:
        """Sparse unless among the first `first_k_dense_replace` layers, listed in
        mlp_only_layers, or off the sparse step (the Qwen rule; the others leave it at 1)."""
        return (self.num_experts > 0 and layer >= self.first_k_dense_replace
                and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3): a KV page holds one compressed row per token."""
        return bool(self.raw.get("kv_lora_rank"))

    @property
    def kv_geometry(self) -> tuple[int, int, int]:
        """What one token of one layer stores in a KV page: (components, heads, dim).
        GQA: K and V of every KV head; MLA: one row [latent | decoupled rope key]."""
        if self.is_mla:
            return 1, 1, int(self.raw["kv_lora_rank"]) + int(self.raw["qk_rope_head_dim"])
        return 2, self.num_key_value_heads, self.head_dim

    def kv_bytes_per_token(self, element_size: int) -> int:
        """KV-cache bytes one token takes over all layers, at `element_size` bytes per value."""
        c, h, d = self.kv_geometry
        return self.num_hidden_layers * c * h * d * element_size

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Read config.json in every family's spelling: the experts' count is `num_experts`
        (Qwen), `num_local_experts` (Mixtral, gpt-oss, transformers 5) or `n_routed_experts`
        (GLM-4.5, DeepSeek-V3); Mixtral and gpt-oss give their experts' width as
        `intermediate_size`; rope_theta sits in `rope_parameters` (transformers 5),
        `rope_scaling` or at the top."""
        arch = (raw.get("architectures") or [raw.get("model_type", "unknown")])[0]
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        num_experts = raw.get("num_experts", raw.get("num_local_experts", raw.get("n_routed_experts", 0))) or 0
        expert_width = raw.get("moe_intermediate_size") or (raw.get("intermediate_size", 0) if num_experts else 0)
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        shared = raw.get("n_shared_experts") or 0
        shared_width = raw.get("shared_expert_intermediate_size") or shared * expert_width
        return cls(
            architecture=arch, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
            # latent attention has no KV heads (DeepseekV3Config writes its default of 128 anyway)
            num_key_value_heads=heads if raw.get("kv_lora_rank") else raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            intermediate_size=raw.get("intermediate_size", 0),
            moe_intermediate_size=expert_width,
            num_experts=num_experts, num_experts_per_tok=raw.get("num_experts_per_tok", 0),
            norm_topk_prob=raw.get("norm_topk_prob", False),
            decoder_sparse_step=raw.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=float(rope_theta),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False), eos_token_ids=eos,
            first_k_dense_replace=raw.get("first_k_dense_replace") or 0,
            num_shared_experts=1 if raw.get("shared_expert_intermediate_size") else shared,
            shared_expert_intermediate_size=shared_width, raw=dict(raw))

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelConfig":
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"no config.json in {path}: not a HF checkpoint directory")
        raw = json.loads(file.read_text())
        gen = Path(path) / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            if eos is not None:
                raw = {**raw, "eos_token_id": eos}
        return cls.from_dict(raw)


COMPILE_ENV = "TANDEM_COMPILE"   # "0" makes eager the default (the test suite sets it)


def compile_default() -> bool:
    """Whether decode steps compile unless a config says otherwise: yes, unless the environment
    sets TANDEM_COMPILE to 0 (or false, no, off).  Raises ValueError for another value."""
    value = os.environ.get(COMPILE_ENV, "1").strip().lower()
    if value in ("1", "true", "yes", "on", ""):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{COMPILE_ENV}={os.environ[COMPILE_ENV]!r}: expected 1 (compiled decode steps, the "
                     f"default) or 0 (eager)")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: device, dtype, KV pool and batch limits."""
    model: str
    dtype: torch.dtype = field(default_factory=_float32)
    device: str = "cpu"
    page_size: int = 16
    kv_cache_tokens: int = 16384
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_prefill_tokens: int = 2048
    seed: int = 0
    paged_experts_num_resident: int | None = None  # K resident experts per MoE layer; None: all
    paged_experts_prefetch: bool | None = None       # None: on with CUDA, off elsewhere
    enable_prefix_cache: bool = True                 # share full KV pages between requests
    kv_audit: bool = False                           # hash cached pages (check_integrity(contents=True))
    # decode steps run as compiled graphs, one per batch bucket (engine/compiled); off: eager
    compile: bool = field(default_factory=compile_default)
    compile_buckets: tuple[int, ...] | None = None   # None: 1, 2, 4, ... up to max_num_seqs
    # a constraint not seen before is checked in a child process within this many seconds
    # (engine/grammar_check.py; workers); None: compiled in-process without a budget (engine.LLM)
    grammar_check_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size} must be a positive power of two")
        if self.kv_cache_tokens < self.page_size:
            raise ValueError(f"kv_cache_tokens={self.kv_cache_tokens} is below one page "
                             f"({self.page_size} tokens)")
        if self.max_num_seqs < 1 or self.max_prefill_tokens < 1:
            raise ValueError("max_num_seqs and max_prefill_tokens must be at least 1")
        if self.grammar_check_timeout_s is not None and not 0 < self.grammar_check_timeout_s < float("inf"):
            raise ValueError(f"grammar_check_timeout_s={self.grammar_check_timeout_s} must be > 0 and finite")
        if self.compile_buckets is not None:
            from engine.compiled.buckets import decode_buckets
            decode_buckets(self.max_num_seqs, self.compile_buckets)  # raises ValueError naming the limit

    @property
    def num_pages(self) -> int:
        return self.kv_cache_tokens // self.page_size
