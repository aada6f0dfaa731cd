"""Tandem's model runtime, shared by the prefill and decode workers.

`from engine import LLM, SamplingParams, RequestOutput` works as before, but importing the
package loads nothing heavy: the names are imported on first use (PEP 562), so torch-free
parts (`engine.params`, `engine.config`, `engine.tokenizer`) stay torch-free for the gateway."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.params import SamplingParams
    from engine.request import RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]

_HOME = {"LLM": "engine.llm", "RequestOutput": "engine.request", "SamplingParams": "engine.params"}


def __getattr__(name: str) -> Any:
    """Import `LLM`, `RequestOutput` or `SamplingParams` from its module on first access."""
    if name not in _HOME:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value          # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
