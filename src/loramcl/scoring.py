"""Per-example, per-hypothesis negative log-likelihood under teacher forcing (paper eq. 1, §3.2).

Labels follow the transformers convention: ``-100`` marks positions without a target (prompt,
padding, image/audio tokens). A causal LM's logits at position t predict label t+1; an
encoder-decoder's logits at position t predict label t.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def aligned_targets(labels: torch.Tensor, causal: bool) -> torch.Tensor:
    """The token each output position must predict: [B, T] -> [B, T], IGNORE_INDEX where there is none."""
    if not causal:
        return labels
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    return targets


def check_targets(targets: torch.Tensor) -> None:
    """Every example needs at least one target token: its mean NLL would otherwise be 0/0."""
    empty = (targets == IGNORE_INDEX).all(dim=1).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"examples {empty[:10]} of the batch have no label token (every label is {IGNORE_INDEX} after the "
            "causal shift), so their NLL is undefined. Keep at least one target token per example "
            "(a causal LM never predicts the first token), or drop those examples.")


def examples_without_targets(dataset, causal: bool) -> list[int] | None:
    """Indices of the examples of ``dataset`` whose labels hold no target token (after the causal shift), found
    before training rather than when their batch comes. None when the dataset cannot be checked up front: not
    indexable (an IterableDataset), without a "labels" field (a collator builds them), or encoding its examples
    when read (``encodes_on_read = True``: reading them all would decode every audio clip; such a dataset checks
    each example's target as it encodes it)."""
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        return None
    if getattr(dataset, "encodes_on_read", False):
        return None
    columns = getattr(dataset, "column_names", None)
    if columns is not None:  # a datasets.Dataset: one column read, not one row at a time
        if "labels" not in columns:
            return None
        labels = dataset["labels"]
    else:
        labels = []
        for i in range(len(dataset)):
            example = dataset[i]
            if not isinstance(example, dict) or "labels" not in example:
                return None
            labels.append(example["labels"])
    start = 1 if causal else 0  # a causal LM never predicts the first token
    return [i for i, row in enumerate(labels)
            if not (torch.as_tensor(row).flatten()[start:] != IGNORE_INDEX).any()]


def mean_token_nll(token_logits: torch.Tensor, token_targets: torch.Tensor, rows: torch.Tensor,
                   num_rows: int) -> torch.Tensor:
    """Mean NLL per row from packed tokens: logits [N, V], targets [N], row of each token [N] -> [num_rows]."""
    token_nll = F.cross_entropy(token_logits.float(), token_targets, reduction="none")  # [N]
    totals = token_nll.new_zeros(num_rows).index_add(0, rows, token_nll)  # [num_rows]
    counts = torch.bincount(rows, minlength=num_rows).to(totals.dtype)  # [num_rows]
    return totals / counts


def sequence_nll(logits: torch.Tensor, labels: torch.Tensor, causal: bool) -> torch.Tensor:
    """Mean NLL over the label tokens of each example: logits [B, T, V], labels [B, T] -> [B]."""
    targets = aligned_targets(labels, causal)
    check_targets(targets)
    mask = targets != IGNORE_INDEX  # [B, T]
    rows = mask.nonzero()[:, 0]  # [N]
    return mean_token_nll(logits[mask], targets[mask], rows, labels.shape[0])
