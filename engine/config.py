"""Frozen configuration: the model's (read from config.json) and the engine's.

Importing this module loads no torch (the gateway reads ModelConfig and SHIPPED_MODEL):
torch is imported where a dtype is made, in `parse_dtype` (EngineConfig.torch_dtype)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.compiled.buckets import decode_buckets, parse_buckets
from engine.env import COMPILE, compile_default
from engine.options import option

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPES", "DTYPE_NAMES", "MAX_NUM_SEQS", "SHIPPED_MODEL", "EngineConfig", "ModelConfig",
           "check_compile_buckets", "compile_default", "dtype_name", "parse_compile_buckets", "parse_dtype"]


def _shipped_model() -> Path:
    """The checkpoint that ships with Tandem: models/tiny-moe in a checkout (also with no
    install, on PYTHONPATH=.), engine/tiny-moe/ in an installed wheel (setup.py puts it there)."""
    here = Path(__file__).resolve().parent
    checkout, installed = here.parent / "models" / "tiny-moe", here / "tiny-moe"
    return installed if not checkout.is_dir() and installed.is_dir() else checkout


SHIPPED_MODEL = _shipped_model()

# the dtype names accepted in configs -> the torch attribute they name; the command lines offer the
# canonical ones (DTYPE_NAMES)
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16",
          "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}
DTYPE_NAMES = tuple(dict.fromkeys(DTYPES.values()))


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A dtype name (see DTYPES) or a torch.dtype as a torch.dtype; ValueError names the choices."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    dtype: torch.dtype = getattr(torch, DTYPES[name])
    return dtype


def dtype_name(dtype: str | torch.dtype) -> str:
    """The canonical name (a value of DTYPES) of a dtype name or torch.dtype: "bf16" and
    torch.bfloat16 are "bfloat16".  Raises ValueError naming the choices."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


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


# requests one batch holds: the largest compile bucket, and the limit each bucket is checked against
MAX_NUM_SEQS = 64


def check_compile_buckets(sizes: Sequence[int], max_num_seqs: int = MAX_NUM_SEQS) -> tuple[int, ...]:
    """The compile buckets `sizes` sorted and deduplicated.  Raises ValueError naming a size
    outside 1..max_num_seqs (a decode batch never holds more requests than that)."""
    if over := [b for b in sizes if b > max_num_seqs]:
        raise ValueError(f"compile bucket {over[0]} exceeds max_num_seqs={max_num_seqs}: a decode batch holds "
                         f"at most {max_num_seqs} requests (choose sizes from 1 to max_num_seqs={max_num_seqs})")
    return decode_buckets(max_num_seqs, sizes)


def parse_compile_buckets(text: str, max_num_seqs: int = MAX_NUM_SEQS) -> tuple[int, ...]:
    """--compile-buckets "1,2,4,8" -> (1, 2, 4, 8).  Raises ValueError naming the bad entry:
    not a positive number, or above `max_num_seqs`."""
    return check_compile_buckets(parse_buckets(text), max_num_seqs)


def on_off(text: str) -> bool:
    """A command line's "on" or "off"."""
    if text not in ("on", "off"):
        raise ValueError(f"expected on or off, got {text!r}")
    return text == "on"


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: device, dtype, KV pool and batch limits.  Each field's help
    is what `tandem` shows for its flag; `LLM(model, **fields)` takes them by name."""
    model: str = option(str(SHIPPED_MODEL), says_default=True,
                        help="HF checkpoint directory (default: the shipped tiny-moe)")
    # a name of DTYPES (a torch.dtype is taken too), kept as its canonical name: `torch_dtype` is the dtype
    dtype: str = option("float32", choices=DTYPE_NAMES, help="the weights' and KV cache's floating point type")
    device: str = option("cpu", help="where the engine computes: cpu, cuda or cuda:N")
    page_size: int = option(16, help="tokens per KV page (a power of two)")
    kv_cache_tokens: int = option(16384, help="the KV pool, in tokens")
    max_model_len: int | None = option(None, type=int, says_default=True, help="the longest prompt + output, in "
                                       "tokens (default: the model's max_position_embeddings)")
    max_num_seqs: int = option(MAX_NUM_SEQS, help="requests one batch holds")
    max_prefill_tokens: int = option(2048, help="prompt tokens one prefill step computes")
    seed: int = option(0, help="the engine's random seed (a request without a seed of its own draws from it)")
    paged_experts_num_resident: int | None = option(
        None, type=int, says_default=True, help="keep K experts of each MoE layer on the device, the rest in host "
        "memory (default: all resident)")
    paged_experts_prefetch: bool | None = option(
        None, says_default=True, help="predict the next layer's experts and page them in early (default: off; on "
        "only on a GPU where bench.experts measured a gain: engine/experts PREFETCH_FASTER_ON, none yet)")
    keep_dense_quantized: bool | None = option(
        None, says_default=True, type=on_off, metavar="on|off",
        help="keep a quantized checkpoint's attention and dense MLP linears in their published parts, read by a "
        "Triton kernel on CUDA, dequantized per call elsewhere (default: on with CUDA; off elsewhere: dequantized "
        "to --dtype once, at load)")
    enable_prefix_cache: bool = option(
        True, flag="--no-prefix-cache", action="store_false",
        help="the prefix cache: requests share the KV pages of a common prompt prefix, per tenant salt, with the "
        "same outputs; --no-prefix-cache turns it off: every prompt is computed and its KV moved in full")
    kv_audit: bool = option(False, help="hash cached pages when published, so pool.check_integrity(contents=True) "
                            "proves none was written afterwards (tests)")
    compile: bool = option(factory=compile_default, flag="--no-compile", action="store_false", says_default=True,
                           help="compiled decode steps, one graph per batch bucket (engine/compiled); --no-compile "
                           "runs them eager, with no start-up compilation (debugging). Default: compiled, unless "
                           f"{COMPILE}=0 is set")
    compile_buckets: tuple[int, ...] | None = option(
        None, type=parse_compile_buckets, metavar="SIZES", says_default=True,
        help=f"the decode batch sizes compiled at start-up, e.g. 1,2,4,8 (each 1..max_num_seqs; default: "
        f"1,2,4,...,{MAX_NUM_SEQS}); a batch is padded to the next size, a batch above the largest runs eager")
    grammar_check_timeout_s: float | None = option(
        None, says_default=True,
        help="a structured-output constraint not seen before is checked in a child process within this many "
        "seconds (engine/grammar_check.py; default: none, compiled in-process without a budget, as engine.LLM "
        "does; a worker always sets one)")

    def __post_init__(self) -> None:
        # accepted as given, kept in one form: the model's path as text, the dtype's canonical
        # name, the buckets as a tuple (LLM(compile_buckets=[1, 2]) and argparse give lists),
        # compile=None as the environment's default (as LLM has always taken it)
        object.__setattr__(self, "model", str(self.model))
        if self.compile is None:
            object.__setattr__(self, "compile", compile_default())
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.compile_buckets is not None:
            object.__setattr__(self, "compile_buckets", tuple(self.compile_buckets))
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
            check_compile_buckets(self.compile_buckets, self.max_num_seqs)  # raises ValueError naming the limit

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def num_pages(self) -> int:
        return self.kv_cache_tokens // self.page_size
