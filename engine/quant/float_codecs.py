"""Floating-point weight codecs: block FP8 (DeepSeek-V3), compressed-tensors FP8, MXFP4 (gpt-oss).

    fp8-block  weight float8_e4m3fn [out, in]; weight_scale_inv fp32 [ceil(out/bn), ceil(in/bk)];
               w = w8 * scale_inv of its block (a multiply, the name notwithstanding; edge blocks
               partial).  Source: DeepSeek-V3 inference/kernel.py `weight_dequant`.
    ct-fp8     weight float8_e4m3fn [out, in]; weight_scale [out, 1] ("channel") or [1] ("tensor");
               w = w8 * scale.  Source: compressed-tensors `float-quantized` (naive compressor).
    mxfp4      <base>_blocks uint8 [out, in/32, 16]: two E2M1 codes a byte, the low nibble the even
               element; <base>_scales uint8 [out, in/32], an E8M0 exponent per 32 values:
               w = E2M1[code] * 2^(scale - 127).  Source: transformers integrations/mxfp4.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.checkpoint import dequantize_fp8

if TYPE_CHECKING:
    from engine.quant.linear import LinearFormat, Shapes

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                                        # largest finite float8_e4m3fn
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX_BLOCK = 32                                          # values per E8M0 scale


def to_fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


class Fp8Block:
    marker = ".weight_scale_inv"

    def parts(self, fmt: LinearFormat) -> tuple[str, ...]:
        return ".weight", ".weight_scale_inv"

    def problem(self, fmt: LinearFormat, out: int, in_: int) -> str | None:
        return None

    def shapes(self, fmt: LinearFormat, out: int, in_: int) -> Shapes:
        bn, bk = fmt.block
        return {".weight": ((out, in_), FP8), ".weight_scale_inv": ((-(-out // bn), -(-in_ // bk)), torch.float32)}

    def dequantize(self, fmt: LinearFormat, parts: dict[str, torch.Tensor], out: int, in_: int) -> torch.Tensor:
        return dequantize_fp8("fp8-block weight", parts[".weight"], parts[".weight_scale_inv"], fmt.block)

    def quantize(self, fmt: LinearFormat, w: torch.Tensor) -> dict[str, torch.Tensor]:
        (bn, bk), (out, in_) = fmt.block, w.shape[-2:]
        padded = F.pad(w, (0, -in_ % bk, 0, -out % bn))                       # zeros leave amax unchanged
        blocks = padded.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))       # [..., R, bn, C, bk]
        amax = blocks.abs().amax(dim=(-3, -1))                                # [..., R, C]
        scale = torch.where(amax > 0, amax / FP8_MAX, 1.0)
        full = scale.repeat_interleave(bn, -2)[..., :out, :].repeat_interleave(bk, -1)[..., :in_]
        return {".weight": to_fp8(w, full), ".weight_scale_inv": scale}

    def describe(self, fmt: LinearFormat) -> str:
        return f"fp8-block {fmt.block[0]}x{fmt.block[1]}"


class CompressedFp8:
    marker = ".weight_scale"

    def parts(self, fmt: LinearFormat) -> tuple[str, ...]:
        return ".weight", ".weight_scale"

    def problem(self, fmt: LinearFormat, out: int, in_: int) -> str | None:
        return None

    def shapes(self, fmt: LinearFormat, out: int, in_: int) -> Shapes:
        scale = (out, 1) if fmt.strategy == "channel" else (1,)
        return {".weight": ((out, in_), FP8), ".weight_scale": (scale, fmt.scale_dtype)}

    def dequantize(self, fmt: LinearFormat, parts: dict[str, torch.Tensor], out: int, in_: int) -> torch.Tensor:
        s = parts[".weight_scale"].float()                 # [..., out, 1] or [..., 1]
        return parts[".weight"].float() * (s if fmt.strategy == "channel" else s.unsqueeze(-1))

    def quantize(self, fmt: LinearFormat, w: torch.Tensor) -> dict[str, torch.Tensor]:
        amax = w.abs().amax(-1, keepdim=True)                                  # [..., out, 1]
        if fmt.strategy == "tensor":
            amax = amax.amax(-2)                                               # [..., 1]
        scale = torch.where(amax > 0, amax / FP8_MAX, 1.0).to(fmt.scale_dtype)
        full = scale.float() if fmt.strategy == "channel" else scale.float().unsqueeze(-1)
        return {".weight": to_fp8(w, full), ".weight_scale": scale}

    def describe(self, fmt: LinearFormat) -> str:
        return f"ct-fp8 {fmt.strategy}"


class Mxfp4:
    marker = "_blocks"

    def parts(self, fmt: LinearFormat) -> tuple[str, ...]:
        return "_blocks", "_scales"

    def problem(self, fmt: LinearFormat, out: int, in_: int) -> str | None:
        if in_ % MX_BLOCK:
            return (f"its input size {in_} is not a multiple of {MX_BLOCK} (one E8M0 scale per {MX_BLOCK} "
                    f"values; gpt-oss publishes no partial blocks)")
        return None

    def shapes(self, fmt: LinearFormat, out: int, in_: int) -> Shapes:
        g = in_ // MX_BLOCK
        return {"_blocks": ((out, g, MX_BLOCK // 2), torch.uint8), "_scales": ((out, g), torch.uint8)}

    def dequantize(self, fmt: LinearFormat, parts: dict[str, torch.Tensor], out: int, in_: int) -> torch.Tensor:
        blocks = parts["_blocks"].long()                                      # [..., out, G, 16]
        lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
        values = torch.stack([lut[blocks & 0xF], lut[blocks >> 4]], -1).flatten(-2)    # [..., out, G, 32]
        # 2^(s - 127) as the fp32 whose exponent bits are s: s = 0 is 2^-127 (a subnormal), s = 255
        # inf (NaN in OCP MX, never published); bit for bit what torch.ldexp gives (and transformers'
        # dequantizer, which calls it), which a compiled CPU step ran 6x slower (it goes through pow)
        s = parts["_scales"].to(torch.int32).unsqueeze(-1)                     # [..., out, G, 1]
        scale = torch.where(s == 0, 2.0 ** -127, (s << 23).view(torch.float32))
        return (values * scale).flatten(-2)

    def quantize(self, fmt: LinearFormat, w: torch.Tensor) -> dict[str, torch.Tensor]:
        blocks = w.unflatten(-1, (-1, MX_BLOCK))                              # [..., out, G, 32]
        amax = blocks.abs().amax(-1)
        exponent = torch.where(amax > 0, torch.log2(amax / 6).ceil(), -127.0).clamp(-127, 127)
        x = blocks / torch.exp2(exponent).unsqueeze(-1)                       # |x| <= 6
        magnitudes = torch.tensor(E2M1[:8], device=w.device)
        code = (x.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1) | (x < 0).long() << 3   # [..., 32]
        pairs = code.unflatten(-1, (-1, 2))
        packed = pairs[..., 0] | pairs[..., 1] << 4                           # even element in the low nibble
        return {"_blocks": packed.to(torch.uint8), "_scales": (exponent + 127).to(torch.uint8)}

    def describe(self, fmt: LinearFormat) -> str:
        return "mxfp4"


FP8_BLOCK, CT_FP8, MXFP4 = Fp8Block(), CompressedFp8(), Mxfp4()
