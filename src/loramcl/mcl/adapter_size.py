"""How large K hypotheses of rank r are on a model's target layers, checked before they are made (issue 36): the
rank against each layer's width, their bytes against the memory free where the layers are; likewise LoRA-MoE's E
experts and multi-head MCL's K copies of a module. A mistake gets one line with the numbers and what to lower, not
torch's allocation error after minutes of work.

The baselines' configurations are read by what they hold (a LoRA-MoE config has ``num_experts``, multi-head MCL's
``module``), so that the method does not import the baselines built on it."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from loramcl.mcl.config import MCLConfig
from loramcl.mcl.layers import linear_features
from loramcl.mcl.quantization import compute_dtype
from loramcl.utils.validate import OptionError

# Training keeps, beside each adapter weight, its gradient and AdamW's two moment estimates, all of its dtype.
TRAINING_COPIES = 4


def check_rank(model: nn.Module, names: list[str], config) -> None:
    """r (with a shared adapter: shared_r + r, the rank of one hypothesis) is at most min(d_in, d_out) of every target
    layer: a larger A B has no more rank, only more weights."""
    block = _block(config)
    widths = {name: linear_features(model.get_submodule(name)) for name in names}
    narrowest = min(names, key=lambda name: min(widths[name]))
    d_in, d_out = widths[narrowest]
    shared = getattr(config, "shared_r", 0)
    if shared and config.r + shared > min(d_in, d_out):
        raise OptionError("shared_r", f"shared_r {shared} + r {config.r} is more than the rank of an adapter on "
                          f"{narrowest} ({d_in} -> {d_out} features, rank at most {min(d_in, d_out)}): set "
                          f"--{block}.shared_r + --{block}.r to {min(d_in, d_out)} or less", owner=type(config))
    if config.r > min(d_in, d_out):
        exclude = f" / --{block}.exclude_modules" if hasattr(config, "exclude_modules") else ""
        raise OptionError("r", f"r {config.r} is more than the rank of an adapter on {narrowest} ({d_in} -> {d_out} "
                          f"features, rank at most {min(d_in, d_out)}): set --{block}.r {min(d_in, d_out)} or less, "
                          f"or leave the narrow layers out (--{block}.target_modules{exclude})", owner=type(config))


def hypothesis_bytes(model: nn.Module, names: list[str], config, rank: int | None = None) -> dict[torch.device, int]:
    """{device: bytes} of ONE hypothesis' adapter weights (A [d_in, r] and B [r, d_out] per target layer; a LoRA-MoE
    expert's also its column of the router [d_in, E]), on the device of each layer; ``rank``: of that rank instead of
    r, without router (the shared adapter's)."""
    router = _block(config) == "moe" and rank is None
    sizes: dict[torch.device, int] = defaultdict(int)
    for name in names:
        layer = model.get_submodule(name)
        d_in, d_out = linear_features(layer)
        dtype = torch.float32 if config.adapter_dtype == "float32" else compute_dtype(layer)  # not uint8 codes
        sizes[layer.weight.device] += ((d_in + d_out) * (config.r if rank is None else rank) + (
            d_in if router else 0)) * dtype.itemsize
    return dict(sizes)


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device``: the system's available memory for the CPU, the free memory
    of a CUDA GPU; None where it is not known."""
    if device.type == "cpu":
        import psutil  # a dependency of accelerate

        return psutil.virtual_memory().available
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return None


def check_adapter_size(model: nn.Module, names: list[str], config,
                       training: bool = False) -> None:
    """The rank fits every target layer (``check_rank``), and K hypotheses' (LoRA-MoE: E experts') adapter weights
    (with their gradients and AdamW state when ``training``) fit the memory available where the layers are, else an
    OptionError with the estimate, the memory and the largest K that fits. Activations are not counted: this is the
    least a run needs."""
    check_rank(model, names, config)
    block = _block(config)
    option, what, one = ("num_experts", "E experts", "expert") if block == "moe" else (
        "num_hypotheses", "K hypotheses", "hypothesis")
    shared = getattr(config, "shared_r", 0)
    _check_copies_fit(getattr(config, option), hypothesis_bytes(model, names, config), option, type(config),
                      f"{what} of rank {config.r} on {len(names)} layers need {{need}} of adapter weights",
                      f", or a lower --{block}.r", f"not one {one} fits: lower --{block}.r, or adapt fewer layers",
                      training, hypothesis_bytes(model, names, config, shared) if shared else {})


def check_heads_size(module: nn.Module, config, training: bool = False) -> None:
    """Multi-head MCL's K copies of ``module`` (with their gradients and AdamW state when ``training``) fit the memory
    available where its weights are, else an OptionError with the estimate and the largest K that fits."""
    one: dict[torch.device, int] = defaultdict(int)
    for parameter in module.parameters():
        dtype = torch.float32 if config.dtype == "float32" else parameter.dtype
        one[parameter.device] += parameter.numel() * dtype.itemsize
    _check_copies_fit(config.num_hypotheses, dict(one), "num_hypotheses", type(config),
                      f"K copies of {config.module} need {{need}}", "",
                      "not one copy fits: duplicate a smaller module (--multihead.module)", training)


def _check_copies_fit(count: int, one: dict[torch.device, int], option: str, owner: type, what: str, lower: str,
                      none_fits: str, training: bool, fixed: dict[torch.device, int] | None = None) -> None:
    """``count`` copies of ``one`` ({device: bytes of one copy}) and ``fixed`` (bytes made once: the shared adapter),
    times ``TRAINING_COPIES`` when ``training``, fit the memory available on each device, else an OptionError:
    ``what`` (with ``{need}``), the memory, the largest count that fits (``lower``: what else to lower) or, when none
    fits, ``none_fits``."""
    copies = TRAINING_COPIES if training else 1
    block = _block(owner)
    fixed = fixed or {}
    for device, size in one.items():
        free = available_memory(device)
        need = (count * size + fixed.get(device, 0)) * copies
        if free is None or need <= free:
            continue
        fits = max(free // copies - fixed.get(device, 0), 0) // size
        state = " with their gradients and AdamW state" if training else ""
        fix = f"set --{block}.{option} {fits} or less{lower}" if fits else none_fits
        raise OptionError(option, f"{option} {count}: {what.format(need=_gb(need))}{state}, more than the "
                          f"{_gb(free)} available on {device}: {fix}", owner=owner)


def _block(config) -> str:
    """The command line's block of the options of ``config`` (an instance or its class): `--mcl.r`, `--moe.r`,
    `--multihead.num_hypotheses`."""
    owner = config if isinstance(config, type) else type(config)
    if issubclass(owner, MCLConfig):
        return "mcl"
    fields = getattr(owner, "__dataclass_fields__", {})
    return "moe" if "num_experts" in fields else "multihead" if "module" in fields else "mcl"


def _gb(size: int) -> str:
    scale, unit = next((scale, unit) for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "bytes"))
                       if size >= scale or unit == "bytes")
    return f"{size / scale:,.1f} {unit}"
