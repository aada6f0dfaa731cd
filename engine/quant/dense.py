"""Dense linears kept in their published quantized parts: attention projections, shared experts
and dense MLPs, where the checkpoint quantizes them (routed experts are engine/quant/stack.py's).

    QuantLinear    one linear [out, in] as the checkpoint stores it: a LinearFormat and its parts
    JoinedLinear   linears of one input whose outputs are concatenated, each plain or quantized
                   (q, k, v -> qkv; gate, up -> w13), fused the way the loader fuses plain weights
    DenseWeight    a plain tensor, a QuantLinear or a JoinedLinear
    linear         y = x @ w.T + b for any of them
    join_rows      the fused weight of several (torch.cat when every one is plain)
    take_linear    pop a linear from the loader's tensors, quantized or plain

Where a quantized linear runs is fixed by where its parts are: on CUDA the Triton kernel
(engine/kernels/triton/quant_linear.py) reads the parts and dequantizes tile by tile, through a
custom op that torch.compile and CUDA graphs treat as one call; elsewhere F.linear runs over the
codec's dequantization (fp32, then the compute dtype) of the whole, joined weight, made per call,
which is bit for bit the weight the loader would have dequantized at start-up.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import torch
import torch.nn.functional as F

from engine.kernels.quant_consts import format_consts
from engine.quant.traced import dequantize

if TYPE_CHECKING:
    from engine.quant.formats import LinearFormat


@dataclass(frozen=True, eq=False)
class QuantLinear:
    """One linear [out, in_] in `fmt`'s published parts (no leading dims)."""
    fmt: LinearFormat
    parts: dict[str, torch.Tensor]
    out: int
    in_: int

    @property
    def consts(self) -> list[int]:
        """The Triton kernel's format constants (engine/kernels/quant_consts.py CONST_NAMES order)."""
        return list(format_consts(self.fmt, self.in_).values())

    @property
    def shape(self) -> tuple[int, int]:
        return self.out, self.in_

    @property
    def device(self) -> torch.device:
        return next(iter(self.parts.values())).device

    def tensors(self) -> list[torch.Tensor]:
        """The stored parts, in the format's order."""
        return [self.parts[s] for s in self.fmt.parts()]

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The codec's dequantization [out, in_] (fp32), cast to `dtype`."""
        return dequantize(self.fmt, self.parts, self.out, self.in_).to(dtype)


@dataclass(frozen=True, eq=False)
class JoinedLinear:
    """Linears of one input, their output rows one after another (at least one quantized)."""
    linears: tuple[Union[torch.Tensor, QuantLinear], ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(w.shape[0] for w in self.linears), self.linears[0].shape[1]

    @property
    def device(self) -> torch.device:
        return self.linears[0].device

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([w.to(dtype) if isinstance(w, torch.Tensor) else w.dense(dtype) for w in self.linears])


DenseWeight = Union[torch.Tensor, QuantLinear, JoinedLinear]


def join_rows(weights: list[DenseWeight]) -> DenseWeight:
    """The linear whose output is the concatenation of `weights`' outputs (one input size).
    Raises ValueError when their input sizes differ."""
    if len({w.shape[1] for w in weights}) != 1:
        raise ValueError(f"joined linears must share their input size, got {[tuple(w.shape) for w in weights]}")
    if all(isinstance(w, torch.Tensor) for w in weights):
        return torch.cat(weights)  # type: ignore[arg-type]
    flat = [part for w in weights for part in (w.linears if isinstance(w, JoinedLinear) else (w,))]
    return JoinedLinear(tuple(flat))


def linear(x: torch.Tensor, w: DenseWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ w.T (+ b): [..., out], in x's dtype."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, b)
    if w.device.type != "cuda":
        return F.linear(x, w.dense(x.dtype), b)
    return kernel_linear(x, w, b)


def kernel_linear(x: torch.Tensor, w: QuantLinear | JoinedLinear, b: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` through the Triton kernel, one launch per quantized linear (what CUDA runs; the
    interpreter runs it on a CPU, for the tests)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    parts = w.linears if isinstance(w, JoinedLinear) else (w,)
    y = torch.cat([F.linear(x2, p) if isinstance(p, torch.Tensor) else _on_device(x2, p) for p in parts], dim=-1)
    y = y.view(*lead, y.shape[-1])
    return y if b is None else y + b


def _on_device(x: torch.Tensor, w: QuantLinear) -> torch.Tensor:
    """The Triton kernel through `tandem::quant_linear` (engine/kernels/triton/quant_linear.py
    registers it when imported: the loader imports it for a model whose linears it keeps quantized
    on CUDA, and the kernel tests do)."""
    y: torch.Tensor = torch.ops.tandem.quant_linear(x, w.tensors(), w.consts, w.out)
    return y


# the dense linears the families compute through `linear` (and so keep quantized): attention
# projections (MLA's kv_b_proj excepted: the absorbed decode reshapes it per head) and SiLU MLPs
KEPT_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                "gate_proj", "up_proj", "down_proj")


def is_kept_linear(name: str) -> bool:
    """Whether the weight `name` ("model.layers.0.self_attn.q_proj.weight") stays quantized when
    dense linears are kept quantized (a routed expert's never reaches this rule)."""
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and module.rpartition(".")[2] in KEPT_LINEARS


def not_converted(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether a checkpoint's modules_to_not_convert / ignore list names the weight's module (or a
    module above it): globs ("model.layers.*.self_attn") or compressed-tensors' "re:" regexes."""
    module = name.rpartition(".")[0]
    for p in patterns:
        if p.startswith("re:") and re.match(p[3:], module):
            return True
        if fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(module, p + ".*"):
            return True
    return False


def take_linear(t: dict[str, torch.Tensor], name: str) -> DenseWeight:
    """Pop the linear `name` (one `is_kept_linear` names) from the loader's tensors: the
    QuantLinear it kept quantized (engine.quant.load.LoadedTensors.dense), else the plain tensor.
    Raises KeyError when it holds neither."""
    assert is_kept_linear(name), f"{name} is not among KEPT_LINEARS: add it there for preflight to size it"
    kept = getattr(t, "dense", None)
    if kept is not None and name in kept:
        return kept.pop(name)
    return t.pop(name)
