"""How large K hypotheses of rank r are on a model's target layers, checked before they are made (issue 36): the
rank against each layer's width, their bytes against the memory free where the layers are. A mistake gets one line
with the numbers and what to lower, not torch's allocation error after minutes of work."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from loramcl.config import MCLConfig
from loramcl.layers import linear_features
from loramcl.validate import OptionError

# Training keeps, beside each adapter weight, its gradient and AdamW's two moment estimates, all of its dtype.
TRAINING_COPIES = 4


def check_rank(model: nn.Module, names: list[str], config: MCLConfig) -> None:
    """r is at most min(d_in, d_out) of every target layer: a larger A B has no more rank, only more weights."""
    widths = {name: linear_features(model.get_submodule(name)) for name in names}
    narrowest = min(names, key=lambda name: min(widths[name]))
    d_in, d_out = widths[narrowest]
    if config.r > min(d_in, d_out):
        raise OptionError("r", f"r {config.r} is more than the rank of an adapter on {narrowest} ({d_in} -> {d_out} "
                          f"features, rank at most {min(d_in, d_out)}): set --mcl.r {min(d_in, d_out)} or less, or "
                          "leave the narrow layers out (--mcl.target_modules / --mcl.exclude_modules)",
                          owner=MCLConfig)


def hypothesis_bytes(model: nn.Module, names: list[str], config: MCLConfig) -> dict[torch.device, int]:
    """{device: bytes} of ONE hypothesis' adapter weights (A [d_in, r] and B [r, d_out] per target layer), on the
    device of each layer."""
    sizes: dict[torch.device, int] = defaultdict(int)
    for name in names:
        layer = model.get_submodule(name)
        d_in, d_out = linear_features(layer)
        dtype = torch.float32 if config.adapter_dtype == "float32" else layer.weight.dtype
        sizes[layer.weight.device] += (d_in + d_out) * config.r * dtype.itemsize
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


def check_adapter_size(model: nn.Module, names: list[str], config: MCLConfig, training: bool = False) -> None:
    """The rank fits every target layer (``check_rank``), and K hypotheses' adapter weights (with their gradients
    and AdamW state when ``training``) fit the memory available where the layers are, else an OptionError with the
    estimate, the memory and the largest K that fits. Activations are not counted: this is the least a run needs."""
    check_rank(model, names, config)
    copies = TRAINING_COPIES if training else 1
    for device, size in hypothesis_bytes(model, names, config).items():
        free = available_memory(device)
        need = config.num_hypotheses * size * copies
        if free is None or need <= free:
            continue
        fits = free // (size * copies)
        what = " with their gradients and AdamW state" if training else ""
        fix = (f"set --mcl.num_hypotheses {fits} or less, or a lower --mcl.r" if fits else
               "not one hypothesis fits: lower --mcl.r, or adapt fewer layers")
        raise OptionError("num_hypotheses", f"num_hypotheses {config.num_hypotheses}: K hypotheses of rank "
                          f"{config.r} on {len(names)} layers need {_gb(need)} of adapter weights{what}, more than "
                          f"the {_gb(free)} available on {device}: {fix}", owner=MCLConfig)


def _gb(size: int) -> str:
    scale, unit = next((scale, unit) for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1, "bytes"))
                       if size >= scale or unit == "bytes")
    return f"{size / scale:,.1f} {unit}"
