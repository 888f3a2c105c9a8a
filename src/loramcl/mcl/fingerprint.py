"""A fingerprint of a base model's weights, recorded in ``mcl_config.json`` so that adapters loaded onto a base model of
the same class and configuration but other weights (another checkpoint, another seed, an edited row) are noticed.

What is hashed (``sha256-bf16-all:``): every value of every floating-point parameter of the base model (by name and
shape, before any adapter is added). Each value is rounded to bfloat16; the parameter's values, flattened in row-major
order, are cut into blocks of ``BLOCK`` and each block is reduced to one exact integer, the sum of its values' 16-bit
patterns times fixed weights (``_block_weights``); the SHA-256 of the names, shapes and block sums is the fingerprint.
The block sums are exact in float64 (every term and partial sum is an integer below 2**53), so the order of the
additions does not matter: the same weights give the same fingerprint on CPU and on a GPU, where it is computed in
place, ``DEVICE_CHUNK`` values at a time (only the block sums, 1/4096 of the values, travel to the CPU). Any change
of one value by more than bfloat16's rounding changes its block's sum, so one edited row or embedding is seen.
The reduction is made to catch accidents, not forgery: edits crafted to keep every block's sum are possible.

The bfloat16 rounding makes a float32 checkpoint and its bfloat16 copy (``torch_dtype=torch.bfloat16``) the same
base, as are the same weights on another device. A float16 copy rounds differently (about one value in eight changes
its bfloat16 rounding), so it has another fingerprint: loading float32-trained adapters onto a float16 copy warns.
What it cannot see: a change smaller than bfloat16's precision (about 0.4% of a value).

A quantized layer (``loramcl.mcl.quantization``: bitsandbytes 4-bit and 8-bit, torchao int8) is hashed by what it
stores, its integer codes and quantization state (``quantized_state``: scales, quantization map), each through the same
bfloat16 block sums (integer codes are exact there), under names that say so: a 4-bit base and its bfloat16
original have other fingerprints, and adapters trained on one warn when loaded onto the other. A plain model's
fingerprint is what it was before quantized layers were supported.

Files saved before this scheme record ``sha256-bf16-sample:``, a hash of a sample only (up to ``ROWS`` evenly spaced
rows of each parameter viewed as ``[shape[0], -1]``, each cut to its first ``COLUMNS`` values, in bfloat16); they are
compared with that scheme where the plain base model is at hand (``check_base_weights``), and said to be legacy on
resume (``check_wrapped_base_weights``), where the base model already holds adapters.
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from loramcl.mcl.quantization import quantization_backend, quantized_state
from loramcl.utils.inputs import AdapterFilesWarning, BaseWeightsMismatch

FULL = "sha256-bf16-all"
SAMPLE = "sha256-bf16-sample"  # the scheme of files saved before every value was covered
BLOCK = 4096  # values per block sum: 4096 * 2**15 * 2**16 < 2**53, so every sum is an exact float64 integer
# Values rounded and reduced at once (multiples of BLOCK). On the CPU the 2 MB float64 buffer stays in cache (measured
# 2.3x faster than 4M values at once); on a GPU larger chunks mean fewer kernels. The sums do not depend on it.
CHUNK, DEVICE_CHUNK = 1 << 18, 1 << 22  # on a GPU: 40 MB of buffers
ROWS, COLUMNS = 8, 64  # the legacy sample
_known: dict[int, str] = {}  # id(model) -> its fingerprint, while ``known_fingerprint`` holds it


@dataclass(frozen=True)
class FrozenBase:
    """The base model as it was before any adapter was added (``replace_modules`` measures it and passes it in).

    fingerprint: of its weights (``base_fingerprint``), written by ``save_pretrained`` and checked by
        ``load_adapters``; None where the weights could not be read (the meta device).
    requires_grad: (parameter, flag) before it was frozen, restored by ``unload``.
    """

    fingerprint: str | None = None
    requires_grad: tuple[tuple[nn.Parameter, bool], ...] = ()


def _readable(param: torch.Tensor) -> bool:
    return param.device.type != "meta"


def whole_tensor(param: torch.Tensor) -> torch.Tensor:
    """``param``'s values, all of them: a DTensor (a shard of FSDP2's ``fully_shard``, or of a model transformers
    loaded sharded) is gathered from every rank, a collective that every rank must make, in the same order."""
    return param.full_tensor() if hasattr(param, "placements") and hasattr(param, "full_tensor") else param


def _block_weights(device: torch.device) -> torch.Tensor:
    """[BLOCK] float64 integers in [1, 65521], fixed by this formula: part of the scheme."""
    j = torch.arange(BLOCK, dtype=torch.int64)
    return ((j * 2654435761 + 97) % 65521 + 1).to(device, torch.float64)


def _block_sums(param: torch.Tensor, buffers: dict) -> torch.Tensor:
    """[ceil(numel / BLOCK)] float64 on CPU: the weighted sum of each block of ``param``'s bfloat16 bit patterns."""
    flat = param.detach().reshape(-1)
    # MPS has no float64: its weights are summed on the CPU, a chunk at a time
    device = flat.device if flat.device.type != "mps" else torch.device("cpu")
    chunk = CHUNK if device.type == "cpu" else DEVICE_CHUNK
    if device not in buffers:  # reused for every parameter on this device: no allocation per chunk
        buffers[device] = (torch.empty(chunk, dtype=torch.bfloat16, device=device),
                           torch.empty(chunk, dtype=torch.float64, device=device), _block_weights(device))
    rounded, exact, weights = buffers[device]
    sums = []
    for start in range(0, flat.numel(), chunk):
        part = flat[start:start + chunk].to(device)
        n, whole = part.numel(), part.numel() // BLOCK * BLOCK
        rounded[:n].copy_(part)  # rounded to nearest bfloat16, as .to(torch.bfloat16)
        values = exact[:n]
        values.copy_(rounded[:n].view(torch.int16))  # the bit patterns, as exact float64 integers
        if whole:
            sums.append(values[:whole].view(-1, BLOCK) @ weights)
        if whole < n:
            sums.append((values[whole:] @ weights[:n - whole]).reshape(1))
    return torch.cat(sums).cpu() if sums else torch.zeros(0, dtype=torch.float64)


def base_fingerprint(model: nn.Module) -> str | None:
    """``sha256-bf16-all:`` and a hex digest of every value of ``model``'s floating-point parameters (see the module
    docstring), or None when some weight cannot be read here (on the meta device). Sharded weights (DTensors) are
    gathered whole, one at a time (``get_mcl_model`` and ``load_mcl_model`` run on every rank): the fingerprint of a
    sharded model is that of the same model unsharded."""
    if id(model) in _known:
        return _known[id(model)]
    digest, buffers = hashlib.sha256(), {}
    quantized = {id(module.weight): (name, module) for name, module in model.named_modules()
                 if quantization_backend(module)}
    for name, param in model.named_parameters():
        if id(param) in quantized:  # its codes and quantization state, by their names in the layer
            layer_name, layer = quantized.pop(id(param))
            for part, value in quantized_state(layer).items():
                if not _readable(value):
                    return None
                digest.update(f"{layer_name}.{part}:quantized{value.numel()};".encode())
                digest.update(_block_sums(whole_tensor(value), buffers).numpy().astype("<f8").tobytes())
            continue
        if not param.is_floating_point():
            continue
        if not _readable(param):
            return None
        digest.update(f"{name}:{tuple(param.shape)};".encode())
        digest.update(_block_sums(whole_tensor(param), buffers).numpy().astype("<f8").tobytes())
    return f"{FULL}:" + digest.hexdigest()[:32]


def sampled_fingerprint(model: nn.Module) -> str | None:
    """The legacy ``sha256-bf16-sample:`` fingerprint (see the module docstring), to compare files saved with it."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        if not param.is_floating_point():
            continue
        if not _readable(param):
            return None
        values = whole_tensor(param).detach()
        values = values.reshape(values.shape[0], -1) if values.dim() > 0 else values.reshape(1, 1)
        rows = torch.linspace(0, values.shape[0] - 1, min(ROWS, values.shape[0])).round().long()
        sample = values[rows.to(values.device), :COLUMNS].to("cpu", torch.bfloat16).contiguous()
        digest.update(f"{name}:{tuple(param.shape)};".encode())
        digest.update(sample.view(torch.int16).numpy().tobytes())
    return f"{SAMPLE}:" + digest.hexdigest()[:32]


@contextlib.contextmanager
def known_fingerprint(model: nn.Module, fingerprint: str | None) -> Iterator[None]:
    """Inside, ``base_fingerprint(model)`` is ``fingerprint`` (just computed by ``check_base_weights``): wrapping the
    model right after the check does not read every weight a second time."""
    if fingerprint is None or not fingerprint.startswith(f"{FULL}:"):
        yield
        return
    _known[id(model)] = fingerprint
    try:
        yield
    finally:
        _known.pop(id(model), None)


def check_base_weights(path, saved: dict, model: nn.Module, strict: bool = False) -> str | None:
    """Warn (raise with ``strict``) when the adapters of ``path`` were saved on other base weights than those of
    ``model``, the plain base model they are about to be added to, or when that cannot be verified. Returns
    ``model``'s fingerprint when it was computed with the current scheme (for ``known_fingerprint``)."""
    recorded = saved.get("base_fingerprint")
    legacy = isinstance(recorded, str) and recorded.startswith(f"{SAMPLE}:")
    fingerprint = sampled_fingerprint(model) if legacy else base_fingerprint(model)
    _report(_problem(path, saved, model, fingerprint), strict)
    return None if legacy else fingerprint


def check_wrapped_base_weights(path, saved: dict, model: nn.Module, fingerprint: str | None,
                               strict: bool = False) -> None:
    """``check_base_weights`` on resume: ``model`` already holds adapters, ``fingerprint`` was taken when they were
    added. A legacy (sampled) recorded fingerprint cannot be compared with it: that is said."""
    recorded = saved.get("base_fingerprint")
    if isinstance(recorded, str) and recorded.startswith(f"{SAMPLE}:"):
        _report((AdapterFilesWarning, f"the adapters in {path} record a base fingerprint of an earlier loramcl "
                 f"({recorded}, a sample of the base weights), which cannot be compared once the adapters are added: "
                 "the base weights are not verified. Load them with load_mcl_model onto the plain base model to "
                 "compare it, and save them again to record a fingerprint of every weight"), strict)
        return
    _report(_problem(path, saved, model, fingerprint), strict)


def _report(problem: tuple[type[Warning], str] | None, strict: bool) -> None:
    if problem is None:
        return
    category, message = problem
    if strict:
        raise ValueError(message)
    warnings.warn(message, category, stacklevel=4)


def _problem(path, saved: dict, model: nn.Module, fingerprint: str | None) -> tuple[type[Warning], str] | None:
    """(category, message) when the adapters of ``path`` (metadata ``saved``) do not provably belong on ``model``
    whose base weights have ``fingerprint``; None when the fingerprints are equal, or when the classes differ (warned
    as such by the loader: their parameters have other names)."""
    recorded = saved.get("base_fingerprint")
    if saved.get("base_model_class") not in (None, type(model).__name__):
        return None
    unverified = "are not verified (strict=True, or --strict true in loramcl generate / nll, refuses this)"
    if recorded is None:
        return AdapterFilesWarning, (
            f"the adapters in {path} record no base_fingerprint (removed, or saved from a model on the meta device): "
            f"the base weights they were trained on {unverified}. Save them again from the model on its "
            "base to record it")
    if fingerprint is None:
        return AdapterFilesWarning, (
            f"this {type(model).__name__}'s weights cannot be read here (on the meta device), so the base "
            f"weights of the adapters in {path} {unverified}")
    if recorded == fingerprint:
        return None
    trained_on = saved.get("base_model_name_or_path") or "an unnamed model"
    loading_onto = getattr(getattr(model, "config", None), "_name_or_path", None) or "an unnamed model"
    covered = ("a sample of the weights, 8 rows x 64 values per tensor, as an earlier loramcl recorded it"
               if str(recorded).startswith(f"{SAMPLE}:") else "every value of every base weight, rounded to bfloat16")
    return BaseWeightsMismatch, (
        f"the adapters in {path} were trained on other base weights: they were saved on {trained_on} (weights "
        f"fingerprint {recorded}), this {type(model).__name__} is {loading_onto} (fingerprint {fingerprint}; both "
        f"hash {covered}). Same class and shapes, other values (another checkpoint or seed, edited weights, or a "
        "float16 copy): every output of this pairing is wrong. Load the base model the adapters were trained on "
        "(load_mcl_model(..., strict=True), or --strict true in loramcl generate / nll, makes this an error)")
