"""PEFT interoperability: a hypothesis leaving the MCL model, exported as a standard PEFT LoRA adapter, merged into
the base weights, or every adapter removed (``unload``). Which layers get adapters (PEFT's target matching) is part
of building (``loramcl.mcl.build``).
"""

from __future__ import annotations

import copy
import os
import warnings

import safetensors.torch
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from loramcl.mcl.adapter_files import writes_here
from loramcl.mcl.compat import peft_quantization_backend, peft_targets
from loramcl.mcl.fingerprint import whole_tensor
from loramcl.mcl.quantization import LOSSY_MERGE, quantization_backend

PEFT_WEIGHTS_NAME = "adapter_model.safetensors"


def export_hypothesis(model, k: int, path: str | os.PathLike, fold_scaling: bool = False,
                      alora_invocation_tokens: list[int] | None = None) -> str:
    """Write hypothesis k of ``model`` as a standard PEFT LoRA adapter folder (``PeftModel.from_pretrained`` loads
    it); refused for a method whose hypotheses are not LoRA adapters (``export_refusal``).

    ``fold_scaling``: the scaling (alpha/r, or alpha/sqrt(r) with rsLoRA) multiplied into lora_B and written as
    ``lora_alpha = r``, ``use_rslora = false``: the same adapter for engines that read alpha only (llama.cpp).
    ``alora_invocation_tokens``: hypotheses trained with ``adapt_context=False`` written as PEFT's activated LoRA,
    where that computes the same model (``activated_lora_refusal``)."""
    if model.export_refusal:
        raise ValueError(model.export_refusal)
    model.check_hypothesis(k)
    if alora_invocation_tokens is None:
        _refuse_position_dependent(model, "exported as a PEFT LoRA adapter", also=", export them as activated "
                                   "LoRA (alora_invocation_tokens=[the token every prompt ends with])")
    elif reason := activated_lora_refusal(model, alora_invocation_tokens):
        raise ValueError(reason)
    lora_config = peft_lora_config(model, fold_scaling, alora_invocation_tokens)
    tensors = hypothesis_tensors(model, k, fold_scaling)  # FSDP2 shards gathered by every rank, as save_pretrained
    if not writes_here(model):
        return str(path)
    os.makedirs(path, exist_ok=True)
    lora_config.save_pretrained(path)
    safetensors.torch.save_file(tensors, os.path.join(path, PEFT_WEIGHTS_NAME), metadata={"format": "pt"})
    return str(path)


def peft_lora_config(model, fold_scaling: bool = False, alora_invocation_tokens: list[int] | None = None):
    """The PEFT ``LoraConfig`` that adapts exactly the layers of ``model`` as its hypotheses do."""
    from peft import LoraConfig

    cfg = model.mcl_config
    is_conv1d = [isinstance(layer.base_layer, Conv1D) for _, layer in model.mcl_layers()]
    if any(is_conv1d) and not all(is_conv1d):
        raise ValueError("cannot export a mix of nn.Linear and Conv1D layers as one PEFT adapter")
    targets = _peft_target_modules(model)
    by_short_names = targets != sorted(model.layer_names)  # then PEFT must apply the same selection options
    return LoraConfig(  # a shared adapter: hypothesis k is one LoRA of rank shared_r + r, scaled by alpha over it
        r=cfg.lora_rank, lora_alpha=cfg.lora_rank if fold_scaling else cfg.alpha, lora_dropout=cfg.dropout, bias="none",
        use_rslora=cfg.use_rslora and not fold_scaling,
        target_modules=targets, fan_in_fan_out=all(is_conv1d), task_type=_peft_task_type(model.base_model),
        exclude_modules=cfg.exclude_modules if by_short_names else None,
        layers_to_transform=cfg.layers_to_transform if by_short_names else None,
        layers_pattern=cfg.layers_pattern if by_short_names else None,
        base_model_name_or_path=getattr(model.config, "_name_or_path", None) or None,
        alora_invocation_tokens=list(alora_invocation_tokens) if alora_invocation_tokens is not None else None,
    )


def hypothesis_tensors(model, k: int, fold_scaling: bool = False) -> dict[str, torch.Tensor]:
    """Hypothesis k's tensors under PEFT's names, lora_A as [r, d_in] and lora_B as [d_out, r] (times the scaling
    with ``fold_scaling``). With a shared adapter of rank s, one LoRA of rank s + r: lora_A = [shared_A | A_k] and
    lora_B = [shared_B ; B_k] concatenated on the rank axis (shared first), so that lora_B @ lora_A = the sum of both
    pairs' products, at the scaling both share."""
    tensors = {}
    for name, layer in model.mcl_layers():
        lora_a, lora_b = whole_tensor(layer.lora_A.detach())[k], whole_tensor(layer.lora_B.detach())[k]
        if layer.shared_r:  # [d_in, s + r], [s + r, d_out]
            lora_a = torch.cat([whole_tensor(layer.shared_A.detach()), lora_a], dim=1)
            lora_b = torch.cat([whole_tensor(layer.shared_B.detach()), lora_b], dim=0)
        lora_b = lora_b * (layer.scaling if fold_scaling else 1)
        tensors[f"base_model.model.{name}.lora_A.weight"] = lora_a.T.contiguous().cpu()
        tensors[f"base_model.model.{name}.lora_B.weight"] = lora_b.T.contiguous().cpu()
    return tensors


def activated_lora_refusal(model, invocation_tokens: list[int]) -> str | None:
    """Why hypothesis weights of ``model`` written as PEFT's activated LoRA with ``invocation_tokens`` would compute
    another model, or None where they compute the same one.

    PEFT's aLoRA (0.21) applies the adapters from the first token of the last occurrence of the invocation sequence
    in the input on; hypotheses trained with ``adapt_context=False`` act from the last prompt token on. The two agree
    for an invocation of exactly one token, the one every prompt ends with (e.g. the last token of the chat
    template's assistant header), on a causal LM."""
    tokens = list(invocation_tokens)
    if model.mcl_config.adapt_context:
        return ("these hypotheses were trained with adapt_context=True: they act at every position, the prompt "
                "included, and activated LoRA would leave the prompt to the base model: export them without "
                "alora_invocation_tokens")
    if getattr(model.config, "is_encoder_decoder", False):
        return ("activated LoRA is for causal LMs (PEFT finds the invocation tokens in input_ids); these context-once "
                "hypotheses adapt an encoder-decoder's whole decoder: decode them with this MCLModel")
    if len(tokens) != 1 or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        return (f"alora_invocation_tokens must be one token id, the token every prompt ends with; got {tokens}: "
                "activated LoRA acts from the first invocation token on, and these hypotheses from the last prompt "
                "token on, so a longer invocation would adapt the tokens before it too")
    return None


def _peft_target_modules(model) -> list[str]:
    """Short layer names (q_proj, ...) when PEFT's matching of them selects exactly our layers, else full names."""
    ours = set(model.layer_names)
    original = [n for n, _ in model.base_model.named_modules()
                if n and not any(n.startswith(layer + ".") for layer in ours)]
    short = sorted({n.rsplit(".", 1)[-1] for n in ours})
    if {n for n in original if peft_targets(model.mcl_config, short, n)} == ours:
        return short
    return sorted(ours)


def merge_hypothesis(model, k: int, inplace: bool = False) -> nn.Module:
    """The base model with hypothesis k merged into its weights (W + alpha/r * (A_k B_k)^T; with a shared adapter
    W + alpha/(s + r) * (A_s B_s + A_k B_k)^T), adapters removed.

    By default the base model is copied first, so the MCL model stays usable (e.g. to merge another k);
    ``inplace=True`` saves the copy's memory on large models and leaves the MCL model unusable. Refused for a method
    whose hypotheses are no single weight update (``merge_refusal``).
    """
    if model.merge_refusal:
        raise ValueError(model.merge_refusal)
    model.check_hypothesis(k)
    _refuse_position_dependent(model, "merged into the base weights")
    quantized: dict[str, nn.Module] = {}  # backend -> one of its layers
    for _, layer in model.mcl_layers():
        if backend := quantization_backend(layer.base_layer):
            quantized.setdefault(backend, layer.base_layer)
    for backend, layer in quantized.items():
        if not peft_quantization_backend(layer, model.base_model).supports_merge:
            raise ValueError(f"hypothesis {k} cannot be merged into {backend} layers: this release of the backend "
                             "cannot requantize a merged weight. Export it (export_hypothesis) and serve it as a "
                             "LoRA adapter on the quantized base, or merge on an unquantized base")
    lossy = sorted(set(quantized) & set(LOSSY_MERGE))
    if not lossy:
        return _remove_adapters(model, k, inplace, "merged in place (merge_hypothesis(..., inplace=True))")
    probe, measured = _probe_inputs(model), ""
    if probe is not None:  # measured before a merge in place closes the model
        with torch.no_grad(), model.disable_adapters():
            unadapted = model.base_model(**probe).logits[0].float()  # [16, V]
        with torch.no_grad(), model.use_hypotheses(k):
            expected = model.base_model(**probe).logits[0].float()  # [16, V]
    merged = _remove_adapters(model, k, inplace, "merged in place (merge_hypothesis(..., inplace=True))")
    if probe is not None:
        with torch.no_grad():
            error = (merged(**probe).logits[0].float() - expected).abs().max()
        measured = (f": on a probe of {probe['input_ids'].shape[1]} random tokens the merged model's logits differ "
                    f"from hypothesis {k}'s by up to {error:.3g} (hypothesis {k} moves the base model's by up to "
                    f"{(expected - unadapted).abs().max():.3g})")
    warnings.warn(f"merging hypothesis {k} into {', '.join(lossy)} layers rounds the merged weights to the "
                  f"quantization grid again, which loses part of the update{measured}. Serve the exported adapter "
                  "on the quantized base instead (export_hypothesis), or merge on an unquantized base for exact "
                  "weights", stacklevel=2)
    return merged


def _probe_inputs(model) -> dict | None:
    """A fixed batch of 16 random token ids (a text model's input; None for others, whose effect is not measured)."""
    vocabulary = getattr(model.config, "vocab_size", None)
    if not vocabulary or getattr(model.base_model, "main_input_name", "input_ids") != "input_ids":
        return None
    ids = torch.randint(vocabulary, (1, 16), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids.to(model.adapter_device())}
    if getattr(model.config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = inputs["input_ids"]
    return inputs


def _refuse_position_dependent(model, what: str, also: str = "") -> None:
    if not model.mcl_config.adapt_context:
        raise ValueError(
            f"these hypotheses were trained with adapt_context=False: they act only from the first target "
            f"position on, so hypothesis weights {what} (applied at every position, the context included) "
            f"would compute another model. Decode with this MCLModel (generate_hypotheses){also}, or train with "
            "adapt_context=True to export standard LoRA adapters")


def unload(model) -> nn.Module:
    """Remove every adapter and return the base model as it was before ``get_mcl_model`` (its original layers,
    untouched weights, the ``requires_grad`` flags it had: ``model.frozen_base``), as PEFT's ``unload``. The MCL model
    is unusable afterwards."""
    base = _remove_adapters(model, None, True, "unloaded (unload())")
    for param, flag in model.frozen_base.requires_grad:
        param.requires_grad_(flag)
    return base


def _remove_adapters(model, k: int | None, inplace: bool, how: str) -> nn.Module:
    """Put the original layers back, hypothesis k merged into them (None: unchanged); ``inplace`` closes ``model``
    (``how`` says why in its later errors)."""
    model.check_usable()
    model.remove_hooks()  # a deep copy must not take the model's hooks with it
    try:
        base = model.base_model if inplace else copy.deepcopy(model.base_model)
        with torch.no_grad():
            for name in model.layer_names:
                layer = base.get_submodule(name)
                if k is not None:
                    _merge_into(layer, k, base)
                base.set_submodule(name, layer.base_layer)
    finally:
        if not inplace:
            model.install_hooks()
    if inplace:
        model.close(how)
    return base


def _merge_into(layer, k: int, base: nn.Module) -> None:
    """W += delta W_k in ``layer``'s base layer; a quantized one is dequantized, added to and requantized (PEFT's
    backends: the same rounding as PEFT's merge)."""
    if quantization_backend(layer.base_layer) is None:
        layer.base_layer.weight.add_(layer.delta_weight(k))
        return
    backend = peft_quantization_backend(layer.base_layer, base)
    weight = backend.get_base_weight(layer.base_layer)  # [d_out, d_in], dequantized
    merged = weight.float() + layer.delta_weight(k, torch.float32)  # not rounded to the compute dtype first, as PEFT
    backend.set_base_weight(_BaseLayerHolder(layer.base_layer), merged.to(weight.dtype))


class _BaseLayerHolder:
    """What PEFT's ``set_base_weight`` reads from the layer that holds a quantized one."""

    def __init__(self, base_layer: nn.Module) -> None:
        self.base_layer = base_layer

    def get_base_layer(self) -> nn.Module:
        return self.base_layer


def _peft_task_type(model: nn.Module) -> str | None:
    """The PEFT task type whose model class passes this model's inputs through: PEFT's language-model wrappers
    take ``input_ids`` as their first input, which suits text models only; others (Whisper's ``input_features``,
    BLIP-2's ``pixel_values``) get PEFT's plain ``PeftModel``, which forwards every input as it is."""
    if getattr(model, "main_input_name", "input_ids") != "input_ids":
        return None
    return "SEQ_2_SEQ_LM" if getattr(model.config, "is_encoder_decoder", False) else "CAUSAL_LM"
