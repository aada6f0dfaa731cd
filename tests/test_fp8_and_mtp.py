"""What real DeepSeek-V3 / Kimi-K2 / GLM-4.5 checkpoints carry beyond the tiny ones: block-wise
FP8 weights with `weight_scale_inv` (dequantized at load: exactly the weights the test
dequantizes itself, logits close to the unquantized model's) and multi-token-prediction layers
(skipped with one log line)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.checkpoint import CheckpointError, dequantized, iter_tensors
from tests.checkpoints import RANDOM_CONFIG, write_random_checkpoint

PROMPTS = [[5, 17, 300, 42, 7, 99], [1000, 3, 3, 3, 250], [4000, 12, 7]]
FIRST = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=5)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
FP8_MAX = 448.0          # largest finite float8_e4m3fn


def linear_weight(name: str, t: torch.Tensor) -> bool:
    """A 2-D Linear weight (what FP8 checkpoints quantize): not the embedding, not a norm."""
    return t.dim() == 2 and name.endswith(".weight") and "embed_tokens" not in name


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise float8_e4m3fn: per [bn, bk] block scale = amax / 448; returns (w8, scale_inv)."""
    bn, bk = block
    rows, cols = w.shape
    scale = torch.empty(-(-rows // bn), -(-cols // bk), dtype=torch.float32)
    w8 = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            s = part.abs().max().clamp(min=1e-12) / FP8_MAX
            scale[i, j] = s
            w8[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (part / s).to(torch.float8_e4m3fn)
    return w8, scale


def dequantize_by_blocks(w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The reference dequantization, block by block (independent of the loader's)."""
    bn, bk = block
    out = torch.empty(w8.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = \
                w8[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float() * scale[i, j]
    return out


def fp8_checkpoint(tmp_path: Path, block: tuple[int, int]) -> tuple[Path, Path, Path]:
    """(original fp32, its block-wise FP8 quantization, the FP8 dequantized by the test in fp32)."""
    original = write_random_checkpoint(tmp_path / "original")
    tensors = load_file(str(original / "model.safetensors"))
    fp8, ref = {}, {}
    for name, t in tensors.items():
        if linear_weight(name, t):
            w8, s = quantize(t, block)
            fp8[name], fp8[name + "_scale_inv"] = w8, s
            ref[name] = dequantize_by_blocks(w8, s, block)
        else:
            fp8[name] = ref[name] = t
    config = dict(RANDOM_CONFIG, quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic",
                                                      "fmt": "e4m3", "weight_block_size": list(block)})
    paths = []
    for label, ts, cfg in (("fp8", fp8, config), ("dequantized", ref, RANDOM_CONFIG)):
        path = write_random_checkpoint(tmp_path / label)
        save_file(ts, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(cfg))
        paths.append(path)
    return original, paths[0], paths[1]


@pytest.mark.parametrize("block", [(128, 128), (16, 24)])   # one block cropped everywhere; many, cropped at edges
def test_fp8_weights_dequantize_to_the_blockwise_product_and_serve_like_it(tmp_path: Path, block) -> None:
    original, fp8, ref = fp8_checkpoint(tmp_path, block)
    assert sum(t.dtype == torch.float8_e4m3fn for t in load_file(str(fp8 / "model.safetensors")).values()) > 10
    got = dict(dequantized(iter_tensors(fp8), block))
    want = dict(iter_tensors(ref))
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want[name]), name

    a, b, c = LLM(fp8), LLM(ref), LLM(original)
    quantized, reference = a.generate(PROMPTS, GREEDY), b.generate(PROMPTS, GREEDY)
    for x, y in zip(quantized, reference):
        assert x.token_ids == y.token_ids and x.logprobs == y.logprobs
    worst = 0.0
    for x, y in zip(a.generate(PROMPTS, FIRST), c.generate(PROMPTS, FIRST)):
        top = y.token_ids[0]
        assert top in x.logprobs[0], "the unquantized model's top token left the FP8 model's top 5"
        worst = max(worst, abs(x.logprobs[0][top] - y.logprobs[0][top]))
    assert worst < 0.25, f"FP8 moved the top token's logprob by {worst}"


def test_fp8_loads_into_bf16(tmp_path: Path) -> None:
    _, fp8, ref = fp8_checkpoint(tmp_path, (16, 24))
    a, b = LLM(fp8, dtype="bfloat16"), LLM(ref, dtype="bfloat16")
    assert a.model.embed.dtype == torch.bfloat16
    x, y = a.generate(PROMPTS[:1], GREEDY)[0], b.generate(PROMPTS[:1], GREEDY)[0]
    assert x.token_ids == y.token_ids and x.logprobs == y.logprobs


def rewrite(path: Path, change) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_a_weight_without_its_scale_and_a_scale_without_its_weight_are_named(tmp_path: Path) -> None:
    _, fp8, _ = fp8_checkpoint(tmp_path, (16, 24))
    name = "model.layers.0.self_attn.q_proj.weight"
    rewrite(fp8, lambda t: t.pop(name + "_scale_inv"))
    with pytest.raises(CheckpointError, match=rf"has \['{name}'\] but no \['{name}_scale_inv'\]"):
        LLM(fp8)
    rewrite(fp8, lambda t: t.update({name + "_scale_inv": torch.ones(8, 3), name: torch.zeros(128, 64)}))
    with pytest.raises(CheckpointError, match=rf"has \['{name}_scale_inv'\] but no \['{name}'\]"):
        LLM(fp8)
    rewrite(fp8, lambda t: t.update({name + "_scale_inv": torch.ones(8, 2),
                                     name: torch.zeros(128, 64, dtype=torch.float8_e4m3fn)}))
    with pytest.raises(CheckpointError, match=rf"{name}_scale_inv is \[8, 2\].*needs \[8, 3\]"):
        LLM(fp8)


def test_another_quantization_is_refused_by_name(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "bnb")
    (path / "config.json").write_text(json.dumps(dict(RANDOM_CONFIG,
                                                      quantization_config={"quant_method": "bitsandbytes"})))
    with pytest.raises(CheckpointError, match="quant_method='bitsandbytes' is not supported"):
        LLM(path)


def with_mtp_layer(path: Path, layer: int, fp8: bool = False) -> int:
    """Add a DeepSeek-style MTP layer `layer` (a copy of layer 0 plus its own projections);
    returns how many tensors it has."""
    added = {}

    def change(t: dict[str, torch.Tensor]) -> None:
        for name in [n for n in t if n.startswith("model.layers.0.")]:
            added[name.replace("model.layers.0.", f"model.layers.{layer}.")] = t[name].clone()
        p = f"model.layers.{layer}."
        added.update({p + "enorm.weight": torch.ones(64), p + "hnorm.weight": torch.ones(64),
                      p + "eh_proj.weight": torch.randn(64, 128), p + "shared_head.norm.weight": torch.ones(64)})
        if fp8:      # quantized like the rest: scales travel with it and are skipped too
            added[p + "eh_proj.weight"] = added[p + "eh_proj.weight"].to(torch.float8_e4m3fn)
            added[p + "eh_proj.weight_scale_inv"] = torch.ones(1, 1)
        t.update(added)

    rewrite(path, change)
    return len(added)


@pytest.mark.parametrize("fp8", [False, True])
def test_mtp_layers_are_skipped_with_one_log_line(tmp_path: Path, random_llm: LLM, caplog, fp8: bool) -> None:
    path = write_random_checkpoint(tmp_path / "mtp")
    count = with_mtp_layer(path, RANDOM_CONFIG["num_hidden_layers"], fp8)
    (path / "config.json").write_text(json.dumps(dict(RANDOM_CONFIG, num_nextn_predict_layers=1)))
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        llm = LLM(path)
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.loader"]
    assert lines == [f"skipped {count} tensors of 1 multi-token-prediction layer (model.layers.3): "
                     f"the engine does not run them"]
    a, b = llm.generate(PROMPTS, GREEDY), random_llm.generate(PROMPTS, GREEDY)
    assert [x.token_ids for x in a] == [y.token_ids for y in b]
    assert [x.logprobs for x in a] == [y.logprobs for y in b]


def test_layers_past_the_mtp_ones_or_without_the_config_stay_refused(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "extra")
    with_mtp_layer(path, RANDOM_CONFIG["num_hidden_layers"])
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.3\."):
        LLM(path)                                           # no num_nextn_predict_layers: refused
    path = write_random_checkpoint(tmp_path / "beyond")
    with_mtp_layer(path, RANDOM_CONFIG["num_hidden_layers"] + 1)
    (path / "config.json").write_text(json.dumps(dict(RANDOM_CONFIG, num_nextn_predict_layers=1)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.4\."):
        LLM(path)                                           # layer 4 is not an MTP layer of 1


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_a_real_shaped_checkpoint_fp8_with_an_mtp_layer_serves_like_its_dequantized_copy(
        tmp_path: Path, family: str, caplog) -> None:
    """What DeepSeek-V3 / GLM-4.5-FP8 ship: every Linear weight but the router in float8 with
    128x128-style block scales (16x16 here), and one MTP layer after the last."""
    from tests.families import tiny_checkpoint
    block = (16, 16)
    fp8, ref = tiny_checkpoint(family, tmp_path / "fp8"), tmp_path / "dequantized"
    shutil.copytree(fp8, ref)
    config = json.loads((fp8 / "config.json").read_text())
    layers = config["num_hidden_layers"]
    tensors = load_file(str(fp8 / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        if linear_weight(name, t) and not name.endswith(".mlp.gate.weight") and name != "lm_head.weight":
            w8, s = quantize(t, block)
            quantized[name], quantized[name + "_scale_inv"] = w8, s
            dequantized[name] = dequantize_by_blocks(w8, s, block)
        else:
            quantized[name] = dequantized[name] = t
    mtp = {n.replace("model.layers.0.", f"model.layers.{layers}."): t.clone()
           for n, t in quantized.items() if n.startswith("model.layers.0.")}
    mtp[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(64, 128, dtype=torch.float8_e4m3fn)
    mtp[f"model.layers.{layers}.eh_proj.weight_scale_inv"] = torch.ones(4, 8)
    save_file({**quantized, **mtp}, str(fp8 / "model.safetensors"))
    save_file(dequantized, str(ref / "model.safetensors"))
    (fp8 / "config.json").write_text(json.dumps(dict(
        config, num_nextn_predict_layers=1, quantization_config={
            "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)})))
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        a = LLM(fp8)
    assert [r.getMessage() for r in caplog.records if r.name == "engine.loader"] == [
        f"skipped {len(mtp)} tensors of 1 multi-token-prediction layer (model.layers.{layers}): "
        f"the engine does not run them"]
    b = LLM(ref)
    for x, y in zip(a.generate(PROMPTS, GREEDY), b.generate(PROMPTS, GREEDY)):
        assert x.token_ids == y.token_ids and x.logprobs == y.logprobs
