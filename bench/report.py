"""How every benchmark prints its result: JSON with --json, else one aligned line per key."""

from __future__ import annotations

import json


def emit(result: dict, as_json: bool, width: int = 24) -> None:
    if as_json:
        print(json.dumps(result, indent=2))
        return
    for key, value in result.items():
        print(f"{key:{width}s} {value:.3f}" if isinstance(value, float) else f"{key:{width}s} {value}")
