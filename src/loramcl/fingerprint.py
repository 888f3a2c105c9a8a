"""A cheap fingerprint of a base model's weights, recorded in ``mcl_config.json`` so that adapters loaded onto a base
model of the same class and configuration but other weights (another checkpoint, another seed) are noticed.

What is hashed: for every floating-point parameter of the base model (by name, before any adapter is added), its
shape and a deterministic sample of its values: up to ``ROWS`` evenly spaced rows (of the parameter viewed as
``[shape[0], -1]``), each cut to its first ``COLUMNS`` values. The values are rounded to bfloat16 before hashing, so a
float32 checkpoint and its bfloat16 copy (``torch_dtype=torch.bfloat16``) have the same fingerprint, as do a bfloat16
checkpoint and its float32 copy; so do the same weights on another device. A float16 copy rounds differently (about
one value in eight changes its bfloat16 rounding), so it has another fingerprint: loading float32-trained adapters
onto a float16 copy warns.

What it cannot see: a change confined to the rows or columns outside the sample (e.g. a fine-tune of a few
embedding rows), and a change smaller than bfloat16's precision (about 0.4% of a value).
"""

from __future__ import annotations

import hashlib
import warnings

import torch
from torch import nn

from loramcl.inputs import BaseWeightsMismatch

ROWS = 8
COLUMNS = 64


def _sample(param: torch.Tensor) -> torch.Tensor | None:
    """The sampled values of ``param`` as bfloat16 on CPU, or None when they cannot be read (meta, FSDP shard)."""
    if param.device.type == "meta" or hasattr(param, "placements"):
        return None
    values = param.detach()
    values = values.reshape(values.shape[0], -1) if values.dim() > 0 else values.reshape(1, 1)
    rows = torch.linspace(0, values.shape[0] - 1, min(ROWS, values.shape[0])).round().long()
    return values[rows.to(values.device), :COLUMNS].to("cpu", torch.bfloat16).contiguous()


def base_fingerprint(model: nn.Module) -> str | None:
    """A hex digest of ``model``'s floating-point parameters (see the module docstring), or None when some weight
    cannot be read here (on the meta device, or an FSDP2 shard): then nothing is recorded and nothing is checked."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        if not param.is_floating_point():
            continue
        sample = _sample(param)
        if sample is None:
            return None
        digest.update(f"{name}:{tuple(param.shape)};".encode())
        digest.update(sample.view(torch.int16).numpy().tobytes())
    return "sha256-bf16-sample:" + digest.hexdigest()[:32]


def check_base_weights(path, saved: dict, model: nn.Module, fingerprint: str | None, strict: bool = False) -> None:
    """Warn (raise with ``strict``) when the adapters of ``path`` were saved on other base weights than ``model``'s."""
    message = mismatch_message(path, saved, model, fingerprint)
    if message is None:
        return
    if strict:
        raise ValueError(message)
    warnings.warn(message, BaseWeightsMismatch, stacklevel=3)


def mismatch_message(path, saved: dict, model: nn.Module, fingerprint: str | None) -> str | None:
    """The warning for adapters of ``path`` (their metadata ``saved``) loaded onto ``model`` whose base weights have
    ``fingerprint``, or None when they match, when either side has no fingerprint (files saved before it existed, a
    model on the meta device) or when the classes differ (warned as such)."""
    recorded = saved.get("base_fingerprint")
    if recorded is None or fingerprint is None or recorded == fingerprint:
        return None
    if saved.get("base_model_class") not in (None, type(model).__name__):
        return None  # another class: load_mcl_model's own warning says so, and its parameters have other names
    trained_on = saved.get("base_model_name_or_path") or "an unnamed model"
    loading_onto = getattr(getattr(model, "config", None), "_name_or_path", None) or "an unnamed model"
    return (f"the adapters in {path} were trained on other base weights: they were saved on {trained_on} "
            f"(weights fingerprint {recorded}), this {type(model).__name__} is {loading_onto} (fingerprint "
            f"{fingerprint}). Same class and shapes, other values (another checkpoint or seed, or a float16 copy): "
            "every output of this pairing is wrong. Load the base model the adapters were trained on "
            "(load_mcl_model(..., strict=True), or --strict true in loramcl generate / nll, makes this an error)")
