"""The quantized layouts `tandem quantize` and the benchmarks write, by name (no torch import:
the command line lists them in its help)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.quant.formats import LinearFormat

# name -> (LinearFormat name, its fields); group sizes as the models people deploy publish them
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "fp8-block": ("fp8-block", {}),                       # DeepSeek-V3 / Kimi-K2 / GLM-4.5-FP8: 128x128 blocks
    "gptq-int4": ("gptq", {"bits": 4, "group_size": 128, "sym": True, "desc_act": False}),
    "gptq-int4-act": ("gptq", {"bits": 4, "group_size": 32, "sym": False, "desc_act": True}),
    "gptq-int8": ("gptq", {"bits": 8, "group_size": 128, "sym": True, "desc_act": False}),
    "awq-int4": ("awq", {"group_size": 128}),
    "ct-w4a16": ("ct-int", {"bits": 4, "group_size": 128, "sym": True}),
    "ct-w8a16": ("ct-int", {"bits": 8, "group_size": 128, "sym": True}),
    "ct-fp8": ("ct-fp8", {}),
    "mxfp4": ("mxfp4", {}),
}


def preset(name: str, group_size: int | None = None) -> LinearFormat:
    """The format `name` stands for (with another `group_size` where the format has groups).
    Raises ValueError naming the presets for another name, or a group size the format lacks."""
    from engine.quant.formats import format_named
    if name not in PRESETS:
        raise ValueError(f"unknown quantized format {name!r}; choose one of {', '.join(sorted(PRESETS))}")
    kind, fields = PRESETS[name]
    if group_size is not None:
        if "group_size" not in fields:
            raise ValueError(f"{name} has no groups: --group-size applies to "
                             f"{', '.join(n for n, (_, f) in PRESETS.items() if 'group_size' in f)}")
        fields = {**fields, "group_size": group_size}
    return format_named(kind, **fields)
