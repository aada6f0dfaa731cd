"""engine.quant: the published quantized layouts.  Each format packs random weights at odd sizes and
must (1) dequantize exactly as a slow reference written here from the format's documentation does
(bit by bit, element by element), (2) stay within its rounding bound of the original, (3) give an
expert the same bits whichever experts share the call, and (4) write exactly the parts it declares.
config.json parsing is checked on published quantization_config dicts and on each refused setting."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import CheckpointError
from engine.quant import LinearFormat, format_named, quant_config, quantization_config_for
from tests.quant_refs import REFERENCES
from tests.quant_refs import e2m1 as REF_E2M1

CASES = [  # (format, [(out, in_), ...]): sizes off the group / block / pack where the layout allows it
    (format_named("gptq", bits=4, group_size=16, sym=False, desc_act=True), [(16, 40), (8, 24)]),
    (format_named("gptq", bits=4, group_size=16, sym=True), [(16, 40)]),
    (format_named("gptq", bits=4, group_size=-1, sym=False, checkpoint_format="gptq_v2"), [(8, 24)]),
    (format_named("gptq", bits=8, group_size=8, sym=False, desc_act=True), [(12, 20)]),
    (format_named("awq", group_size=16), [(16, 48), (24, 32)]),
    (format_named("awq", group_size=-1), [(8, 24)]),
    (format_named("ct-int", bits=4, group_size=16, sym=False), [(13, 48)]),
    (format_named("ct-int", bits=4, group_size=-1, sym=True), [(10, 37)]),
    (format_named("ct-int", bits=8, group_size=32, sym=False, scale_dtype=torch.float16), [(7, 64)]),
    (format_named("ct-int", bits=8, group_size=-1, sym=False), [(9, 37)]),
    (format_named("fp8-block", block=(16, 8)), [(37, 21)]),
    (format_named("fp8-block"), [(5, 3), (130, 129)]),
    (format_named("ct-fp8", strategy="channel"), [(11, 19)]),
    (format_named("ct-fp8", strategy="tensor", scale_dtype=torch.float32), [(11, 19)]),
    (format_named("mxfp4"), [(5, 64), (3, 32)]),
]
PARAMS = [pytest.param(f, out, in_, id=f"{f.describe()} [{out},{in_}]") for f, sizes in CASES for out, in_ in sizes]
FORMATS = [pytest.param(f, id=f.describe()) for f, _ in CASES]


def packed(fmt: LinearFormat, out: int, in_: int, lead: tuple[int, ...] = (), seed: int = 0
           ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    w = torch.randn(*lead, out, in_, generator=torch.Generator().manual_seed(seed))
    return w, fmt.quantize(w)


def step(fmt: LinearFormat, p: dict, out: int, in_: int) -> torch.Tensor:
    """The scale each element of an integer format was quantized with, [..., out, in_]."""
    size = in_ if fmt.group_size == -1 else fmt.group_size
    if fmt.name == "ct-int":
        return p[".weight_scale"].float().repeat_interleave(size, -1)
    if fmt.name == "awq":
        return p[".scales"].float().repeat_interleave(size, -2).transpose(-1, -2)
    g = p[".g_idx"].long().unsqueeze(-1).expand(*p[".g_idx"].shape, out)
    return p[".scales"].float().gather(-2, g).transpose(-1, -2)


def bound(fmt: LinearFormat, w: torch.Tensor, p: dict) -> torch.Tensor:
    """Per-element rounding bound of a round trip: half a step (a little more where a scale was rounded
    to 16 bits before use), half the widest E2M1 gap for mxfp4, a 3-bit mantissa's half ulp for fp8."""
    out, in_ = w.shape[-2:]
    if fmt.name in ("gptq", "awq", "ct-int"):
        return 0.55 * step(fmt, p, out, in_) + 1e-7
    if fmt.name == "mxfp4":
        return torch.ldexp(torch.ones(p["_scales"].shape), p["_scales"].int() - 127).repeat_interleave(32, -1)
    return w.abs() * (1 / 16 + 1 / 128) + 1e-6


# --- the codecs -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,out,in_", PARAMS)
def test_dequantize_matches_the_element_by_element_reference(fmt: LinearFormat, out: int, in_: int) -> None:
    if out * in_ > 4096:
        out, in_ = min(out, 40), min(in_, 40)       # the reference is slow; the other tests take the full size
    _, p = packed(fmt, out, in_)
    assert torch.equal(fmt.dequantize(p, out, in_), REFERENCES[fmt.name](fmt, p, out, in_))


@pytest.mark.parametrize("fmt,out,in_", PARAMS)
def test_round_trip_stays_within_half_a_step(fmt: LinearFormat, out: int, in_: int) -> None:
    w, p = packed(fmt, out, in_, lead=(2,))
    err = (fmt.dequantize(p, out, in_) - w).abs()
    limit = bound(fmt, w, p)
    assert (err <= limit).all(), f"worst {(err - limit).max():.3g} over the bound"
    assert err.pow(2).mean().sqrt() < 0.2 * w.pow(2).mean().sqrt()


@pytest.mark.parametrize("fmt,out,in_", PARAMS)
def test_an_expert_dequantizes_to_the_same_bits_whatever_shares_the_call(fmt: LinearFormat, out: int,
                                                                         in_: int) -> None:
    _, p = packed(fmt, out, in_, lead=(4,))
    alone = fmt.dequantize({k: v[[2]] for k, v in p.items()}, out, in_)[0]
    together = fmt.dequantize({k: v[[2, 0, 3]] for k, v in p.items()}, out, in_)[0]
    unbatched = fmt.dequantize({k: v[2] for k, v in p.items()}, out, in_)
    assert torch.equal(alone, together) and torch.equal(alone, unbatched)


@pytest.mark.parametrize("fmt,out,in_", PARAMS)
def test_quantize_writes_exactly_the_declared_parts(fmt: LinearFormat, out: int, in_: int) -> None:
    for lead in ((), (3,)):
        _, p = packed(fmt, out, in_, lead)
        shapes = fmt.part_shapes(out, in_, lead)
        assert tuple(p) == fmt.parts() == tuple(shapes)
        assert {k: (tuple(v.shape), v.dtype) for k, v in p.items()} == shapes
        assert all(v.is_contiguous() for v in p.values())
        fmt.check("model.layers.0.mlp.experts.down_proj", p, out, in_, lead)
    assert fmt.nbytes(out, in_) == sum(v.numel() * v.element_size() for v in packed(fmt, out, in_)[1].values())
    assert fmt.marker in fmt.parts() and fmt.marker != ".weight"


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_traces_as_one_graph(fmt: LinearFormat) -> None:
    """No .item(), no data-dependent shapes: torch.compile(fullgraph=True) takes it whole."""
    out, in_ = next(sizes for f, sizes in CASES if f == fmt)[0]
    _, p = packed(fmt, out, in_, lead=(2,))
    torch._dynamo.reset()                    # each format is a new guard on the same code object
    compiled = torch.compile(fmt.dequantize, backend="eager", fullgraph=True)
    assert torch.equal(compiled(p, out, in_), fmt.dequantize(p, out, in_))


def test_gptq_desc_act_writes_an_activation_order_grouping() -> None:
    fmt = format_named("gptq", bits=4, group_size=8, sym=False, desc_act=True)
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    w[:, 5] *= 50                                             # the loudest column leads the order: group 0
    g_idx = fmt.quantize(w)[".g_idx"]
    assert g_idx[5] == 0 and not torch.equal(g_idx, torch.arange(32) // 8)
    assert torch.bincount(g_idx).tolist() == [8, 8, 8, 8]     # a permutation cut into groups
    plain = format_named("gptq", bits=4, group_size=8).quantize(w)[".g_idx"]
    assert torch.equal(plain, torch.arange(32, dtype=torch.int32) // 8)


def test_gptq_v1_symmetric_zeros_are_the_published_constant() -> None:
    """v1 stores zero - 1: a symmetric int4 checkpoint's qzeros words are all 0x77777777."""
    p = format_named("gptq", bits=4, group_size=16, sym=True).quantize(torch.randn(16, 32))
    assert (p[".qzeros"] == 0x77777777).all()
    v2 = format_named("gptq", bits=4, group_size=16, sym=True, checkpoint_format="gptq_v2")
    assert (v2.quantize(torch.randn(16, 32))[".qzeros"] == -0x77777778).all()    # 0x88888888 as int32


def test_mxfp4_matches_transformers_dequantizer() -> None:
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    fmt = format_named("mxfp4")
    _, p = packed(fmt, 6, 96, lead=(3,))
    theirs = mxfp4.convert_moe_packed_tensors(p["_blocks"], p["_scales"], dtype=torch.float32)   # [E, in, out]
    assert torch.equal(fmt.dequantize(p, 6, 96), theirs.transpose(1, 2))


SIZE_REFUSALS = [
    (format_named("gptq", bits=4), 16, 36, "input size 36 is not a multiple of 8"),
    (format_named("gptq", bits=8), 18, 32, "output size 18 is not a multiple of 4"),
    (format_named("awq", group_size=16), 12, 32, "output size 12 is not a multiple of 8"),
    (format_named("awq", group_size=16), 16, 40, "input size 40 is not a multiple of the group size 16"),
    (format_named("ct-int", bits=4, group_size=16), 16, 40, "input size 40 is not a multiple of the group size 16"),
    (format_named("mxfp4"), 4, 48, "input size 48 is not a multiple of 32"),
]


@pytest.mark.parametrize("fmt,out,in_,why", SIZE_REFUSALS, ids=[f"{f.describe()} [{o},{i}]" for f, o, i, _ in
                                                                SIZE_REFUSALS])
def test_a_size_the_layout_cannot_store_is_refused_naming_the_tensor(fmt: LinearFormat, out: int, in_: int,
                                                                      why: str) -> None:
    with pytest.raises(CheckpointError, match=f"model.layers.3.mlp.up_proj{fmt.marker}: .*{why}"):
        fmt.check("model.layers.3.mlp.up_proj", {}, out, in_)
    with pytest.raises(CheckpointError, match=why):
        fmt.quantize(torch.randn(out, in_))


def test_check_names_the_tensor_and_what_was_expected() -> None:
    fmt, base = format_named("gptq", bits=4, group_size=16), "model.layers.1.mlp.experts.7.gate_proj"
    _, p = packed(fmt, 16, 32)
    with pytest.raises(CheckpointError, match=rf"{base}\.g_idx is missing: .* needs \[32\] torch.int32"):
        fmt.check(base, {k: v for k, v in p.items() if k != ".g_idx"}, 16, 32)
    with pytest.raises(CheckpointError, match=rf"{base}\.bias is not part of a gptq int4 g16 sym linear"):
        fmt.check(base, {**p, ".bias": torch.zeros(16)}, 16, 32)
    with pytest.raises(CheckpointError, match=rf"{base}\.scales is \[2, 16\] torch.float32; .* needs \[2, 16\] "
                                              r"torch.float16"):
        fmt.check(base, {**p, ".scales": p[".scales"].float()}, 16, 32)
    with pytest.raises(CheckpointError, match=rf"{base}\.qweight is \[4, 16\] torch.int32; .* needs \[4, 32\]"):
        fmt.check(base, p, 32, 32)


def test_fp8_block_codec_is_the_loaders_dequantization() -> None:
    from engine.checkpoint import dequantize_fp8
    fmt = format_named("fp8-block", block=(16, 8))
    _, p = packed(fmt, 37, 21)
    assert torch.equal(fmt.dequantize(p, 37, 21), dequantize_fp8("w", p[".weight"], p[".weight_scale_inv"], (16, 8)))


def test_describe_and_settings() -> None:
    assert format_named("gptq", bits=4, group_size=128, sym=False, desc_act=True).describe() == \
        "gptq int4 g128 asym desc_act"
    assert format_named("fp8-block", block=[128, 128]).describe() == "fp8-block 128x128"
    assert format_named("mxfp4").describe() == "mxfp4"
    with pytest.raises(CheckpointError, match=r"gptq bits=3 is not supported \(supported: \(4, 8\)\)"):
        format_named("gptq", bits=3)
    with pytest.raises(CheckpointError, match="format 'nvfp4' is not supported"):
        format_named("nvfp4")
    with pytest.raises(CheckpointError, match=r"unknown setting\(s\) \['bitz'\]"):
        format_named("gptq", bitz=4)


# --- config.json quantization_config ------------------------------------------------------------------

DEEPSEEK_V3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
QWEN3_GPTQ_INT4 = {"bits": 4, "damp_percent": 0.01, "desc_act": False, "group_size": 128,
                   "modules_in_block_to_quantize": None, "quant_method": "gptq", "static_groups": False,
                   "sym": True, "true_sequential": True}
QWEN3_AWQ = {"bits": 4, "group_size": 128, "modules_to_not_convert": None, "quant_method": "awq",
             "version": "gemm", "zero_point": True}
CT_W4A16 = {  # RedHatAI/...-quantized.w4a16 (llm-compressor), trimmed `ignore`
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": "weight", "block_structure": None, "dynamic": False, "group_size": 128,
                    "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                    "symmetric": True, "type": "int"}}},
    "format": "pack-quantized", "global_compression_ratio": None,
    "ignore": ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"], "kv_cache_scheme": None,
    "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
    "transform_config": {}, "version": "0.10.2"}
CT_FP8_DYNAMIC = {
    "config_groups": {"group_0": {
        "input_activations": {"actorder": None, "block_structure": None, "dynamic": True, "group_size": None,
                              "num_bits": 8, "observer": None, "observer_kwargs": {}, "strategy": "token",
                              "symmetric": True, "type": "float"},
        "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None,
                    "num_bits": 8, "observer": "minmax", "observer_kwargs": {}, "strategy": "channel",
                    "symmetric": True, "type": "float"}}},
    "format": "float-quantized", "global_compression_ratio": None, "ignore": ["lm_head"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"}
GPT_OSS = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                      "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}

PUBLISHED = [
    (DEEPSEEK_V3, "fp8", format_named("fp8-block", block=(128, 128)), ()),
    (QWEN3_GPTQ_INT4, "gptq", format_named("gptq", bits=4, group_size=128, sym=True), ()),
    (QWEN3_AWQ, "awq", format_named("awq", group_size=128), ()),
    (CT_W4A16, "compressed-tensors", format_named("ct-int", bits=4, group_size=128, sym=True),
     ("lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate")),
    (CT_FP8_DYNAMIC, "compressed-tensors", format_named("ct-fp8", strategy="channel"), ("lm_head",)),
    (GPT_OSS, "mxfp4", format_named("mxfp4"), tuple(GPT_OSS["modules_to_not_convert"])),
]


@pytest.mark.parametrize("q,method,fmt,skip", PUBLISHED, ids=[m for _, m, _, _ in PUBLISHED[:3]] +
                         ["ct-w4a16", "ct-fp8-dynamic", "gpt-oss"])
def test_published_configs_are_read(q: dict, method: str, fmt: LinearFormat, skip: tuple) -> None:
    cfg = quant_config({"model_type": "x", "quantization_config": q})
    assert cfg is not None and (cfg.method, cfg.format, cfg.not_converted) == (method, fmt, skip)
    assert fmt.describe() in cfg.describe()


def test_no_quantization_config_is_none() -> None:
    assert quant_config({"model_type": "qwen3_moe"}) is None
    assert quant_config({"quantization_config": None}) is None


@pytest.mark.parametrize("fmt", [f for f, _ in CASES] + [format_named("ct-int", bits=8, group_size=128, sym=False)],
                         ids=lambda f: f.describe())
def test_quantization_config_for_is_read_back_as_the_same_format(fmt: LinearFormat) -> None:
    q = quantization_config_for(fmt, ["lm_head"])
    cfg = quant_config({"quantization_config": q})
    assert cfg is not None and cfg.not_converted == ("lm_head",)
    assert cfg.format.describe() == fmt.describe() and cfg.format.name == fmt.name
    if not fmt.name.startswith("ct-"):     # config.json does not record compressed-tensors' scale dtype
        assert cfg.format == fmt


def ct(weights: dict | None = None, acts: dict | None = None, **top: object) -> dict:
    group = {**CT_W4A16["config_groups"]["group_0"], "input_activations": acts}
    group["weights"] = {**group["weights"], **(weights or {})}
    return {**CT_W4A16, "config_groups": {"group_0": group}, **top}


def with_(base: dict, **changes: object) -> dict:
    return {**base, **changes}


W = "config_groups.group_0.weights."
INT8_ACTS = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
REFUSALS = [  # (quantization_config, the setting as the message names it, the supported values it lists)
    ("method", {"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'",
     "'fp8', 'gptq', 'awq', 'compressed-tensors', 'mxfp4'"),
    ("fp8 static", with_(DEEPSEEK_V3, activation_scheme="static"), "activation_scheme='static'", "'dynamic'"),
    ("fp8 e5m2", with_(DEEPSEEK_V3, fmt="e5m2"), "fmt='e5m2'", "'e4m3'"),
    ("fp8 block", with_(DEEPSEEK_V3, weight_block_size=[128]), "weight_block_size=[128]", "[rows, cols]"),
    ("gptq bits", with_(QWEN3_GPTQ_INT4, bits=3), "bits=3", "4, 8"),
    ("gptq group", with_(QWEN3_GPTQ_INT4, group_size=0), "group_size=0", "-1 (one group per row) or a positive"),
    ("gptq marlin", with_(QWEN3_GPTQ_INT4, checkpoint_format="marlin"), "checkpoint_format='marlin'",
     "'gptq', 'gptq_v2'"),
    ("gptq bitblas", with_(QWEN3_GPTQ_INT4, format="bitblas"), "checkpoint_format='bitblas'", "'gptq', 'gptq_v2'"),
    ("gptq is_marlin", with_(QWEN3_GPTQ_INT4, is_marlin_format=True), "is_marlin_format=True", "False"),
    ("gptq dynamic", with_(QWEN3_GPTQ_INT4, dynamic={"-:.*down_proj": {}}), "dynamic=", "per-module overrides"),
    ("awq gemv", with_(QWEN3_AWQ, version="gemv"), "version='gemv'", "'gemm'"),
    ("awq sym", with_(QWEN3_AWQ, zero_point=False), "zero_point=False", "True"),
    ("awq bits", with_(QWEN3_AWQ, bits=8), "bits=8", "4"),
    ("awq llm-awq", with_(QWEN3_AWQ, backend="llm-awq"), "backend='llm-awq'", "'autoawq'"),
    ("ct w4a8", ct(acts=INT8_ACTS), "config_groups.group_0.input_activations=", "null: integer weights"),
    ("ct bits", ct({"num_bits": 2}), W + "num_bits=2", "4, 8"),
    ("ct int tensor", ct({"strategy": "tensor"}), W + "strategy='tensor'", "'group', 'channel'"),
    ("ct actorder group", ct({"actorder": "group"}), W + "actorder='group'", "'weight'"),
    ("ct dynamic weights", ct({"dynamic": True}), W + "dynamic=True", "False"),
    ("ct marlin-24", ct(format="marlin-24"), "(weights.type, format)=('int', 'marlin-24')", "pack-quantized"),
    ("ct nvfp4", ct({"type": "float", "num_bits": 4}, format="nvfp4-pack-quantized"),
     "('float', 'nvfp4-pack-quantized')", "float-quantized"),
    ("ct fp8 block", with_(CT_FP8_DYNAMIC, config_groups={"group_0": {
        **CT_FP8_DYNAMIC["config_groups"]["group_0"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}}}),
     W + "strategy='block'", "'channel', 'tensor'"),
    ("ct fp8 static acts", with_(CT_FP8_DYNAMIC, config_groups={"group_0": {
        **CT_FP8_DYNAMIC["config_groups"]["group_0"],
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}),
     "input_activations (type, num_bits, dynamic)=('float', 8, False)", "('float', 8, True)"),
    ("ct differing groups", with_(CT_W4A16, config_groups={
        "group_0": CT_W4A16["config_groups"]["group_0"],
        "group_1": ct({"num_bits": 8})["config_groups"]["group_0"]}), "config_groups=",
     "one weight format for every group"),
    ("ct transform", ct(transform_config={"config_groups": {"R1": {}}}), "transform_config=", "unrotated"),
    ("ct kv cache", ct(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme=", "only the weights"),
    ("ct output acts", with_(CT_W4A16, config_groups={"group_0": {
        **CT_W4A16["config_groups"]["group_0"], "output_activations": INT8_ACTS}}),
     "output_activations=", "None"),
]


@pytest.mark.parametrize("q,setting,supported", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_unsupported_settings_are_refused_naming_the_setting_and_the_supported_values(
        q: dict, setting: str, supported: str) -> None:
    with pytest.raises(CheckpointError) as err:
        quant_config({"quantization_config": q})
    message = str(err.value)
    assert "config.json quantization_config." in message and "is not supported" in message
    assert setting in message, message
    assert "supported: " in message and supported in message.split("supported: ", 1)[1], message


def test_mxfp4_scales_every_code_at_every_exponent_as_ldexp_does() -> None:
    """The exponent is built from its bits (no pow): every E2M1 code at every E8M0 value, 0 (a
    subnormal 2^-127) and 255 included, is bit for bit torch.ldexp's (transformers' dequantizer)."""
    fmt = format_named("mxfp4")
    blocks = torch.arange(256, dtype=torch.uint8).repeat(256, 1).view(256, 16, 16)   # every byte: two codes
    scales = torch.arange(256, dtype=torch.uint8).view(256, 1).expand(256, 16).contiguous()
    lut = torch.tensor([REF_E2M1(c) for c in range(16)])
    codes = blocks.long()
    values = torch.stack([lut[codes & 0xF], lut[codes >> 4]], -1).flatten(-2)      # [256, 16, 32]
    want = torch.ldexp(values, (scales.long() - 127).unsqueeze(-1).float()).flatten(-2)
    got = fmt.dequantize({"_blocks": blocks, "_scales": scales}, 256, 512)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
