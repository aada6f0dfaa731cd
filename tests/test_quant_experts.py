"""Quantized checkpoints end to end: each published layout, written by engine/quant/pack.py,
loads and serves like the same model dequantized by the tests' own element-by-element
references (tests/quant_refs.py) into a plain fp32 checkpoint (greedy tokens identical,
logprobs within 1e-5); paged experts stay bit-identical to all-resident; the host store, the
slots and the page-ins hold the quantized bytes; the start-up check catches a copier that
leaves any one part of an expert behind; a checkpoint with a missing or misshapen part, or a
setting not supported, is refused naming it."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import engine.experts as experts_pkg
from engine import LLM, SamplingParams
from engine.checkpoint import CheckpointError, iter_tensors, save_checkpoint
from engine.config import ModelConfig
from engine.experts.check import ExpertCheckError
from engine.experts.copy import DirectCopy
from engine.models import spec_for
from engine.quant import LinearFormat, format_named
from engine.quant.pack import quantize_checkpoint
from engine.quant.stack import tensors_of
from tests.checkpoints import write_random_checkpoint
from tests.families import tiny_checkpoint
from tests.parity import check_parity
from tests.quant_refs import REFERENCES

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
PROMPT_LENGTHS = (1, 7, 19)
ASYM_ACT = format_named("gptq", bits=4, group_size=16, sym=False, desc_act=True)  # every part differs per expert

# (format, quantize every linear, not only the routed experts); the random Qwen3-MoE checkpoint's
# linears are [32, 64] / [64, 32] (experts), [96, 64] / [64, 96] (its dense layer), attention
# [128, 64] / [32, 64] / [64, 128]: the fp8 blocks (48 x 40) leave partial blocks on every edge
FORMATS = [
    (format_named("fp8-block", block=(48, 40)), True),
    (ASYM_ACT, True),
    (format_named("gptq", bits=8, group_size=-1, sym=True, checkpoint_format="gptq_v2"), False),
    (format_named("awq", group_size=16), False),
    (format_named("ct-int", bits=4, group_size=16, sym=False), False),
    (format_named("ct-int", bits=8, group_size=-1, sym=True), False),
    (format_named("ct-fp8", strategy="channel"), True),
    (format_named("mxfp4"), False),
]


def prompts(seed: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 4096, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("plain"))


def dequantized_copy(src: Path, dst: Path, fmt: LinearFormat) -> Path:
    """`src` (quantized in `fmt`) as a plain fp32 checkpoint, every quantized linear dequantized
    by the tests' reference for the format (never by engine/quant)."""
    raw = json.loads((src / "config.json").read_text())
    transposed = getattr(spec_for(ModelConfig.from_dict(raw).architecture), "TRANSPOSED_EXPERTS", False)
    tensors = dict(iter_tensors(src))
    out: dict[str, torch.Tensor] = {}
    bases = {name[:-len(fmt.marker)] for name in tensors if name.endswith(fmt.marker)}
    for base in sorted(bases):
        parts = {s: tensors.pop(base + s) for s in fmt.parts()}
        first = parts[fmt.parts()[0]]
        if first.dim() == (4 if fmt.name == "mxfp4" else 3):  # gpt-oss: [E, ...], dense weight [E, in, out]
            per = [dequantize_one(fmt, {s: p[i] for s, p in parts.items()}) for i in range(first.shape[0])]
            dense = torch.stack(per)
            out[base] = dense.transpose(1, 2).contiguous() if transposed else dense
        else:
            out[base + ".weight"] = dequantize_one(fmt, parts)
    out.update({n: t.float() if t.is_floating_point() else t for n, t in tensors.items()})
    raw.pop("quantization_config")
    return written(dst, out, raw, src)


def written(dst: Path, tensors: dict[str, torch.Tensor], raw: dict, tokenizer_of: Path) -> Path:
    """A checkpoint of `tensors` and `raw` at `dst`, with `tokenizer_of`'s tokenizer."""
    save_checkpoint(dst, tensors, raw)
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        (dst / extra).write_bytes((tokenizer_of / extra).read_bytes())
    return dst


def dequantize_one(fmt: LinearFormat, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    out, in_ = dense_shape(fmt, parts)
    return REFERENCES[fmt.name](fmt, parts, out, in_)


def dense_shape(fmt: LinearFormat, parts: dict[str, torch.Tensor]) -> tuple[int, int]:
    """[out, in] of one linear from its parts' shapes (as the formats publish them)."""
    if fmt.name in ("fp8-block", "ct-fp8"):
        return tuple(parts[".weight"].shape)  # type: ignore[return-value]
    if fmt.name == "mxfp4":
        o, g, _ = parts["_blocks"].shape
        return o, g * 32
    if fmt.name == "ct-int":
        return tuple(parts[".weight_shape"].tolist())  # type: ignore[return-value]
    if fmt.name == "gptq":
        return parts[".scales"].shape[1], parts[".g_idx"].shape[0]
    return parts[".scales"].shape[1], parts[".qweight"].shape[0]     # awq


def assert_same(got: list[Any], want: list[Any], what: str, exact: bool = False) -> None:
    assert [o.token_ids for o in got] == [w.token_ids for w in want], what
    if exact:
        assert [o.logprobs for o in got] == [w.logprobs for w in want], f"{what}: logprobs not bit-identical"
        return
    worst = max(abs(a[tok] - b[tok]) for o, w in zip(got, want) for a, b in zip(o.logprobs, w.logprobs)
                for tok in a)    # each step: {token id: logprob} of the sampled token and the top 2
    assert worst <= 1e-5, f"{what}: logprob {worst:.2e} from the reference"


@pytest.mark.parametrize("fmt,all_linears", FORMATS, ids=[f.describe() for f, _ in FORMATS])
def test_a_quantized_checkpoint_serves_like_its_reference_dequantization(
        fmt: LinearFormat, all_linears: bool, plain: Path, tmp_path: Path) -> None:
    quantized = tmp_path / "q"
    quantize_checkpoint(plain, quantized, fmt, experts_only=not all_linears)
    reference = LLM(dequantized_copy(quantized, tmp_path / "ref", fmt)).generate(prompts(), PARAMS)
    resident = LLM(quantized)
    assert set(resident.core.expert_formats().values()) == {fmt.describe()}
    got = resident.generate(prompts(), PARAMS)
    assert_same(got, reference, f"{fmt.describe()} against its reference")
    del resident
    for k in (2, 4):                                        # K = top_k and E/2
        paged = LLM(quantized, paged_experts_num_resident=k)
        assert_same(paged.generate(prompts(), PARAMS), got, f"{fmt.describe()} paged at K={k}", exact=True)
        assert sum(e.counters.misses for e in paged.core.paged_experts().values()) > 0
        del paged
        gc.collect()


def test_experts_are_held_and_paged_as_their_quantized_bytes(plain: Path, tmp_path: Path) -> None:
    fmt = format_named("gptq", bits=4, group_size=32, sym=True)
    quantize_checkpoint(plain, tmp_path / "q", fmt)
    llm = LLM(tmp_path / "q", paged_experts_num_resident=3, dtype="bfloat16")
    cfg = llm.model_config
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    for layer in llm.core.paged_experts().values():
        slots, store = layer.slots, layer.slots.store
        assert store.bytes_per_expert == 2 * fmt.nbytes(i, h) + fmt.nbytes(h, i)
        # 4 bits a weight, plus scales, zeros and g_idx (4 bytes an input: 5 % of these tiny linears)
        assert store.bytes_per_expert < 0.35 * 3 * h * i * 2, "int4 experts held at more than 0.35 of bf16"
        assert [t.dtype for t in tensors_of(slots.w13)] == [torch.int32, torch.int32, torch.float16, torch.int32] * 2
        assert [t.shape[0] for t in slots.tensors()] == [3] * 12 and store.num_experts == cfg.num_experts
    llm.generate(prompts(), PARAMS)
    for layer in llm.core.paged_experts().values():
        c = layer.counters
        assert c.misses > 0 and c.bytes_paged == c.misses * layer.slots.store.bytes_per_expert


class LeavesOnePart(DirectCopy):
    """A copy engine with a bug: it never copies an expert's tensor number `part`."""

    def __init__(self, part: int, per_expert: int) -> None:
        self.part, self.per_expert = part, per_expert

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: Any = None, prefetch: bool = False) -> Any:
        return super().copy([p for n, p in enumerate(pairs) if n % self.per_expert != self.part], after, prefetch)


PART_IDS = [f"{lin}{s}" for lin in ("gate", "up", "down") for s in ASYM_ACT.parts()]


@pytest.mark.parametrize("part", range(12), ids=PART_IDS)
def test_the_start_up_check_catches_a_copier_that_leaves_one_part_behind(
        part: int, plain: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    quantized = tmp_path_factory.getbasetemp() / "asym-act"
    if not quantized.exists():
        quantize_checkpoint(plain, quantized, ASYM_ACT)
    real = experts_pkg.ExpertSlots

    def buggy(store: Any, num_slots: int, device: Any, copier: Any = None, policy: Any = None) -> Any:
        return real(store, num_slots, device, copier=LeavesOnePart(part, len(store.expert(0))), policy=policy)
    monkeypatch.setattr(experts_pkg, "ExpertSlots", buggy)
    with pytest.raises(ExpertCheckError, match="does not match its checkpoint bytes"):
        LLM(quantized, paged_experts_num_resident=2)


def test_a_missing_or_misshapen_part_is_refused_naming_the_tensor(plain: Path, tmp_path: Path) -> None:
    fmt = format_named("gptq", bits=4, group_size=16, sym=False)
    quantize_checkpoint(plain, tmp_path / "q", fmt)
    tensors = dict(iter_tensors(tmp_path / "q"))
    raw = json.loads((tmp_path / "q" / "config.json").read_text())
    name = "model.layers.2.mlp.experts.5.down_proj.qzeros"
    missing = written(tmp_path / "missing", {n: t for n, t in tensors.items() if n != name}, raw, plain)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.5\.down_proj.*qzeros"):
        LLM(missing)
    short = written(tmp_path / "short", {**tensors, name: tensors[name][:1]}, raw, plain)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.5\.down_proj\.qzeros is \[1, "):
        LLM(short)


def test_a_setting_not_supported_is_refused_before_any_tensor_is_read(plain: Path, tmp_path: Path) -> None:
    quantize_checkpoint(plain, tmp_path / "q", format_named("gptq", bits=4, group_size=16))
    raw = json.loads((tmp_path / "q" / "config.json").read_text())
    raw["quantization_config"]["bits"] = 3
    (tmp_path / "q" / "config.json").write_text(json.dumps(raw))
    (tmp_path / "q" / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="bits=3"):
        LLM(tmp_path / "q")


def test_gpt_oss_mxfp4_serves_as_published_and_as_transformers_reads_it(tmp_path: Path) -> None:
    """gpt-oss's own layout: `*_blocks` / `*_scales` [E, 2I, H/32, ...] with gate and up
    interleaved, biases unquantized.  transformers dequantizes it on a CPU (Mxfp4Config(
    dequantize=True)): parity with it (1e-4, fp32); paged at K=2 bit-identical to resident."""
    import transformers
    quantized = tmp_path / "q"
    count = quantize_checkpoint(tiny_checkpoint("gpt_oss", tmp_path / "plain"), quantized, format_named("mxfp4"))
    names = {n for n, _ in iter_tensors(quantized)}
    assert count == 4 and {"model.layers.1.mlp.experts.gate_up_proj_blocks",
                           "model.layers.1.mlp.experts.gate_up_proj_bias"} <= names
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        quantized, dtype=torch.float32, attn_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    resident = LLM(quantized)
    got = resident.generate(prompts(), PARAMS)     # first: a prompt served from the prefix cache is split
    check_parity(resident, hf, prompts())          # otherwise, and its last bits may differ
    paged = LLM(quantized, paged_experts_num_resident=2)
    assert_same(paged.generate(prompts(), PARAMS), got, "gpt-oss mxfp4 paged", exact=True)


def test_deepseek_v3_block_fp8_keeps_its_experts_fp8(tmp_path: Path) -> None:
    fmt = format_named("fp8-block", block=(16, 16))
    quantized = tmp_path / "q"
    quantize_checkpoint(tiny_checkpoint("deepseek_v3", tmp_path / "plain"), quantized, fmt, experts_only=False)
    reference = LLM(dequantized_copy(quantized, tmp_path / "ref", fmt)).generate(prompts(), PARAMS)
    llm = LLM(quantized, paged_experts_num_resident=2)
    store = next(iter(llm.core.paged_experts().values())).slots.store
    assert [t.dtype for t in store.tensors()][:2] == [torch.float8_e4m3fn, torch.float32]
    assert_same(llm.generate(prompts(), PARAMS), reference, "deepseek-v3 fp8 paged against its reference")


def test_disaggregated_int4_with_paged_experts_equals_the_engine_and_reports_its_format(
        plain: Path, tmp_path: Path) -> None:
    """A GPTQ int4 checkpoint through a prefill and a decode worker (gRPC KV transfer, paged
    experts on the decode side): greedy output equal to the single-process engine; the decode
    worker's Stats and the gateway's /metrics name every MoE layer's format."""
    from types import SimpleNamespace

    from gateway.metrics import Metrics
    from tests.workers import channel, config, run, start_decode, start_prefill, wait_idle, worker_stats
    fmt = format_named("gptq", bits=4, group_size=32, sym=True)
    quantize_checkpoint(plain, tmp_path / "q", fmt)
    reference = LLM(tmp_path / "q").generate(prompts(), PARAMS)
    decode = start_decode(config(model=str(tmp_path / "q"), paged_experts_num_resident=2, max_model_len=512))
    prefill = start_prefill(config(model=str(tmp_path / "q"), max_model_len=512))
    try:
        dch, pch = channel(decode.address), channel(prefill.address)
        for i, ids in enumerate(prompts()):
            got = run(dch, pch, f"q{i}", ids, PARAMS)
            assert got.error is None and got.token_ids == reference[i].token_ids
        wait_idle(decode, prefill)
        stats = worker_stats(decode)
        assert [(e.layer, e.format, e.paged) for e in stats.experts] == [(0, fmt.describe(), True),
                                                                         (2, fmt.describe(), True)]
        assert sum(e.bytes_paged for e in stats.experts) > 0
        metrics = Metrics()
        metrics.observe_workers(SimpleNamespace(workers=[SimpleNamespace(
            address="d0", role="decode", healthy=True, cache=None, stats=stats)]))  # type: ignore[arg-type]
        text = metrics.render().decode()
        assert ('tandem_worker_expert_format_info{format="gptq int4 g32 sym",layer="2",paged="true",'
                'role="decode",worker="d0"} 1.0') in text
    finally:
        decode.stop()
        prefill.stop()
