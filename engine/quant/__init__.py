"""Quantized checkpoint formats: codecs for the published layouts (see engine/quant/formats.py)."""

from engine.quant.formats import LinearFormat, QuantConfig, format_named, quant_config, quantization_config_for

__all__ = ["LinearFormat", "QuantConfig", "format_named", "quant_config", "quantization_config_for"]
