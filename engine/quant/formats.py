"""The published quantized weight layouts, as one interface (see engine/quant/__init__.py).

    LinearFormat             how one quantized linear is stored; parts, shapes, check,
                             dequantize (float32, pure tensor ops) and quantize (the packer)
    format_named             a LinearFormat by name and settings
    QuantConfig              config.json's quantization_config, read
    quant_config             config.json dict -> QuantConfig | None, refusing what is not supported
    quantization_config_for  LinearFormat -> the quantization_config a checkpoint in it carries

Formats: "fp8-block" (DeepSeek-V3), "gptq" (v1 and v2, 4/8 bit, desc_act), "awq" (GEMM),
"ct-int" and "ct-fp8" (compressed-tensors pack-quantized and float-quantized), "mxfp4" (gpt-oss).
"""

from engine.quant.config import QuantConfig, quant_config, quantization_config_for
from engine.quant.linear import LinearFormat, format_named

__all__ = ["LinearFormat", "QuantConfig", "format_named", "quant_config", "quantization_config_for"]
