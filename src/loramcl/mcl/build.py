"""Building: how a transformers model becomes an ``MCLModel``, top to bottom (``get_mcl_model``).

1. The target layers: ``MCLConfig.target_modules`` (PEFT's defaults for the model type when None) matched as PEFT
   matches them (``exclude_modules``, ``layers_to_transform``, ``all-linear``), checked non-empty
   (``target_layer_names``).
2. The base checks on them: an MCL model is not wrapped twice, quantized layers of unknown backends are refused, the
   output layer and embeddings are not targets, ``layers_to_transform`` names blocks that hold a target.
3. The size checks: the rank against each layer, the K hypotheses' bytes against the free memory
   (``loramcl.mcl.adapter_size``).
4. The module replacement (``replace_modules``): the base frozen and its fingerprint taken (``FrozenBase``), each
   target wrapped, the model made; on any failure the base is left as it was.

The baselines build through the same steps (``loramcl.baselines``: ``target_layer_names``, ``replace_modules``);
loading saved adapters is a room above them (``loramcl.models.mcl.load_mcl_model``), which checks the files, then
builds here.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from loramcl.mcl.adapter_size import check_adapter_size
from loramcl.mcl.compat import peft_default_targets, peft_targets
from loramcl.mcl.config import MCLConfig
from loramcl.mcl.fingerprint import FrozenBase, base_fingerprint
from loramcl.mcl.layers import HypothesisRouting, MCLLoraLinear
from loramcl.mcl.logits import output_layer_of
from loramcl.mcl.model import MCLModel
from loramcl.mcl.quantization import SUPPORTED, quantization_backend, unusable_here
from loramcl.utils.validate import OptionError

_ADAPTABLE = (nn.Linear, Conv1D)


def get_mcl_model(model: nn.Module, config: MCLConfig) -> MCLModel:
    """Give ``model`` (any transformers model, modified in place) K LoRA hypotheses on the target layers.

    Every base parameter is frozen; only the adapters train. Quantized base layers are refused. If anything fails,
    the model is left as it was.
    """
    routing = HypothesisRouting()
    adapter_dtype = torch.float32 if config.adapter_dtype == "float32" else None
    names = target_layer_names(model, config)
    check_adapter_size(model, names, config)
    return replace_modules(model, names, lambda layer: MCLLoraLinear(
        layer, routing, config.num_hypotheses, config.r, config.alpha, config.dropout, adapter_dtype=adapter_dtype,
        use_rslora=config.use_rslora, shared_r=config.shared_r),
        lambda names, base: MCLModel(model, config, routing, names, base))


# ---- 1. the target layers --------------------------------------------------------------------------------------------


def target_layer_names(model: nn.Module, config: MCLConfig) -> list[str]:
    """The layers of ``model`` that ``config.target_modules`` selects (PEFT's matching), checked non-empty."""
    if hasattr(model, "mcl_layers"):  # an MCLModel, or a baseline built on it
        raise ValueError("this model already has MCL adapters")
    targets = resolve_target_modules(model, config)
    names = matched_layer_names(model, targets, config)
    if not names:
        refuse_quantized(model)
        _refuse_missing_blocks(model, targets, config)
        raise ValueError(f"target_modules={targets!r} matched no layer of {type(model).__name__}. Its linear "
                         f"layers are named: {linear_layer_names(model)}")
    return names


def resolve_target_modules(model: nn.Module, config: MCLConfig) -> list[str] | str:
    targets = config.target_modules
    if targets is None:
        defaults = peft_default_targets()
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in defaults:
            raise ValueError(f"PEFT has no default target modules for model_type={model_type!r}; set "
                             f"MCLConfig.target_modules, e.g. from the linear layers: {linear_layer_names(model)}")
        targets = list(defaults[model_type])
    return targets


def matched_layer_names(model: nn.Module, targets: list[str] | str, config: MCLConfig) -> list[str]:
    output_layer = output_layer_of(model)
    if targets == "all-linear":
        candidates = [name for name, module in model.named_modules()
                      if isinstance(module, _ADAPTABLE) and module is not output_layer]
        # matched by their short names, so that exclude_modules and layers_to_transform apply as in PEFT
        names = [name for name in candidates if peft_targets(config, [name.rsplit(".", 1)[-1]], name)]
        refuse_quantized(model, names)
        return names
    names = [name for name, _ in model.named_modules() if name and peft_targets(config, targets, name)]
    refuse_quantized(model, names)
    for name in names:
        module = model.get_submodule(name)
        if module is output_layer:
            raise ValueError(f"'{name}' is the output layer: LoRA-MCL adapts hidden layers, not the LM head")
        if isinstance(module, nn.Embedding):
            raise ValueError(f"target '{name}' is an Embedding: embedding LoRA is not supported, MCL adapters wrap "
                             f"nn.Linear and transformers Conv1D layers. Linear layers of this model: "
                             f"{linear_layer_names(model)}")
        if not isinstance(module, _ADAPTABLE):
            raise ValueError(f"target '{name}' is a {type(module).__name__}; MCL adapters wrap nn.Linear and "
                             "transformers Conv1D layers only. Linear layers of this model: "
                             f"{linear_layer_names(model)}")
    return names


def linear_layer_names(model: nn.Module) -> list[str]:
    output_layer = output_layer_of(model)
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, _ADAPTABLE) and module is not output_layer})


# ---- 2. the base checks ----------------------------------------------------------------------------------------------


def refuse_quantized(model: nn.Module, names: list[str] | None = None) -> None:
    """A clear error for quantized layers among ``names`` (default: every module of ``model``)."""
    modules = model.named_modules() if names is None else ((n, model.get_submodule(n)) for n in names)
    found: list[tuple[str, str]] = []
    for name, module in modules:
        if not any(name.startswith(outer + ".") for outer, _ in found) and (reason := _quantized_reason(module)):
            found.append((name, reason))
    if found:
        name, reason = found[0]
        raise ValueError(f"{type(model).__name__} has quantized layers ({len(found)}, e.g. '{name}': {reason}). "
                         f"LoRA-MCL adapters wrap floating-point base layers and the {SUPPORTED}. Load the base "
                         "model with one of those, or unquantized (e.g. dtype=torch.bfloat16, without "
                         "quantization_config).")


def _quantized_reason(module: nn.Module) -> str | None:
    """Why ``module`` is a quantized (or otherwise non-float) layer that adapters must not wrap, or None.

    The backends of ``loramcl.mcl.quantization`` (bitsandbytes 4-bit and 8-bit, torchao int8 weight-only) are
    wrapped: their forward, files, fingerprint and merge are known. Any other quantized layer is refused: its
    ``weight`` may not be the matrix that its forward uses (packed integers, a quantized tensor subclass), and a
    merge into it may silently leave the adapter out (optimum-quanto's with PEFT). Recognised: torch's quantized
    modules (dynamic or static), layers of quantization libraries (bitsandbytes, GPTQ, AWQ, HQQ, quanto, torchao)
    and any layer whose weight is not a plain floating-point tensor.
    """
    if quantization_backend(module):
        return unusable_here(module)
    origin = type(module).__module__
    libraries = ("bitsandbytes", "auto_gptq", "gptqmodel", "awq", "hqq", "optimum.quanto", "torchao", "fp_quant",
                 "compressed_tensors", "aqlm", "eetq", "vptq", "higgs")
    if origin.startswith(("torch.ao.nn.quantized", "torch.nn.quantized", "torch.ao.nn.intrinsic.quantized")):
        return f"torch quantized module {type(module).__name__}"
    if any(origin == lib or origin.startswith(lib + ".") for lib in libraries):
        return f"{type(module).__name__} from {origin.split('.')[0]}"
    weight = getattr(module, "weight", None)
    if isinstance(module, _ADAPTABLE) and torch.is_tensor(weight):
        if not weight.is_floating_point():
            return f"{type(module).__name__} with {weight.dtype} weights"
        if type(weight) not in PLAIN_WEIGHTS:
            return f"{type(module).__name__} whose weight is a {type(weight).__name__}"
    return None


# The weight types of a floating-point layer; any other tensor subclass (torchao's, a quantizer's) is refused. Tests
# running on a fake accelerator (benchmarks/checks/fake_accelerator.py) add their device's tensor type.
PLAIN_WEIGHTS = (torch.Tensor, nn.Parameter)


def _refuse_missing_blocks(model: nn.Module, targets: list[str] | str, config: MCLConfig) -> None:
    """When ``target_modules`` matches layers but none in the blocks ``layers_to_transform`` names: an OptionError
    naming it, with the blocks those layers are in."""
    if config.layers_to_transform is None:
        return
    anywhere = matched_layer_names(model, targets, dataclasses.replace(config, layers_to_transform=None,
                                                                       layers_pattern=None))
    blocks = sorted({int(number) for name in anywhere for number in re.findall(r"\.(\d+)\.", name)})
    if anywhere:
        raise OptionError("layers_to_transform", f"layers_to_transform {config.layers_to_transform} names no block "
                          f"of {type(model).__name__} holding a layer of target_modules={targets!r}: its blocks are "
                          f"numbered {blocks[0]} to {blocks[-1]}" if blocks else "layers_to_transform: the target "
                          "layers are in no numbered block", owner=MCLConfig)


# ---- 4. the module replacement (3. is loramcl.mcl.adapter_size) ------------------------------------------------------


def replace_modules(model: nn.Module, names: list[str], make_module, make_model):
    """Freeze ``model``, replace each module ``names[i]`` with ``make_module(module)`` and return
    ``make_model(names, base)``, ``base`` the ``FrozenBase`` measured before; if anything fails, the model is left as
    it was."""
    originals = {name: model.get_submodule(name) for name in names}
    trainable = tuple((param, param.requires_grad) for param in model.parameters())
    # of the base weights as they are now, before any adapter is added
    base = FrozenBase(fingerprint=base_fingerprint(model), requires_grad=trainable)
    try:
        for param in model.parameters():
            param.requires_grad_(False)
        for name, module in originals.items():
            model.set_submodule(name, make_module(module))
        return make_model(names, base)
    except BaseException:
        for name, module in originals.items():  # roll back: the caller's model must not stay half-wrapped
            model.set_submodule(name, module)
        for param, flag in trainable:
            param.requires_grad_(flag)
        raise
