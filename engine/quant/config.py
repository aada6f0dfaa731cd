"""Reading (and writing) config.json's `quantization_config`: which `LinearFormat` a checkpoint uses.

`quant_config` accepts the published settings each format's own loaders accept and refuses the rest
by name, listing what is supported; `quantization_config_for` writes the dict a checkpoint packed in
a format carries, so `quant_config({"quantization_config": quantization_config_for(f)}).format == f`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from engine.checkpoint import CheckpointError
from engine.quant.linear import LinearFormat

KEY = "config.json quantization_config"
CT_WEIGHT_SCHEMES = {("int", "pack-quantized"), ("float", "float-quantized")}


@dataclass(frozen=True)
class QuantConfig:
    method: str                      # quantization_config.quant_method
    format: LinearFormat             # the one weight format of the checkpoint's quantized linears
    not_converted: tuple[str, ...]   # module name patterns left unquantized (modules_to_not_convert / ignore)

    def describe(self) -> str:
        skip = f", not converted: {', '.join(self.not_converted)}" if self.not_converted else ""
        return f"{self.method} ({self.format.describe()}{skip})"


def refuse(key: str, value: object, supported: Sequence[object] | str) -> CheckpointError:
    listed = supported if isinstance(supported, str) else ", ".join(repr(s) for s in supported)
    return CheckpointError(f"{KEY}.{key}={value!r} is not supported (supported: {listed})")


def pick(q: dict, key: str, default: Any, supported: Sequence[object], at: str = "") -> Any:
    """q[key] (or `default`) when it is one of `supported`; `at` is the path to q inside quantization_config."""
    value = q.get(key, default)
    if value not in supported:
        raise refuse(at + key, value, supported)
    return value


def group_size(q: dict, key: str = "group_size", at: str = "") -> int:
    value = q.get(key, 128)
    if not isinstance(value, int) or isinstance(value, bool) or not (value == -1 or value > 0):
        raise refuse(at + key, value, "-1 (one group per row) or a positive size")
    return value


def _fp8(q: dict) -> LinearFormat:
    pick(q, "fmt", "e4m3", ("e4m3",))
    pick(q, "activation_scheme", "dynamic", ("dynamic",))
    block = q.get("weight_block_size") or [128, 128]
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise refuse("weight_block_size", block, "[rows, cols] of positive sizes")
    return LinearFormat("fp8-block", block=(block[0], block[1]))


def _gptq(q: dict) -> LinearFormat:
    if q.get("is_marlin_format"):
        raise refuse("is_marlin_format", True, (False,))
    if q.get("dynamic"):
        raise refuse("dynamic", q["dynamic"], "none: per-module overrides give the linears differing formats")
    version = q.get("checkpoint_format") or q.get("format") or "gptq"
    if version not in ("gptq", "gptq_v2"):
        raise refuse("checkpoint_format", version, ("gptq", "gptq_v2"))
    return LinearFormat("gptq", bits=pick(q, "bits", None, (4, 8)), group_size=group_size(q),
                        sym=bool(q.get("sym", True)), desc_act=bool(q.get("desc_act", False)),
                        checkpoint_format=version)


def _awq(q: dict) -> LinearFormat:
    pick(q, "version", "gemm", ("gemm",))
    pick(q, "backend", "autoawq", ("autoawq",))
    pick(q, "zero_point", True, (True,))
    bits = pick(q, "bits" if "bits" in q else "w_bit", 4, (4,))            # AutoAWQ's own names as fallbacks
    size = group_size(q, "group_size" if "group_size" in q else "q_group_size")
    return LinearFormat("awq", bits=bits, group_size=size)


def _mxfp4(q: dict) -> LinearFormat:
    return LinearFormat("mxfp4")


def _compressed(q: dict) -> LinearFormat:
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if q.get(key):
            raise refuse(key, q[key], "none: only the weights may be quantized, dense and unrotated")
    schemes = [_ct_scheme(name, s, q.get("format")) for name, s in sorted((q.get("config_groups") or {}).items())]
    if not schemes:
        raise refuse("config_groups", q.get("config_groups"), "one group of weight settings")
    if any(s != schemes[0] for s in schemes):
        raise refuse("config_groups", [f.describe() for f in schemes], "one weight format for every group")
    return schemes[0]


def _ct_scheme(name: str, scheme: dict, default_format: str | None) -> LinearFormat:
    key = f"config_groups.{name}"
    if not isinstance(scheme, dict):
        raise refuse(key, scheme, "a scheme written out as {targets, weights, input_activations, ...}")
    if scheme.get("output_activations"):
        raise refuse(f"{key}.output_activations", scheme["output_activations"], (None,))
    w = scheme.get("weights") or {}
    fmt = scheme.get("format") or default_format
    wtype = w.get("type", "int")
    if (wtype, fmt) not in CT_WEIGHT_SCHEMES:
        raise refuse(f"{key} (weights.type, format)", (wtype, fmt), sorted(CT_WEIGHT_SCHEMES))
    at = f"{key}.weights."
    pick(w, "dynamic", False, (False,), at)
    if wtype == "float":
        return _ct_fp8(key, w, scheme.get("input_activations"))
    if scheme.get("input_activations"):
        raise refuse(f"{key}.input_activations", scheme["input_activations"],
                     "null: integer weights with unquantized activations (W4A16, W8A16)")
    pick(w, "actorder", None, (None, False, "weight", "static"), at)      # "group" would need weight_g_idx
    strategy = pick(w, "strategy", "group", ("group", "channel"), at)
    size = -1 if strategy == "channel" else group_size(w, at=at)
    return LinearFormat("ct-int", bits=pick(w, "num_bits", 8, (4, 8), at), group_size=size,
                        sym=pick(w, "symmetric", True, (True, False), at))


def _ct_fp8(key: str, w: dict, acts: dict | None) -> LinearFormat:
    at = f"{key}.weights."
    pick(w, "num_bits", 8, (8,), at)
    pick(w, "symmetric", True, (True,), at)
    if acts is not None:
        setting = (acts.get("type"), acts.get("num_bits"), acts.get("dynamic"))
        if setting != ("float", 8, True):
            raise refuse(f"{key}.input_activations (type, num_bits, dynamic)", setting,
                         "null, or ('float', 8, True): FP8 activations quantized at run time")
    return LinearFormat("ct-fp8", strategy=pick(w, "strategy", "tensor", ("channel", "tensor"), at))


PARSERS: dict[str, Callable[[dict], LinearFormat]] = {
    "fp8": _fp8, "gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed, "mxfp4": _mxfp4,
}


def quant_config(raw: dict) -> QuantConfig | None:
    """The QuantConfig of a config.json dict, None when it has no `quantization_config`.  Raises
    CheckpointError naming the unsupported setting (method, bits, group size, activation scheme,
    strategy, packing version, differing config_groups ...) and the supported values."""
    q = raw.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method not in PARSERS:
        raise refuse("quant_method", method, list(PARSERS))
    skip = q.get("ignore") if method == "compressed-tensors" else q.get("modules_to_not_convert")
    return QuantConfig(method, PARSERS[method](q), tuple(skip or ()))


def quantization_config_for(fmt: LinearFormat, not_converted: Sequence[str] = ()) -> dict:
    """The config.json `quantization_config` of a checkpoint written in `fmt` (inverse of quant_config)."""
    skip = list(not_converted)
    if fmt.name == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(fmt.block), "modules_to_not_convert": skip}
    if fmt.name == "gptq":
        return {"quant_method": "gptq", "bits": fmt.bits, "group_size": fmt.group_size, "sym": fmt.sym,
                "desc_act": fmt.desc_act, "checkpoint_format": fmt.checkpoint_format,
                "modules_to_not_convert": skip}
    if fmt.name == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": fmt.group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": skip}
    if fmt.name == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": skip}
    return {"quant_method": "compressed-tensors", "format": _ct_weights(fmt)[0], "ignore": skip,
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": _ct_weights(fmt)[1],
                                          "input_activations": _ct_activations(fmt), "output_activations": None}}}


def _ct_weights(fmt: LinearFormat) -> tuple[str, dict]:
    if fmt.name == "ct-fp8":
        return "float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": fmt.strategy,
                                   "group_size": None, "dynamic": False}
    grouped = fmt.group_size != -1
    return "pack-quantized", {"num_bits": fmt.bits, "type": "int", "symmetric": fmt.sym,
                              "strategy": "group" if grouped else "channel",
                              "group_size": fmt.group_size if grouped else None, "dynamic": False}


def _ct_activations(fmt: LinearFormat) -> dict | None:
    if fmt.name != "ct-fp8":
        return None
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
