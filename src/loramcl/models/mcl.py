"""Loading: the MCL model saved in a folder, rebuilt on its base model (``load_mcl_model``), whatever its method.

A folder of LoRA-MCL is read and checked (``loramcl.mcl.adapter_files``), its layers and widths against the base,
the base's weights against the fingerprint the folder records (``loramcl.mcl.fingerprint``), and only then built
(``loramcl.mcl.build``) and filled. A folder of another method goes to the loader that method registered
(``loramcl.mcl.methods``): this room stands above the baselines and imports them, so their loaders are registered
whatever the caller imported, and the method's room never names them.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import replace

import torch
from torch import nn

import loramcl.baselines  # noqa: F401  (registers the baselines' loaders: loramcl.mcl.methods)
from loramcl.mcl.adapter_files import (
    CONFIG_NAME,
    SCORING_PREFIX,
    check_adapters_fit,
    check_scoring_fits,
    checked_mcl_config,
    copy_scoring_head,
    read_adapter_files,
)
from loramcl.mcl.build import get_mcl_model, matched_layer_names, resolve_target_modules
from loramcl.mcl.fingerprint import check_base_weights, known_fingerprint
from loramcl.mcl.layers import linear_features
from loramcl.mcl.logits import output_layer_of
from loramcl.mcl.methods import method_loader
from loramcl.mcl.model import MCLModel


def load_mcl_model(model: nn.Module, path: str | os.PathLike, is_trainable: bool = False,
                   verify: bool = True, fit_scores: bool = False, strict: bool = False) -> MCLModel:
    """Rebuild the MCL model saved in ``path`` on top of ``model`` (the same base model it was trained on).

    As with PEFT, the model is returned in eval mode (the dropout saved with the adapters off) and the adapters
    frozen, unless ``is_trainable=True`` (to continue training: the modes are left as built). The files are read
    and checked against ``model`` (layer names and shapes, the weights' checksum unless ``verify=False``, finite
    values) before ``model`` is touched, so a failed load leaves it as it was.

    ``fit_scores=True``: to learn the hypothesis scores p(k | c) of a run trained without them (or to refit them):
    the scoring head is trainable (a new zero one, p uniform, when the run has none) and the hypotheses stay frozen.
    The head's loss never reaches the hypotheses (docs/guide/scores.md), so this fits the scores that joint training
    would fit for the final hypotheses.

    Adapters saved on a base model of the same class but other weights (their ``base_fingerprint`` differs from
    ``model``'s, see ``loramcl.mcl.fingerprint``) give a warning naming both; so do files that cannot be verified (no
    checksum of the weights or of the settings, no fingerprint) and tensors converted after save
    (``loramcl.mcl.adapter_files``). ``strict=True`` makes each of these an error. An edited setting that changes the
    outputs (alpha, use_rslora, adapt_context, ...) is always an error.
    """
    saved, tensors = read_adapter_files(path, verify, strict)
    if isinstance(model, MCLModel):
        raise ValueError("this model already has MCL adapters: load onto the plain base model")
    if saved.get("base_model_class") not in (None, type(model).__name__):
        warnings.warn(f"adapters were trained on a {saved['base_model_class']}, loading onto a "
                      f"{type(model).__name__}", stacklevel=2)
    method = saved.get("method", "mcl")
    if method != "mcl":  # a registered method (the baselines: loramcl.mcl.methods) checks and rebuilds its layers
        loader = method_loader(method, os.path.join(path, CONFIG_NAME))
        loaded = loader(model, path, saved, tensors, is_trainable, strict)
        return loaded if is_trainable else loaded.eval()
    config = checked_mcl_config(path, saved, tensors)
    if fit_scores and not config.scoring:
        config = replace(config, scoring=True)
        tensors = {name: value for name, value in tensors.items() if not name.startswith(f"{SCORING_PREFIX}.")}
    targets = resolve_target_modules(model, config)
    names = matched_layer_names(model, targets, config)
    check_adapters_fit(path, saved, config, tensors, names,
                        {name: linear_features(model.get_submodule(name)) for name in names})
    if config.scoring:
        check_scoring_fits(path, tensors, None, hidden_size=output_layer_of(model).weight.shape[1])
    fingerprint = check_base_weights(path, saved, model, strict)  # shapes fit: are the values the same?
    with known_fingerprint(model, fingerprint):
        mcl = get_mcl_model(model, config)
    with torch.no_grad():
        for name, layer in mcl.mcl_layers():
            for part, param in layer.adapter_tensors().items():  # lora_A, lora_B (shared_A, shared_B)
                param.copy_(tensors[f"{name}.{part}"])
                param.requires_grad_(is_trainable)
    copy_scoring_head(mcl.scoring_head, tensors)
    if mcl.scoring_head is not None:
        mcl.scoring_head.requires_grad_(is_trainable or fit_scores)
    return mcl if is_trainable or fit_scores else mcl.eval()  # else the new layers' dropout (built training) acts
