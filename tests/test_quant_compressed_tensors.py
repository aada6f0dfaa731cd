"""engine/quant's compressed-tensors codecs against the compressed-tensors library itself (the
layout's own code): the library accepts the quantization_config Tandem writes, decompresses
Tandem's packed parts to exactly Tandem's weights, and, given the same scales and zero points,
compresses to the same bytes, which Tandem decompresses as the library does."""

from __future__ import annotations

import pytest
import torch

from engine.quant import format_named, quant_config, quantization_config_for

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402

CASES = [  # sizes off the pack and the zero point's packing where the layout allows it
    ("ct-int", dict(bits=4, group_size=16, sym=True), (24, 48)),
    ("ct-int", dict(bits=4, group_size=16, sym=False), (13, 48)),
    ("ct-int", dict(bits=8, group_size=32, sym=False), (7, 64)),
    ("ct-int", dict(bits=4, group_size=-1, sym=True), (10, 37)),
    ("ct-int", dict(bits=8, group_size=-1, sym=False), (9, 37)),
    ("ct-fp8", dict(strategy="channel"), (11, 19)),
    ("ct-fp8", dict(strategy="tensor"), (11, 19)),
]


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name,fields,size", CASES, ids=[f"{n}-{f}-{s}" for n, f, s in CASES])
def test_the_library_and_tandem_agree_both_ways(name: str, fields: dict, size: tuple[int, int],
                                                scale_dtype: torch.dtype) -> None:
    out, in_ = size
    fmt = format_named(name, scale_dtype=scale_dtype, **fields)
    qc = quantization_config_for(fmt)
    assert quant_config({"quantization_config": qc}).format.describe() == fmt.describe()
    scheme = QuantizationConfig.model_validate(qc).config_groups["group_0"]     # the library reads it
    comp = PackedQuantizationCompressor if name == "ct-int" else FloatQuantizationCompressor
    w = torch.randn(out, in_, generator=torch.Generator().manual_seed(out * in_))
    parts = fmt.quantize(w)
    theirs = comp.decompress({k.lstrip("."): v for k, v in parts.items()}, scheme)["weight"]
    assert torch.equal(theirs, fmt.dequantize(parts, out, in_).to(theirs.dtype))
    state = {"weight": w, "weight_scale": parts[".weight_scale"]}
    if ".weight_zero_point" in parts:     # the library keeps zero points unpacked, signed
        groups = parts[".weight_scale"].shape[-1]
        state["weight_zero_point"] = unpack_from_int32(parts[".weight_zero_point"], fmt.bits,
                                                       torch.Size([out, groups]), packed_dim=0)
    lib = {"." + k: v for k, v in comp.compress(state, scheme).items()}
    fmt.check("layer", lib, out, in_)
    for suffix, tensor in parts.items():
        assert torch.equal(lib[suffix].long() if suffix == ".weight_shape" else lib[suffix],
                           tensor.long() if suffix == ".weight_shape" else tensor), suffix
    assert torch.equal(fmt.dequantize(lib, out, in_).to(scale_dtype),
                       comp.decompress({k.lstrip("."): v for k, v in lib.items()}, scheme)["weight"])
