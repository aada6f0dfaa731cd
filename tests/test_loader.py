"""Checkpoint loading: sharded files, both config spellings, and named errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.checkpoint import CheckpointError
from engine.config import ModelConfig
from tests.checkpoints import RANDOM_CONFIG, random_tensors, write_random_checkpoint

PROMPT = [5, 17, 300, 42, 7, 99]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)


def test_sharded_checkpoint_loads_and_matches_the_single_file(tmp_path, random_llm):
    sharded = write_random_checkpoint(tmp_path / "sharded", max_shard_bytes=200_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    llm = LLM(sharded)
    a = llm.generate([PROMPT], GREEDY)[0]
    b = random_llm.generate([PROMPT], GREEDY)[0]
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_bf16_checkpoint_loads_into_fp32(tmp_path):
    path = write_random_checkpoint(tmp_path / "bf16")
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(path / "model.safetensors"))
    llm = LLM(path)
    assert llm.model.embed.dtype == torch.float32
    assert len(llm.generate([PROMPT], GREEDY)[0].token_ids) == 8


def test_missing_tensor_is_named(tmp_path):
    path = write_random_checkpoint(tmp_path / "missing")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight "
                                              r"\(expected shape \[32, 64\]\)"):
        LLM(path)


def test_misshapen_tensor_names_both_shapes(tmp_path):
    path = write_random_checkpoint(tmp_path / "misshapen")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(48, 64)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight has shape "
                                              r"\[48, 64\], config\.json implies \[32, 64\]"):
        LLM(path)


def test_missing_shard_and_missing_weights_are_reported(tmp_path):
    path = write_random_checkpoint(tmp_path / "shards", max_shard_bytes=200_000)
    (path / "model-00002-of-{:05d}.safetensors".format(
        len(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())))).unlink()
    with pytest.raises(CheckpointError, match="names shard model-00002"):
        LLM(path)
    empty = write_random_checkpoint(tmp_path / "empty")
    (empty / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        LLM(empty)


def test_unsupported_dtype_is_named(tmp_path):
    path = write_random_checkpoint(tmp_path / "int8")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(64, dtype=torch.int8)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.norm.weight has dtype torch.int8"):
        LLM(path)


def test_both_config_spellings_read_the_same():
    released = dict(RANDOM_CONFIG)
    released["num_experts"] = released.pop("num_local_experts")
    released["rope_theta"] = released.pop("rope_parameters")["rope_theta"]
    assert ModelConfig.from_dict(released) == ModelConfig.from_dict(RANDOM_CONFIG)
    cfg = ModelConfig.from_dict(RANDOM_CONFIG)
    assert cfg.num_experts == 8 and cfg.rope_theta == 50000.0 and cfg.moe_layers == [0, 2]


def test_random_tensors_are_seeded():
    a, b = random_tensors(RANDOM_CONFIG, seed=3), random_tensors(RANDOM_CONFIG, seed=3)
    assert all(torch.equal(a[k], b[k]) for k in a)
