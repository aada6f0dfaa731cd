"""Expert weights as the MoE kernels read them: plain tensors, or quantized in their
published parts.

A MoE layer's experts are two weights, w13 [N, 2I, H] (gate rows, then up rows) and
w2 [N, H, I], over N experts (the host store: N = E) or slots (N = K).  Each is either

  * a plain tensor, or
  * an `ExpertLinear`: the checkpoint's own quantized tensors of one linear, stacked over the
    N experts (`QuantStack`), or several joined into w13 (`JoinedRows`: gate then up; or
    gpt-oss's interleaved gate_up).

The kernels ask only for dense weights of the experts they use (`dense_at`) or of all N
(`dense_all`); a quantized weight is dequantized there, in fp32 and then cast to the compute
dtype, so the result for one expert never depends on which others share the call, and paged
and resident experts (the same kernels) stay bit-identical.  A page-in copies `tensors_of(w)`
slot by slot: the quantized bytes, every part of the expert.

    QuantStack.parts[s]: [N, ...]  one published tensor (qweight, scales, zeros, g_idx, ...)
    dense_at(w, idx):    [n, out, in] in the compute dtype, for expert/slot ids idx [n]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Union

import torch

from engine.quant.traced import dequantize

if TYPE_CHECKING:
    from engine.quant.formats import LinearFormat


class ExpertLinear(Protocol):
    """One quantized expert weight over N experts or slots (see the module doc)."""

    @property
    def shape(self) -> tuple[int, int, int]:
        """The dense shape [N, out, in]."""
        ...

    def tensors(self) -> list[torch.Tensor]:
        """The stored tensors, [N, ...] each, in a fixed order (a page-in copies them all)."""
        ...

    def at(self, idx: torch.Tensor) -> torch.Tensor:
        """The dense weights of experts `idx` [n]: fp32 [n, out, in]."""
        ...

    def empty(self, num: int, device: torch.device | str) -> "ExpertLinear":
        """The same layout for `num` experts on `device`, uninitialised (device slots)."""
        ...

    def pinned(self) -> "ExpertLinear":
        """The same tensors in page-locked host memory."""
        ...

    def describe(self) -> str:
        """The format, for logs and metrics (e.g. "gptq int4 g128")."""
        ...


ExpertWeight = Union[torch.Tensor, ExpertLinear]


class QuantStack:
    """One linear [out, in] of N experts in `fmt`'s published parts, each stacked over the experts."""

    def __init__(self, fmt: LinearFormat, parts: dict[str, torch.Tensor], out: int, in_: int) -> None:
        missing = [s for s in fmt.parts() if s not in parts]
        if missing or len(parts) != len(fmt.parts()):
            raise ValueError(f"{fmt.describe()} weight needs parts {list(fmt.parts())}, got {sorted(parts)}")
        counts = {t.shape[0] for t in parts.values()}
        if len(counts) != 1:
            raise ValueError(f"parts of one quantized expert weight disagree on the expert count: {sorted(counts)}")
        self.fmt, self.parts, self.out, self.in_ = fmt, parts, out, in_

    @property
    def shape(self) -> tuple[int, int, int]:
        return next(iter(self.parts.values())).shape[0], self.out, self.in_

    def tensors(self) -> list[torch.Tensor]:
        return [self.parts[s] for s in self.fmt.parts()]

    def at(self, idx: torch.Tensor) -> torch.Tensor:
        return dequantize(self.fmt, {s: t.index_select(0, idx) for s, t in self.parts.items()}, self.out, self.in_)

    def empty(self, num: int, device: torch.device | str) -> "QuantStack":
        return QuantStack(self.fmt, {s: torch.empty((num, *t.shape[1:]), dtype=t.dtype, device=device)
                                     for s, t in self.parts.items()}, self.out, self.in_)

    def pinned(self) -> "QuantStack":
        return QuantStack(self.fmt, {s: t.pin_memory() for s, t in self.parts.items()}, self.out, self.in_)

    def describe(self) -> str:
        return self.fmt.describe()


class JoinedRows:
    """w13 from quantized linears of the same input: their rows one after another (gate, then
    up), or, `interleaved`, one fused gate_up whose even rows are gate and odd rows up (gpt-oss)."""

    def __init__(self, linears: list[ExpertLinear], interleaved: bool = False) -> None:
        if interleaved != (len(linears) == 1):
            raise ValueError("an interleaved gate_up is one linear; joined rows are several")
        n, _, h = linears[0].shape
        if any(w.shape[0] != n or w.shape[2] != h for w in linears):
            raise ValueError(f"joined linears must share the expert count and input: {[w.shape for w in linears]}")
        self.linears, self.interleaved = linears, interleaved

    @property
    def shape(self) -> tuple[int, int, int]:
        n, _, h = self.linears[0].shape
        return n, sum(w.shape[1] for w in self.linears), h

    def tensors(self) -> list[torch.Tensor]:
        return [t for w in self.linears for t in w.tensors()]

    def at(self, idx: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            w = self.linears[0].at(idx)                         # [n, 2I, H]: gate, up, gate, up, ...
            return torch.cat((w[:, 0::2], w[:, 1::2]), dim=1)
        return torch.cat([w.at(idx) for w in self.linears], dim=1)

    def empty(self, num: int, device: torch.device | str) -> "JoinedRows":
        return JoinedRows([w.empty(num, device) for w in self.linears], self.interleaved)

    def pinned(self) -> "JoinedRows":
        return JoinedRows([w.pinned() for w in self.linears], self.interleaved)

    def describe(self) -> str:
        return self.linears[0].describe()


# ---- what the kernels and the slots call: one function per question, for either kind ------

def dense_at(w: ExpertWeight, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense weights of experts/slots `idx` [n] in `dtype`: [n, out, in]."""
    if isinstance(w, torch.Tensor):
        return w.index_select(0, idx)
    return w.at(idx).to(dtype)


def dense_rows(w: ExpertWeight, rows: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """The dense weight [out, in] of each expert/slot in `rows`, in `dtype`: views of a plain
    weight, one dequantization of all of them for a quantized one."""
    if isinstance(w, torch.Tensor):
        return [w[i] for i in rows]
    if not rows:
        return []
    return list(w.at(torch.tensor(rows, device=w.tensors()[0].device)).to(dtype).unbind(0))


def dense_all(w: ExpertWeight, dtype: torch.dtype) -> torch.Tensor:
    """The dense weights of all N experts/slots in `dtype`: [N, out, in]."""
    if isinstance(w, torch.Tensor):
        return w
    return w.at(torch.arange(w.shape[0], device=w.tensors()[0].device)).to(dtype)


def num_rows(w: ExpertWeight) -> int:
    """N: the experts (or slots) `w` holds."""
    return w.shape[0]


def tensors_of(w: ExpertWeight) -> list[torch.Tensor]:
    """The tensors that hold `w`, [N, ...] each (a plain weight is one)."""
    return [w] if isinstance(w, torch.Tensor) else w.tensors()


def empty_like(w: ExpertWeight, num: int, device: torch.device | str) -> ExpertWeight:
    """Room for `num` experts of `w`'s layout on `device`."""
    if isinstance(w, torch.Tensor):
        return torch.empty((num, *w.shape[1:]), dtype=w.dtype, device=device)
    return w.empty(num, device)


def pinned(w: ExpertWeight) -> ExpertWeight:
    """`w` in page-locked host memory."""
    return w.pin_memory() if isinstance(w, torch.Tensor) else w.pinned()


def weight_format(w: ExpertWeight) -> str:
    """The storage format of `w`: its dtype for a plain weight ("bfloat16"), else the quantized format."""
    return str(w.dtype).removeprefix("torch.") if isinstance(w, torch.Tensor) else w.describe()
