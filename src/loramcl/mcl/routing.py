"""Setting the routing every adapted layer of a model shares (``layers.HypothesisRouting``) to the hypotheses a
forward or a ``use_hypotheses`` block asks for, checked."""

from __future__ import annotations

import torch

from loramcl.mcl.layers import INDEXED, SINGLE, STACKED, HypothesisRouting


def set_routing(routing: HypothesisRouting, hypotheses: int | torch.Tensor | None, num_hypotheses: int,
                rows: int | None, copies: bool = False, device: torch.device | None = None) -> None:
    """Set ``routing`` to run ``hypotheses`` (None: all K stacked; an int; a LongTensor, one entry per example of
    ``rows`` examples or, with ``copies``, per copy of the batch), checked against ``num_hypotheses``."""
    k_max = num_hypotheses
    routing.per_copy, routing.ordered, routing.rows, routing.copies = False, False, None, None
    routing.positions = None
    if hypotheses is None:
        routing.mode, routing.index = STACKED, None
    elif isinstance(hypotheses, int) and not isinstance(hypotheses, bool):
        check_hypothesis(hypotheses, k_max)
        routing.mode, routing.hypothesis, routing.index = SINGLE, hypotheses, None
    elif torch.is_tensor(hypotheses) and not hypotheses.is_floating_point():
        index = hypotheses.flatten().long()
        routing.copies = index.numel() if copies else None
        if rows is not None and index.numel() != rows:
            raise ValueError(f"hypotheses must give one hypothesis per example ({rows}), got {index.numel()}")
        if torch.compiler.is_compiling():
            # a compiled forward reads no value on the host: the indices route as given, unchecked (two-pass WTA's
            # winners are argmins, in range by construction), without the shortcuts the values would allow
            routing.mode, routing.index, routing.per_copy = INDEXED, index.to(device), copies
            return
        values = index.tolist()  # one host read for the checks and the mode
        if not values or min(values) < 0 or max(values) >= k_max:
            raise ValueError(f"hypothesis indices must be in [0, {k_max - 1}], got {values}")
        if all(value == values[0] for value in values):  # one hypothesis for every row: no per-row routing to check
            routing.mode, routing.hypothesis, routing.index = SINGLE, values[0], None
        else:
            routing.mode, routing.index = INDEXED, index.to(device)
            routing.per_copy, routing.ordered = copies, values == list(range(k_max))
    else:
        raise TypeError(f"hypotheses must be None, an int or a LongTensor, got {type(hypotheses).__name__}")


def check_hypothesis(k: int, num_hypotheses: int) -> None:
    if not (isinstance(k, int) and 0 <= k < num_hypotheses):
        raise ValueError(f"hypothesis {k!r} does not exist: this model has K={num_hypotheses} "
                         f"(0..{num_hypotheses - 1})")
