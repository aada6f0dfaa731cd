"""Checkpoint loading: sharded files, both config spellings, named errors, and weights the
engine owns (aligned, never a view into the mapped file)."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Iterator

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine.loader
from engine import LLM, SamplingParams
from engine.checkpoint import CheckpointError
from engine.config import ModelConfig
from tests.checkpoints import RANDOM_CONFIG, random_tensors, write_random_checkpoint

PROMPT = [5, 17, 300, 42, 7, 99]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)


def test_sharded_checkpoint_loads_and_matches_the_single_file(tmp_path: Path, random_llm: LLM) -> None:
    sharded = write_random_checkpoint(tmp_path / "sharded", max_shard_bytes=200_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    llm = LLM(sharded)
    a = llm.generate([PROMPT], GREEDY)[0]
    b = random_llm.generate([PROMPT], GREEDY)[0]
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_bf16_checkpoint_loads_into_fp32(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "bf16")
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(path / "model.safetensors"))
    llm = LLM(path)
    assert llm.model.embed.dtype == torch.float32
    assert len(llm.generate([PROMPT], GREEDY)[0].token_ids) == 8


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "missing")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight "
                                              r"\(expected shape \[32, 64\]\)"):
        LLM(path)


def test_misshapen_tensor_names_both_shapes(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "misshapen")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(48, 64)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight has shape "
                                              r"\[48, 64\], config\.json implies \[32, 64\]"):
        LLM(path)


def test_missing_shard_and_missing_weights_are_reported(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "shards", max_shard_bytes=200_000)
    (path / "model-00002-of-{:05d}.safetensors".format(
        len(set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())))).unlink()
    with pytest.raises(CheckpointError, match="names shard model-00002"):
        LLM(path)
    empty = write_random_checkpoint(tmp_path / "empty")
    (empty / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        LLM(empty)


def test_unsupported_dtype_is_named(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "int8")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(64, dtype=torch.int8)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.norm.weight has dtype torch.int8"):
        LLM(path)


def test_both_config_spellings_read_the_same() -> None:
    released = dict(RANDOM_CONFIG)
    released["num_experts"] = released.pop("num_local_experts")
    released["rope_theta"] = released.pop("rope_parameters")["rope_theta"]
    assert ModelConfig.from_dict(released) == ModelConfig.from_dict(RANDOM_CONFIG)
    cfg = ModelConfig.from_dict(RANDOM_CONFIG)
    assert cfg.num_experts == 8 and cfg.rope_theta == 50000.0 and cfg.moe_layers == [0, 2]


def test_random_tensors_are_seeded() -> None:
    a, b = random_tensors(RANDOM_CONFIG, seed=3), random_tensors(RANDOM_CONFIG, seed=3)
    assert all(torch.equal(a[k], b[k]) for k in a)


def held_tensors(root: object) -> dict[str, torch.Tensor]:
    """Every tensor reachable from `root` through attributes, lists, tuples and dicts, named by
    the path that first reached it (e.g. `layers[0].experts.slots.store.w13`)."""
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(obj: object, path: str) -> None:
        if isinstance(obj, torch.Tensor):  # a tied tensor is listed under each of its names
            found[path] = obj
            return
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType)):
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            for key, value in obj.items():
                walk(value, f"{path}[{key!r}]")
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for i, value in enumerate(obj):
                walk(value, f"{path}[{i}]")
        elif hasattr(obj, "__dict__"):
            for key, value in vars(obj).items():
                walk(value, f"{path}.{key}" if path else key)

    walk(root, "")
    return found


def load_recording_file_tensors(monkeypatch: pytest.MonkeyPatch, path: Path, num_resident: int | None
                                ) -> tuple[LLM, list[torch.Tensor]]:
    """An LLM loaded from `path` (with `num_resident` paged experts per layer), and every tensor
    the loader read from the mapped files, kept alive so their mappings stay where the loader
    saw them (a fresh `safe_open` would map the file elsewhere, and find no overlap ever)."""
    read: list[torch.Tensor] = []
    iter_tensors = engine.loader.iter_tensors

    def recording(p: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in iter_tensors(p):
            read.append(tensor)
            yield name, tensor
    monkeypatch.setattr(engine.loader, "iter_tensors", recording)
    return LLM(path, paged_experts_num_resident=num_resident), read


def shares_memory(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    """Whether `t`'s storage overlaps any of the [start, end) address ranges."""
    lo, hi = storage_range(t)
    return lo < hi and any(start < hi and lo < end for start, end in ranges)


def storage_range(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


# Per layer: two norms, wqkv, wo, qk_norm; per MoE layer: router and two expert tensors (paged:
# the host store's two and the slots' two); per dense layer: w13, w2; embed, lm_head, final norm.
@pytest.mark.parametrize("num_resident, at_least, must_hold", [
    (None, 3 * 5 + 2 * 3 + 2 + 3, ["layers[0].mlp.experts.w13", "layers[2].mlp.router.weight", "lm_head"]),
    (2, 3 * 5 + 2 * 5 + 2 + 3, ["layers[0].mlp.experts.slots.store.w13", "layers[2].mlp.experts.slots.w2"]),
])
def test_every_weight_is_owned_and_aligned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           num_resident: int | None, at_least: int, must_hold: list[str]) -> None:
    path = write_random_checkpoint(tmp_path / "ckpt", max_shard_bytes=200_000)  # shards: offsets not aligned
    llm, read = load_recording_file_tensors(monkeypatch, path, num_resident)
    assert len(read) == len(random_tensors(RANDOM_CONFIG))
    held = held_tensors(llm.model)
    assert len(held) >= at_least and all(name in held for name in must_hold), sorted(held)
    misaligned = {name: t.data_ptr() % 64 for name, t in held.items() if t.data_ptr() % 64}
    assert not misaligned
    mapped = [storage_range(t) for t in read]
    assert not [name for name, t in held.items() if shares_memory(t, mapped)]


def test_rewriting_the_checkpoint_after_load_changes_nothing(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "live")
    other = write_random_checkpoint(tmp_path / "other", seed=1)
    file, new_bytes = path / "model.safetensors", (other / "model.safetensors").read_bytes()
    assert file.stat().st_size == len(new_bytes) and file.read_bytes() != new_bytes
    llm = LLM(path)
    before = llm.generate([PROMPT], GREEDY)[0]
    with open(file, "r+b") as f:  # in place, as a mapping of the file would see it
        f.write(new_bytes)
    after = llm.generate([PROMPT], GREEDY)[0]
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs
    fresh = LLM(path).generate([PROMPT], GREEDY)[0]  # the rewrite did change the weights on disk
    assert fresh.logprobs != before.logprobs
