"""The methods built on ``MCLModel`` that rebuild their own models from saved files (PEFT's ``register_peft_method``
shape): each registers its loader here, so the method's room never names a module above it.

The baselines register theirs when ``loramcl.baselines`` is imported, which the room of ``load_mcl_model``
(``loramcl.models.mcl``, a floor above the baselines) does, so it finds them whatever the caller imported. No torch
here: the baselines' package stays light.
"""

from __future__ import annotations

from collections.abc import Callable

# method in mcl_config.json -> loader(base_model, path, saved, tensors, is_trainable, strict) -> the rebuilt model
_LOADERS: dict[str, Callable] = {}


def register_method(method: str, loader: Callable) -> None:
    """Make ``load_mcl_model`` rebuild the folders whose ``mcl_config.json`` names ``method`` with ``loader``
    (called as ``loader(base_model, path, saved, tensors, is_trainable, strict)`` on files already read and checked,
    returning the model, which checks its files against ``base_model`` before touching it)."""
    if method == "mcl":
        raise ValueError("'mcl' is LoRA-MCL itself, loaded by load_mcl_model: register another method's name")
    if not callable(loader):
        raise TypeError(f"the loader of {method!r} must be callable, got {loader!r}")
    _LOADERS[method] = loader


def method_loader(method: str, config_file: str) -> Callable:
    """The loader registered for ``method``; an error naming it and how the baselines register theirs otherwise."""
    if method not in _LOADERS:
        known = ", ".join(sorted(_LOADERS)) or "none"
        raise ValueError(f"{config_file} holds a {method!r} model, and no loader of that method is registered "
                         f"(registered: {known}): the baselines register theirs when loramcl.baselines is imported "
                         "(import loramcl.baselines), a method of your own with "
                         "loramcl.mcl.methods.register_method")
    return _LOADERS[method]
