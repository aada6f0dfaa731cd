"""Slow references for the published quantized layouts, one element at a time, written from each
format's documentation (never from engine/quant): what the codec tests and the end-to-end
quantized-checkpoint tests compare the engine with."""

from __future__ import annotations

import math

import torch

from engine.quant import LinearFormat


def nibble(word: int, index: int, bits: int) -> int:
    """Value `index` of a packed int32 word (value i at bits [i*bits, (i+1)*bits))."""
    return ((word & 0xFFFFFFFF) >> (index * bits)) & ((1 << bits) - 1)


def ref_gptq(fmt: LinearFormat, p: dict, out: int, in_: int) -> torch.Tensor:
    qw, qz, s, g = (p[k].tolist() for k in (".qweight", ".qzeros", ".scales", ".g_idx"))
    per = 32 // fmt.bits
    w = torch.empty(out, in_)
    for o in range(out):
        for i in range(in_):
            q = nibble(qw[i // per][o], i % per, fmt.bits)
            z = nibble(qz[g[i]][o // per], o % per, fmt.bits) + (1 if fmt.checkpoint_format == "gptq" else 0)
            w[o, i] = (q - z) * s[g[i]][o]
    return w


def ref_awq(fmt: LinearFormat, p: dict, out: int, in_: int) -> torch.Tensor:
    qw, qz, s = (p[k].tolist() for k in (".qweight", ".qzeros", ".scales"))
    packer_order = [0, 2, 4, 6, 1, 3, 5, 7]            # AutoAWQ's gemm packer: slot j holds column 8k + order[j]
    size = in_ if fmt.group_size == -1 else fmt.group_size
    w = torch.empty(out, in_)
    for o in range(out):
        slot = packer_order.index(o % 8)
        for i in range(in_):
            q, z = nibble(qw[i][o // 8], slot, 4), nibble(qz[i // size][o // 8], slot, 4)
            w[o, i] = (q - z) * s[i // size][o]
    return w


def ref_ct_int(fmt: LinearFormat, p: dict, out: int, in_: int) -> torch.Tensor:
    qw, s = p[".weight_packed"].tolist(), p[".weight_scale"].float().tolist()
    zp = p[".weight_zero_point"].tolist() if ".weight_zero_point" in p else None
    b, offset = fmt.bits, 1 << (fmt.bits - 1)
    size = in_ if fmt.group_size == -1 else fmt.group_size
    assert p[".weight_shape"].tolist() == [out, in_]
    w = torch.empty(out, in_)
    for o in range(out):
        for i in range(in_):
            q = nibble(qw[o][i * b // 32], (i * b % 32) // b, b) - offset           # packed along dim 1
            z = 0 if zp is None else nibble(zp[o * b // 32][i // size], (o * b % 32) // b, b) - offset  # dim 0
            w[o, i] = (q - z) * s[o][i // size]
    return w


def ref_fp8_block(fmt: LinearFormat, p: dict, out: int, in_: int) -> torch.Tensor:
    (bn, bk), w8, s = fmt.block, p[".weight"].float(), p[".weight_scale_inv"].tolist()
    return torch.tensor([[w8[o, i].item() * s[o // bn][i // bk] for i in range(in_)] for o in range(out)])


def ref_ct_fp8(fmt: LinearFormat, p: dict, out: int, in_: int) -> torch.Tensor:
    w8, s = p[".weight"].float(), p[".weight_scale"].float().flatten().tolist()
    return torch.tensor([[w8[o, i].item() * s[o if fmt.strategy == "channel" else 0] for i in range(in_)]
                         for o in range(out)])


def e2m1(code: int) -> float:
    """OCP MX E2M1: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal."""
    sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
    value = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
    return -value if sign else value


def ref_mxfp4(fmt: LinearFormat, p: dict, out: int, in_: int) -> torch.Tensor:
    blocks, scales = p["_blocks"].tolist(), p["_scales"].tolist()
    w = torch.empty(out, in_)
    for o in range(out):
        for i in range(in_):
            byte = blocks[o][i // 32][(i % 32) // 2]
            code = byte & 0xF if i % 2 == 0 else byte >> 4                 # low nibble: the even element
            w[o, i] = math.ldexp(e2m1(code), scales[o][i // 32] - 127)
    return w


REFERENCES = {"gptq": ref_gptq, "awq": ref_awq, "ct-int": ref_ct_int, "fp8-block": ref_fp8_block,
              "ct-fp8": ref_ct_fp8, "mxfp4": ref_mxfp4}
