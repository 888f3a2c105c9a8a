"""What an MCL forward needs from the host about a batch, computed once outside the forward (docs/architecture.md,
"Compiling the forward").

The forward itself reads nothing on the host when it is given ``target_index``, so that ``torch.compile`` traces it
whole: the checks that read values (token ids inside the vocabulary, a target token in every example) and the one
data-dependent size (how many label positions there are, N) run here, once per batch (``MCLTrainer``) or once per
call (``generate_hypotheses`` checks its token ids at its entry). A forward given no ``target_index`` calls
``checked_target_index`` itself: the same checks and errors, one host read each.
"""

from __future__ import annotations

import inspect
import sys

import torch
from torch import nn

from loramcl.mcl.compat import bad_token_ids, mark_dynamic, raise_bad_token_ids
from loramcl.mcl.nll import IGNORE_INDEX, aligned_targets, check_targets


def flat_index(positions: torch.Tensor) -> torch.Tensor:
    """The flat indices (row * T + t) of the True entries of ``positions`` [rows, T], in the order a boolean mask
    reads them: [N] long. N depends on the values: one host read (``nonzero``)."""
    return positions.flatten().nonzero().squeeze(1)


def checked_target_index(model: nn.Module, inputs: dict, labels: torch.Tensor) -> torch.Tensor:
    """Check a batch of ``model`` (an MCLModel) and return the ``target_index`` its forward takes: [N] flat indices
    (b * T + t) of the output positions that predict a label, in the order of ``aligned_targets(labels)``. Raises
    the forward's errors: a token id outside the vocabulary (``check_token_ids``), an example without a target
    token (``check_targets``). One host read: the two checks' verdicts and N together (on a GPU, one sync)."""
    base, input_ids = model.base_model, inputs.get("input_ids")
    targets = aligned_targets(labels, causal=not getattr(base.config, "is_encoder_decoder", False))  # [B, T]
    positions = targets != IGNORE_INDEX  # [B, T]
    bad = bad_token_ids(base, input_ids)  # [B, T] or None
    verdicts = [positions.sum(), (~positions.any(dim=1)).any()]  # N; an example without a target
    if bad is not None:
        verdicts.append(bad.any().to(positions.device))  # an id outside the vocabulary
    count, without_target, *bad_ids = torch.stack([verdict.long() for verdict in verdicts]).tolist()  # one read
    if any(bad_ids):
        raise_bad_token_ids(base, input_ids, bad)
    if without_target:
        check_targets(targets)  # raises, naming the examples
    return torch.nonzero_static(positions.flatten(), size=count).squeeze(1)  # [N], as flat_index: no second read


def batch_target_index(model: nn.Module, inputs: dict, compiled: bool) -> torch.Tensor | None:
    """The batch's ``checked_target_index`` [N] as ``MCLTrainer`` takes it: its token ids and targets checked and its
    label positions found here, once per batch, rather than in the forward of each pass (which then reads nothing on
    the host and compiles whole). ``compiled``: N and the sequence length may differ at every batch, so they are
    marked dynamic (the forward compiles once for all of them, not once per length). None without labels."""
    labels = inputs.get("labels")
    if not torch.is_tensor(labels):
        return None
    index = checked_target_index(model, inputs, labels)
    if compiled:
        mark_dynamic(index, 0)
        for value in (labels, *(inputs[name] for name in ("input_ids", "attention_mask") if name in inputs)):
            mark_dynamic(value, 1)
    return index


def stacked_target_index(index: torch.Tensor, copies: int, positions_per_copy: int) -> torch.Tensor:
    """``index`` [N] over one copy of the batch (B*T positions) -> [copies*N] over ``copies`` copies stacked
    hypothesis-major (copy k holds positions k*B*T ... (k+1)*B*T - 1): a fixed-shape gather, no host read."""
    offsets = torch.arange(copies, device=index.device).unsqueeze(1) * positions_per_copy  # [copies, 1]
    return (index.unsqueeze(0) + offsets).flatten()  # [copies*N]


def decoder_input_ids_from_labels(model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """The decoder inputs an encoder-decoder builds itself when given only labels (teacher forcing): its
    ``prepare_decoder_input_ids_from_labels`` (T5, BART, Marian, mBART, Pegasus), else its module's
    ``shift_tokens_right(labels, pad_token_id, decoder_start_token_id)`` as its forward calls it (Whisper)."""
    if hasattr(model, "prepare_decoder_input_ids_from_labels"):
        return model.prepare_decoder_input_ids_from_labels(labels=labels)
    shift = getattr(sys.modules.get(type(model).__module__), "shift_tokens_right", None)
    config = model.config
    start, pad = getattr(config, "decoder_start_token_id", None), getattr(config, "pad_token_id", None)
    if shift is not None and len(inspect.signature(shift).parameters) == 3:
        if start is None or pad is None:
            raise ValueError(f"{type(model).__name__} derives decoder inputs from labels with its config's "
                             f"decoder_start_token_id ({start}) and pad_token_id ({pad}): set both in its config, "
                             "or pass decoder_input_ids")
        return shift(labels, pad, start)
    raise ValueError(f"pass decoder_input_ids: {type(model).__name__} has no rule to derive them from labels")
