"""Quantized base layers (QLoRA-MCL): which quantization backends adapters may wrap, the dtype a quantized layer
computes in, its stored state (for the base-weights fingerprint), and the quantizations ``load_model`` applies
(merging into such a layer: ``peft_interop.merge_hypothesis``).

Supported: bitsandbytes 4-bit ``Linear4bit`` (nf4 and fp4, with or without double quantization, any compute dtype),
bitsandbytes 8-bit ``Linear8bitLt`` (LLM.int8) and torchao int8 weight-only (an ``nn.Linear`` whose weight is a
torchao ``Int8Tensor`` without activation quantization), as transformers loads them through its
``quantization_config``. ``MCLLoraLinear`` computes ``base_layer(x)`` (the backend's own kernel) plus the stacked
adapters, which live in the layer's compute dtype (or float32) on its device: never in its storage dtype.

Every other layer whose weight is no plain floating-point tensor is refused (``build.refuse_quantized``):
e.g. optimum-quanto's layers, whose weight PEFT's merge silently leaves unchanged.

bitsandbytes and torchao are imported only when a model holds one of their layers (found by the class's module).
"""

from __future__ import annotations

from typing import get_args

import torch
from torch import nn

from loramcl.utils.inputs import Quantization

BNB_4BIT, BNB_8BIT, TORCHAO_INT8 = "bitsandbytes 4-bit", "bitsandbytes 8-bit", "torchao int8 weight-only"
SUPPORTED = ("supported quantized layers: bitsandbytes 4-bit (nf4, fp4, double quantization) and 8-bit (LLM.int8), "
             "torchao int8 weight-only (Int8WeightOnlyConfig), loaded through transformers' quantization_config")
# Merging hypothesis k into these layers rounds the merged weight to the backend's grid again. int8 keeps each row's
# scale and rounds to 1/127 of it: the merge is as exact as the quantized base itself (PEFT's merge does the same).
# 4-bit rounds to 16 levels per block of 64: a small update is mostly lost, so such a merge warns with its effect.
LOSSY_MERGE = (BNB_4BIT,)


def quantization_backend(module: nn.Module) -> str | None:
    """The supported backend of ``module`` (BNB_4BIT, BNB_8BIT, TORCHAO_INT8), or None (a plain layer, or an
    unsupported one)."""
    origin = type(module).__module__
    if origin == "bitsandbytes" or origin.startswith("bitsandbytes."):
        import bitsandbytes as bnb

        if isinstance(module, bnb.nn.Linear4bit):
            return BNB_4BIT
        if isinstance(module, bnb.nn.Linear8bitLt):
            return BNB_8BIT
        return None
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.Linear) and type(weight).__module__.startswith("torchao."):
        from torchao.quantization import Int8Tensor

        # weight-only: activations stay in floating point, so the adapters' input is the layer's input
        if isinstance(weight, Int8Tensor) and getattr(weight, "act_quant_kwargs", None) is None:
            return TORCHAO_INT8
    return None


def unusable_here(module: nn.Module) -> str | None:
    """Why a supported quantized ``module`` cannot run where it is, or None. bitsandbytes' 4-bit CPU inference
    kernels (x86-64 with AVX512-BF16) repack the codes in blocks of ``blocksize`` input values at the first call
    without gradients, and fail on a layer whose input width is no multiple of it (with a shape error)."""
    if quantization_backend(module) != BNB_4BIT or module.weight.device.type != "cpu":
        return None
    blocksize = module.weight.quant_state.blocksize
    if getattr(module, "support_avx512bf16_for_cpu", False) and module.in_features % blocksize:
        return (f"Linear4bit of input width {module.in_features}: bitsandbytes' 4-bit CPU kernels need a multiple "
                f"of its block size {blocksize} (real models' widths are; use int8 on the CPU, or a GPU)")
    return None


def compute_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype ``layer`` computes its output in, which adapters with ``adapter_dtype='base'`` take (never the
    uint8/int8 storage dtype of a quantized weight)."""
    backend = quantization_backend(layer)
    if backend == BNB_4BIT:  # compute_dtype None: bitsandbytes takes the input's; the weight's original dtype then
        return layer.compute_dtype or layer.weight.quant_state.dtype
    if backend == BNB_8BIT:  # its int8 matmul takes float16 inputs (bitsandbytes casts them) unless a bias says
        return layer.bias.dtype if layer.bias is not None else torch.float16
    return layer.weight.dtype  # a plain layer; torchao's Int8Tensor reports the dtype it dequantizes to


def quantized_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The stored codes and quantization state of a quantized ``module``, as plain tensors by name: what its weights
    are (the base-weights fingerprint hashes them). bitsandbytes: from its state dict (the codes in the layout it
    saves them, whatever layout its CPU kernels repacked them to); 8-bit: the int8 codes and each row's scale;
    4-bit: the codes and the quantization map (nf4 or fp4's 16 values), not the block scales: bitsandbytes 0.50's
    CPU kernels round them to bfloat16 in place at the first inference (and requantize them with double
    quantization), so they are no stable part of the layer. torchao: the tensors the weight is made of (int8 codes,
    scales, zero points)."""
    backend = quantization_backend(module)
    if backend == BNB_4BIT:
        return {name: value for name, value in module.state_dict().items()
                if name in ("weight", "weight.quant_map", "bias")}
    if backend == BNB_8BIT:
        return {name: value for name, value in module.state_dict().items() if name in ("weight", "SCB", "bias")}
    if backend == TORCHAO_INT8:
        weight = module.weight
        parts, _ = weight.__tensor_flatten__()
        state = {f"weight.{part}": getattr(weight, part) for part in parts}
        if module.bias is not None:
            state["bias"] = module.bias
        return state
    raise TypeError(f"{type(module).__name__} is not a supported quantized layer ({SUPPORTED})")


# `load_model(quantization=...)` and `loramcl train --quantization`: the names, each a transformers quantization_config
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)


def quantization_config(name: str, dtype: torch.dtype):
    """The transformers ``quantization_config`` of ``name`` (one of ``QUANTIZATIONS``), computing in ``dtype``.
    nf4 is QLoRA's recipe (NormalFloat4 with double quantization of the block scales); fp4 the same with 4-bit
    floats; int8 is LLM.int8 (bitsandbytes); torchao-int8 is torchao's int8 weight-only."""
    from transformers import BitsAndBytesConfig, TorchAoConfig

    if name in ("nf4", "fp4"):
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=name, bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=dtype)
    if name == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    if name == "torchao-int8":
        from torchao.quantization import Int8WeightOnlyConfig

        return TorchAoConfig(Int8WeightOnlyConfig())
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {name!r}")


def norms_in_float32(model: nn.Module) -> int:
    """Cast the float16/bfloat16 parameters of ``model``'s normalization layers to float32 (what of PEFT's
    ``prepare_model_for_kbit_training`` helps training on a low-precision quantized base: the norms' statistics in
    float32); returns how many tensors were cast. PEFT also casts the embeddings and LM head, doubling their memory
    (0.5 GB more on a 7B Llama); they stay in the compute dtype here."""
    cast = 0
    for module in model.modules():
        if isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(("RMSNorm", "LayerNorm", "Norm")):
            for param in module.parameters(recurse=False):
                if param.dtype in (torch.float16, torch.bfloat16):
                    param.data = param.data.float()
                    cast += 1
    return cast
