"""Dense linears kept quantized (`keep_dense_quantized`, the default on CUDA): a checkpoint whose
attention and dense MLPs are quantized keeps them in their published parts (engine/quant/dense.py),
each family fusing q/k/v and gate/up as joined linears, MLA's kv_b_proj (which the absorbed
decode reshapes per head) dequantized; on a CPU each such linear runs over its dequantization
made per call, so the model serves the tokens of the same checkpoint dequantized at load, its
logprobs within 1e-5 (eager and compiled steps), with a fraction of the dense weights' bytes held.
The CUDA kernel itself is tests/test_kernel_quant_linear.py's."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.quant import LinearFormat, format_named
from engine.quant.dense import JoinedLinear, QuantLinear
from engine.quant.pack import quantize_checkpoint
from tests.checkpoints import write_random_checkpoint
from tests.families import tiny_checkpoint
from tests.test_quant_experts import ASYM_ACT, PARAMS, assert_same, prompts

DENSE_FORMATS = [format_named("fp8-block", block=(48, 40)), ASYM_ACT,
                 format_named("ct-int", bits=4, group_size=16, sym=False), format_named("ct-fp8", strategy="channel")]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("plain"))


def dense_bytes(llm: LLM) -> tuple[int, int]:
    """(bytes of the attention and dense-MLP weights the model holds, how many are QuantLinears)."""
    total, kept = 0, 0
    for layer in llm.core.model.layers:
        mlp = getattr(layer.mlp, "shared", None) if hasattr(layer.mlp, "router") else layer.mlp
        weights = [getattr(layer.attn, n) for n in ("wqkv", "wo") if hasattr(layer.attn, n)]
        weights += [mlp.w13, mlp.w2] if mlp is not None else []
        for w in weights:
            parts = w.linears if isinstance(w, JoinedLinear) else (w,)
            for p in parts:
                tensors = p.tensors() if isinstance(p, QuantLinear) else [p]
                total += sum(t.numel() * t.element_size() for t in tensors)
                kept += isinstance(p, QuantLinear)
    return total, kept


@pytest.mark.parametrize("fmt", DENSE_FORMATS, ids=[f.describe() for f in DENSE_FORMATS])
def test_kept_quantized_dense_linears_serve_like_the_checkpoint_dequantized_at_load(
        fmt: LinearFormat, plain: Path, tmp_path: Path) -> None:
    quantized = tmp_path / "q"
    quantize_checkpoint(plain, quantized, fmt, experts_only=False)
    at_load = LLM(quantized, compile=False)
    want = at_load.generate(prompts(), PARAMS)
    plain_bytes, none_kept = dense_bytes(at_load)
    assert none_kept == 0
    del at_load
    for compile_ in (False, True):
        kept = LLM(quantized, keep_dense_quantized=True, compile=compile_, compile_buckets=(1, 4))
        held, linears = dense_bytes(kept)
        layers = kept.core.model.layers
        mlps = sum(1 for layer in layers if not hasattr(layer.mlp, "router"))
        assert linears == 4 * len(layers) + 3 * mlps == 15, "every layer's q, k, v, o; the dense layer's gate, up, down"
        assert held < plain_bytes * 0.6, f"{held} bytes held against {plain_bytes} dequantized"
        assert_same(kept.generate(prompts(), PARAMS), want, f"{fmt.describe()} kept quantized, compile={compile_}")
        del kept
        gc.collect()


def test_deepseek_v3_keeps_its_latent_projections_fp8_and_dequantizes_kv_b(tmp_path: Path) -> None:
    fmt = format_named("fp8-block", block=(16, 16))
    quantized = tmp_path / "q"
    quantize_checkpoint(tiny_checkpoint("deepseek_v3", tmp_path / "plain"), quantized, fmt, experts_only=False)
    want = LLM(quantized, compile=False).generate(prompts(), PARAMS)
    kept = LLM(quantized, keep_dense_quantized=True, compile=False)
    attn = kept.core.model.layers[0].attn.w
    assert isinstance(attn.w_a, (QuantLinear, JoinedLinear)) and isinstance(attn.w_o, QuantLinear)
    assert isinstance(attn.w_kv_b, torch.Tensor), "the absorbed decode reshapes kv_b_proj: it is dequantized"
    assert_same(kept.generate(prompts(), PARAMS), want, "deepseek-v3 dense fp8 kept quantized")


def test_which_linears_stay_quantized_and_which_a_checkpoint_left_plain() -> None:
    from engine.quant.dense import is_kept_linear, not_converted
    assert is_kept_linear("model.layers.3.self_attn.q_proj.weight")
    assert is_kept_linear("model.layers.3.mlp.shared_experts.down_proj.weight")
    assert not is_kept_linear("model.layers.3.self_attn.kv_b_proj.weight")      # reshaped per head
    assert not is_kept_linear("lm_head.weight") and not is_kept_linear("model.layers.3.mlp.gate.weight")
    globs = ("model.layers.*.self_attn", "lm_head")
    assert not_converted("model.layers.3.self_attn.q_proj.weight", globs)
    assert not not_converted("model.layers.3.mlp.down_proj.weight", globs)
    assert not_converted("model.layers.0.mlp.down_proj.weight", ("re:.*layers\\.0\\.mlp.*",))
