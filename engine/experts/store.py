"""One MoE layer's experts in host memory (all E of them), and the counters of their paging.

    store.w13: [E, 2I, H]  store.w2: [E, H, I]   (host; pinned on CUDA)
    b13:       [E, 2I]     b2:       [E, H]      (only with biases: gpt-oss)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.kernels.fused_moe import ClampedSwiGLU
from engine.quant.stack import ExpertWeight, num_rows, tensors_of, weight_format


@dataclass
class ExpertCounters:
    hits: int = 0            # needed experts already resident when the step began
    misses: int = 0          # needed experts paged in by the step
    bytes_paged: int = 0     # page-ins and prefetches together
    waves: int = 0
    steps: int = 0
    prefetched: int = 0      # experts copied ahead of their step by the prefetcher
    prefetch_hits: int = 0   # ... that their step did need
    prefetch_wasted_bytes: int = 0
    corrupt_slots: int = 0   # verify mode: slots found not holding their expert's bytes (re-paged)

    def as_dict(self) -> dict[str, int | float]:
        d = dict(self.__dict__)
        looked = self.hits + self.misses
        d["hit_rate"] = self.hits / looked if looked else 0.0
        return d


@dataclass
class ExpertStore:
    """All E experts of one layer in host memory."""
    w13: ExpertWeight   # [E, 2I, H]
    w2: ExpertWeight    # [E, H, I]
    fingerprints: list[int] = field(default_factory=list)  # per expert, from the checkpoint
    b13: torch.Tensor | None = None     # [E, 2I] gate then up biases (gpt-oss), or None
    b2: torch.Tensor | None = None      # [E, H] down bias, or None
    act: ClampedSwiGLU | None = None    # the experts' gated activation (None: silu)

    @property
    def num_experts(self) -> int:
        return num_rows(self.w13)

    @property
    def format(self) -> str:
        """How the experts are stored: a dtype ("bfloat16") or a quantized format ("gptq int4 g128")."""
        return weight_format(self.w13)

    def __post_init__(self) -> None:
        if (self.b13 is None) != (self.b2 is None):
            raise ValueError("expert biases come in pairs: b13 and b2, or neither")
        if self.b13 is not None and self.b2 is not None:
            e, i2, h = self.w13.shape
            if self.b13.shape != (e, i2) or self.b2.shape != (e, h):
                raise ValueError(f"expert biases {tuple(self.b13.shape)}, {tuple(self.b2.shape)} do not fit "
                                 f"w13 {tuple(self.w13.shape)}: expected {(e, i2)}, {(e, h)}")
        self.bytes_per_expert = sum(t.numel() * t.element_size() for t in self.expert(0))

    def expert(self, e: int) -> list[torch.Tensor]:
        """Every tensor of expert `e`, in fingerprint order: w13's, w2's[, b13, b2]."""
        return [t[e] for t in self.tensors()]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the store, [E, ...] each, in fingerprint order."""
        out = tensors_of(self.w13) + tensors_of(self.w2)
        if self.b13 is not None and self.b2 is not None:
            out += [self.b13, self.b2]
        return out
