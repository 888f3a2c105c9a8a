"""The call of the base model in progress: what the model asks its hooks to do during one call (``ForwardCall``),
held by one ``CallScope`` that the model and its hook components (``copies.CopyHooks``, ``logits.LabelLogits``) share,
armed for the call only (PEFT sets and removes a call's hooks inside a context manager; ours stay installed and read
the scope).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class ForwardCall:
    """What the hooks must do during one call of the base model; each field is cleared by the hook that does it, so
    that ``CallScope.armed`` can check afterwards that every hook ran."""

    expand_batch: int | None = None  # B: repeat per-example inputs K times at the expansion module
    logit_positions: torch.Tensor | None = None  # [rows, T] bool: hidden states the LM head must see
    logit_index: torch.Tensor | None = None  # [N] their flat indices (row * T + t), where known: a fixed-shape gather
    context_positions: torch.Tensor | None = None  # [rows]: the last context position, whose state the scores read
    context_states: torch.Tensor | None = None  # [rows, d]: those states (detached), filled by the output-layer hook
    # logits in chunks: the output-layer hook keeps the hidden states at label positions [N, d] here and gives the
    # layer only the first of them (a probe row: checks that logits_of reproduces what the model does to them)
    chunked: bool = False
    label_states: torch.Tensor | None = None


class CallScope:
    """The call of the base model in progress, shared by the model and its hooks (``CopyHooks``, ``LabelLogits``):
    outside ``armed`` it is an idle ``ForwardCall`` (nothing to do: a plain ``generate`` step)."""

    def __init__(self) -> None:
        self.call = ForwardCall()

    @contextlib.contextmanager
    def armed(self, call: ForwardCall) -> Iterator[ForwardCall]:
        self.call = call
        try:
            yield call
        finally:
            self.call = ForwardCall()
