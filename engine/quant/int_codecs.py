"""Integer weight codecs: GPTQ, AWQ (GEMM) and compressed-tensors `pack-quantized`.

All three pack b-bit integers (b = 4 or 8) into int32 words, value j of a word at bits [j*b, (j+1)*b):

    word = v0 | v1 << b | v2 << 2b | ... | v(32/b - 1) << (32 - b)

and dequantize w = (q - z) * s per group of input columns.  Where they differ:

    GPTQ   qweight [in/p, out] packed along in; qzeros [G, out/p] along out, v1 stores z - 1;
           scales fp16 [G, out]; g_idx int32 [in] gives each input column's group
    AWQ    qweight [in, out/8] and qzeros [G, out/8] packed along out, slot j of a word holding
           column 8k + [0, 2, 4, 6, 1, 3, 5, 7][j]; scales fp16 [G, out]; group = column // G
    CT     weight_packed [out, ceil(in/p)] along in, stored as q + 2^(b-1) (q signed), zero-padded;
           weight_scale [out, G]; weight_shape [2]; asym adds weight_zero_point [ceil(out/p), G]
           packed along out (dim 0), also offset by 2^(b-1)

(p = 32 / b values per word, G = number of groups.)  Sources: vLLM's GPTQ/AWQ kernels and tests,
AutoAWQ's gemm packer, compressed-tensors `compressors/pack_quantized/`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.quant.linear import LinearFormat, Shapes

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)          # slot j of a word holds column AWQ_ORDER[j]
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)        # column c sits in slot AWQ_REVERSE[c]


def unpack(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 [..., n] -> int32 [..., count] (count <= n * 32/bits) of unsigned b-bit values."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)[..., :count]


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., n] unsigned b-bit values -> int32 [..., ceil(n * bits / 32)], the last word zero-padded."""
    per = 32 // bits
    v = F.pad(values.to(torch.int64), (0, -values.shape[-1] % per)).unflatten(-1, (-1, per))
    words = (v << torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)   # as two's complement


def n_groups(in_: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-in_ // group_size)


def per_group(t: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """t [..., G, out] read at each input column's group: [..., in, out]."""
    return t.gather(-2, group.unsqueeze(-1).expand(*group.shape, t.shape[-1]))


def minmax_params(w: torch.Tensor, bits: int, sym: bool, scale_dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (scale, zero) from w [..., G, n, k] (k values per group): unsigned q in [0, 2^b - 1],
    w ~ (q - zero) * scale.  The scale is rounded up to `scale_dtype` first (scale * (1 + eps) rounded
    to nearest is >= scale), so the rounded grid still spans the group and the round trip uses it."""
    maxq = (1 << bits) - 1
    lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        scale, zero = 2 * hi / maxq, torch.full_like(hi, (maxq + 1) // 2)
    else:
        scale = (hi - lo) / maxq
    scale = (torch.where(scale > 0, scale, 1.0) * (1 + torch.finfo(scale_dtype).eps)).to(scale_dtype).float()
    if not sym:
        zero = (-lo / scale).round().clamp(0, maxq)
    return scale, zero


def round_q(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    return (w / scale + zero).round().clamp(0, (1 << bits) - 1).to(torch.int32)


def _grouped(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """w [..., out, in] (in % group_size == 0, or group_size -1) -> [..., G, out, group] and group."""
    size = w.shape[-1] if group_size == -1 else group_size
    return w.unflatten(-1, (-1, size)).movedim(-2, -3), size


class Gptq:
    marker = ".qweight"

    def parts(self, fmt: LinearFormat) -> tuple[str, ...]:
        return ".qweight", ".qzeros", ".scales", ".g_idx"

    def problem(self, fmt: LinearFormat, out: int, in_: int) -> str | None:
        per = 32 // fmt.bits
        for what, size, part in (("input", in_, "qweight"), ("output", out, "qzeros")):
            if size % per:
                return f"its {what} size {size} is not a multiple of {per} ({part} packs {per} values per int32)"
        return None

    def shapes(self, fmt: LinearFormat, out: int, in_: int) -> Shapes:
        per, g = 32 // fmt.bits, n_groups(in_, fmt.group_size)
        return {".qweight": ((in_ // per, out), torch.int32), ".qzeros": ((g, out // per), torch.int32),
                ".scales": ((g, out), torch.float16), ".g_idx": ((in_,), torch.int32)}

    def dequantize(self, fmt: LinearFormat, parts: dict[str, torch.Tensor], out: int, in_: int) -> torch.Tensor:
        q = unpack(parts[".qweight"].transpose(-1, -2), fmt.bits, in_)               # [..., out, in]
        z = unpack(parts[".qzeros"], fmt.bits, out) + int(fmt.checkpoint_format == "gptq")   # [..., G, out]
        s = parts[".scales"].float()
        if fmt.desc_act:                    # each input column's group from g_idx
            group = parts[".g_idx"].long()                                          # [..., in]
            z, s = per_group(z, group), per_group(s, group)                         # [..., in, out]
        else:                               # g_idx is column // group_size (GPTQ writes it so, and vLLM
            size = in_ if fmt.group_size == -1 else fmt.group_size   # reads it only with desc_act):
            z = z.repeat_interleave(size, -2)[..., :in_, :]          # repeats, not a gather, which a
            s = s.repeat_interleave(size, -2)[..., :in_, :]          # compiled CPU step runs far faster
        return (q - z.transpose(-1, -2)).float() * s.transpose(-1, -2)

    def quantize(self, fmt: LinearFormat, w: torch.Tensor) -> dict[str, torch.Tensor]:
        out, in_ = w.shape[-2:]
        group = self.groups(fmt, w)                                                 # [..., in]
        g = n_groups(in_, fmt.group_size)
        wt = w.transpose(-1, -2)                                                    # [..., in, out]
        idx = group.unsqueeze(-1).expand(wt.shape)
        lo = wt.new_zeros(*wt.shape[:-2], g, out).scatter_reduce(-2, idx, wt, "amin")
        hi = wt.new_zeros(*wt.shape[:-2], g, out).scatter_reduce(-2, idx, wt, "amax")
        scale, zero = minmax_params(torch.stack([lo, hi], -1), fmt.bits, fmt.sym, torch.float16)
        if fmt.checkpoint_format == "gptq":
            zero = zero.clamp(min=1)                   # v1 stores zero - 1 in b bits: zero 0 cannot be written
        q = round_q(wt, per_group(scale, group), per_group(zero, group), fmt.bits)  # [..., in, out]
        stored_zero = zero.to(torch.int32) - int(fmt.checkpoint_format == "gptq")
        return {".qweight": pack(q.transpose(-1, -2), fmt.bits).transpose(-1, -2).contiguous(),
                ".qzeros": pack(stored_zero, fmt.bits), ".scales": scale.half(),
                ".g_idx": group.to(torch.int32)}

    def groups(self, fmt: LinearFormat, w: torch.Tensor) -> torch.Tensor:
        """Each input column's group [..., in]: consecutive columns, or with desc_act consecutive in an
        activation order (GPTQ's: Hessian diagonal; here the column's magnitude, a stand-in), so
        g_idx[c] = rank of column c in that order // group_size."""
        in_ = w.shape[-1]
        size = in_ if fmt.group_size == -1 else fmt.group_size
        rank = torch.arange(in_, device=w.device).expand(w.shape[:-2] + (in_,))
        if fmt.desc_act:
            order = w.abs().sum(-2).argsort(dim=-1, descending=True, stable=True)   # [..., in]
            rank = torch.empty_like(order).scatter_(-1, order, rank)
        return rank // size

    def describe(self, fmt: LinearFormat) -> str:
        g = "channel" if fmt.group_size == -1 else f"g{fmt.group_size}"
        extra = (" desc_act" if fmt.desc_act else "") + (" v2" if fmt.checkpoint_format == "gptq_v2" else "")
        return f"gptq int{fmt.bits} {g} {'sym' if fmt.sym else 'asym'}{extra}"


class Awq:
    marker = ".qweight"

    def parts(self, fmt: LinearFormat) -> tuple[str, ...]:
        return ".qweight", ".qzeros", ".scales"

    def problem(self, fmt: LinearFormat, out: int, in_: int) -> str | None:
        if out % 8:
            return f"its output size {out} is not a multiple of 8 (qweight packs 8 values per int32 along it)"
        if fmt.group_size != -1 and in_ % fmt.group_size:
            return f"its input size {in_} is not a multiple of the group size {fmt.group_size}"
        return None

    def shapes(self, fmt: LinearFormat, out: int, in_: int) -> Shapes:
        g = n_groups(in_, fmt.group_size)
        return {".qweight": ((in_, out // 8), torch.int32), ".qzeros": ((g, out // 8), torch.int32),
                ".scales": ((g, out), torch.float16)}

    def dequantize(self, fmt: LinearFormat, parts: dict[str, torch.Tensor], out: int, in_: int) -> torch.Tensor:
        size = in_ if fmt.group_size == -1 else fmt.group_size
        q = self.unpack(parts[".qweight"], out)                                    # [..., in, out]
        z = self.unpack(parts[".qzeros"], out).repeat_interleave(size, -2)         # [..., in, out]
        s = parts[".scales"].float().repeat_interleave(size, -2)
        return ((q - z).float() * s).transpose(-1, -2)

    def quantize(self, fmt: LinearFormat, w: torch.Tensor) -> dict[str, torch.Tensor]:
        grouped, size = _grouped(w, fmt.group_size)                                # [..., G, out, size]
        scale, zero = minmax_params(grouped, 4, sym=False, scale_dtype=torch.float16)   # [..., G, out]
        q = round_q(w, _expand(scale, size), _expand(zero, size), 4)                 # [..., out, in]
        return {".qweight": self.pack(q.transpose(-1, -2)), ".qzeros": self.pack(zero.to(torch.int32)),
                ".scales": scale.half()}

    def unpack(self, words: torch.Tensor, out: int) -> torch.Tensor:
        slots = unpack(words, 4, out).unflatten(-1, (-1, 8))                       # [..., out/8, slot]
        return slots[..., list(AWQ_REVERSE)].flatten(-2)

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        return pack(values.unflatten(-1, (-1, 8))[..., list(AWQ_ORDER)].flatten(-2), 4)

    def describe(self, fmt: LinearFormat) -> str:
        return f"awq int4 {'channel' if fmt.group_size == -1 else f'g{fmt.group_size}'}"


def _expand(t: torch.Tensor, size: int) -> torch.Tensor:
    """Per-group [..., G, out] -> per-weight [..., out, G * size]."""
    return t.transpose(-1, -2).repeat_interleave(size, -1)


class CompressedInt:
    marker = ".weight_packed"

    def parts(self, fmt: LinearFormat) -> tuple[str, ...]:
        zp = () if fmt.sym else (".weight_zero_point",)
        return (".weight_packed", ".weight_scale", ".weight_shape", *zp)

    def problem(self, fmt: LinearFormat, out: int, in_: int) -> str | None:
        if fmt.group_size != -1 and in_ % fmt.group_size:
            return f"its input size {in_} is not a multiple of the group size {fmt.group_size}"
        return None

    def shapes(self, fmt: LinearFormat, out: int, in_: int) -> Shapes:
        per, g = 32 // fmt.bits, n_groups(in_, fmt.group_size)
        shapes = {".weight_packed": ((out, -(-in_ // per)), torch.int32),
                  ".weight_scale": ((out, g), fmt.scale_dtype), ".weight_shape": ((2,), torch.int64)}
        if not fmt.sym:
            shapes[".weight_zero_point"] = ((-(-out // per), g), torch.int32)
        return shapes

    def dequantize(self, fmt: LinearFormat, parts: dict[str, torch.Tensor], out: int, in_: int) -> torch.Tensor:
        size = in_ if fmt.group_size == -1 else fmt.group_size
        q = unpack(parts[".weight_packed"], fmt.bits, in_)                          # [..., out, in], offset
        s = parts[".weight_scale"].float().repeat_interleave(size, -1)
        if fmt.sym:
            return (q - (1 << (fmt.bits - 1))).float() * s
        z = unpack(parts[".weight_zero_point"].transpose(-1, -2), fmt.bits, out)   # [..., G, out], offset
        return (q - z.transpose(-1, -2).repeat_interleave(size, -1)).float() * s

    def quantize(self, fmt: LinearFormat, w: torch.Tensor) -> dict[str, torch.Tensor]:
        out, in_ = w.shape[-2:]
        grouped, size = _grouped(w, fmt.group_size)                                # [..., G, out, size]
        scale, zero = minmax_params(grouped, fmt.bits, fmt.sym, fmt.scale_dtype)   # [..., G, out]
        q = round_q(w, _expand(scale, size), _expand(zero, size), fmt.bits)        # unsigned, [..., out, in]
        parts = {".weight_packed": pack(q, fmt.bits),
                 ".weight_scale": scale.transpose(-1, -2).to(fmt.scale_dtype).contiguous(),
                 ".weight_shape": torch.tensor([out, in_], device=w.device).expand(*w.shape[:-2], 2).contiguous()}
        if not fmt.sym:
            parts[".weight_zero_point"] = pack(zero.to(torch.int32), fmt.bits).transpose(-1, -2).contiguous()
        return parts

    def describe(self, fmt: LinearFormat) -> str:
        g = "channel" if fmt.group_size == -1 else f"g{fmt.group_size}"
        return f"ct-int int{fmt.bits} {g} {'sym' if fmt.sym else 'asym'}"


GPTQ, AWQ, CT_INT = Gptq(), Awq(), CompressedInt()
