"""Files of the baselines: the same folder as LoRA-MCL's (``mcl_adapters.safetensors`` + ``mcl_config.json``, written
by ``MCLModel.save_pretrained``), with ``"method"`` and the method's own configuration in the JSON. Loading checks
everything against the model before any weight is copied, as ``load_mcl_model`` does for LoRA-MCL."""

from __future__ import annotations

import os

import torch

from loramcl.mcl.adapter_files import CONFIG_NAME, WEIGHTS_NAME, read_adapter_files
from loramcl.mcl.config import saved_values
from loramcl.mcl.fingerprint import check_wrapped_base_weights
from loramcl.mcl.model import MCLModel


def method_config(path, saved: dict, method: str, config_class):
    """The ``<method>_config`` object of checked metadata, as ``config_class``; errors name the file."""
    config_file = os.path.join(path, CONFIG_NAME)
    key = f"{method}_config"
    if saved.get("method") != method:
        raise ValueError(f"{config_file} holds a {saved.get('method', 'mcl')!r} model, not a {method!r} one")
    if not isinstance(saved.get(key), dict):
        raise ValueError(f"{config_file}: {key} must be a JSON object, got {saved.get(key)!r}")
    try:
        return config_class.from_dict(saved_values(saved[key]))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{config_file}: {error}") from None


def check_tensors_fit(path, saved: dict, tensors: dict[str, torch.Tensor], layer_names: list[str],
                      expected: dict[str, tuple[int, ...]]) -> None:
    """Raise unless the file's layers are ``layer_names`` and its tensors have exactly the ``expected`` shapes."""
    if list(saved["adapted_modules"]) != list(layer_names):
        raise ValueError(f"the weights in {path} are on the modules {saved['adapted_modules'][:5]}, this model's are "
                         f"{layer_names[:5]}: load them onto the base architecture and configuration they were saved "
                         "from")
    weights = os.path.join(path, WEIGHTS_NAME)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{weights} does not hold this model's tensors: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}")
    for key, shape in expected.items():
        if tuple(tensors[key].shape) != tuple(shape):
            raise ValueError(f"{weights}: {key} has shape {tuple(tensors[key].shape)}, this model needs "
                             f"{tuple(shape)}; was it saved from another base model or configuration?")


def expected_shapes(model: MCLModel) -> dict[str, tuple[int, ...]]:
    return {f"{name}.{part}": tuple(param.shape)
            for name, layer in model.mcl_layers() for part, param in layer.adapter_tensors().items()}


def copy_tensors(model: MCLModel, tensors: dict[str, torch.Tensor], is_trainable: bool | None = None) -> None:
    """Copy checked tensors into the model's adapter tensors; set their ``requires_grad`` when given."""
    with torch.no_grad():
        for name, layer in model.mcl_layers():
            for part, param in layer.adapter_tensors().items():
                param.copy_(tensors[f"{name}.{part}"])
                if is_trainable is not None:
                    param.requires_grad_(is_trainable)


class BaselineModel(MCLModel):
    """A baseline on the declared contract of ``MCLModel``: a subclass sets ``method``, ``method_config`` (its own
    configuration, written by ``save_pretrained``), ``export_refusal`` and ``merge_refusal``, and ``structure_of``
    (the configuration fields its weights' values depend on beyond their shapes); ``load_adapters`` (e.g. resuming a
    Trainer checkpoint) then checks a folder holds a model of the same method and structure before any weight is
    copied."""

    @staticmethod
    def structure_of(config) -> dict:
        raise NotImplementedError

    def load_adapters(self, path, verify: bool = True, strict: bool = False, is_trainable: bool = False) -> None:
        saved, tensors = read_adapter_files(path, verify, strict)
        ours = self.method_config
        theirs = method_config(path, saved, self.method, type(ours))
        if self.structure_of(theirs) != self.structure_of(ours):
            raise ValueError(f"{path} holds a {self.method} model with {self.structure_of(theirs)}; this model has "
                             f"{self.structure_of(ours)}")
        check_tensors_fit(path, saved, tensors, self.layer_names, expected_shapes(self))
        check_wrapped_base_weights(path, saved, self.base_model, self.frozen_base.fingerprint, strict)
        copy_tensors(self, tensors)
        if not is_trainable:  # as MCLModel.load_adapters
            self.eval()
