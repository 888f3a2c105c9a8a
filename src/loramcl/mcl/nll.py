"""Per-example, per-hypothesis negative log-likelihood under teacher forcing (paper eq. 1, §3.2).

Labels follow the transformers convention: ``-100`` marks positions without a target (prompt,
padding, image/audio tokens). A causal LM's logits at position t predict label t+1; an
encoder-decoder's logits at position t predict label t.
"""

from __future__ import annotations

from collections.abc import Callable

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
    """Every example needs at least one target token: its mean NLL would otherwise be 0/0. One host sync when they
    all have one."""
    missing = (targets == IGNORE_INDEX).all(dim=1)  # [B]
    if bool(missing.any()):
        empty = missing.nonzero().flatten().tolist()
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


# Elements of one block's fp32 log-softmax temporary in ``token_log_probs`` (16 MiB), whatever rows x vocabulary.
BLOCK_ELEMENTS = 1 << 22


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """log_softmax(logits.float())[rows[n], tokens[n]] for every n, without gradient: logits [R, V], tokens [N] and
    rows [N] (default: 0 ... R-1) -> [N] float32, computed in blocks of rows, so that neither an fp32 copy of the
    logits nor their [N, V] log-softmax is ever made whole. Each row's log-softmax is taken once: of the rows
    chosen when they are fewer than R, else of every logits row (beam search chooses 2 x num_beams candidates
    from num_beams rows)."""
    vocabulary = logits.shape[-1]
    tokens = tokens.to(logits.device).long().unsqueeze(1)  # [N, 1]
    step = max(1, BLOCK_ELEMENTS // max(vocabulary, 1))
    with torch.no_grad():
        if rows is None and tokens.shape[0] <= step:
            return logits.float().log_softmax(-1).gather(1, tokens).squeeze(1)
        if rows is not None and rows.numel() > logits.shape[0]:
            return _gathered_per_row(logits, tokens.squeeze(1), rows.to(logits.device).long(), step)
        blocks = logits.split(step) if rows is None else (
            logits.index_select(0, chosen.to(logits.device).long()) for chosen in rows.split(step))
        return torch.cat([block.float().log_softmax(-1).gather(1, chosen).squeeze(1)
                          for block, chosen in zip(blocks, tokens.split(step), strict=True)])


def _gathered_per_row(logits: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, step: int) -> torch.Tensor:
    """``token_log_probs`` with more chosen (row, token) pairs than logits rows: the log-softmax of each block of
    logits rows, read at the pairs whose row falls in it (indices clamped, then discarded: no host sync)."""
    result = torch.zeros(rows.shape, device=logits.device)  # [N]
    for start in range(0, logits.shape[0], step):
        block = logits[start:start + step].float().log_softmax(-1)  # [b, V]
        local = rows - start  # [N]
        inside = (local >= 0) & (local < block.shape[0])
        result = torch.where(inside, block[local.clamp(0, block.shape[0] - 1), tokens], result)
    return result


def mean_token_nll(token_logits: torch.Tensor, token_targets: torch.Tensor, rows: torch.Tensor,
                   num_rows: int) -> torch.Tensor:
    """Mean NLL per row from packed tokens: logits [N, V], targets [N], row of each token [N] -> [num_rows]. Without
    gradient (scoring, re-scoring candidates), in blocks of tokens."""
    if torch.is_grad_enabled() and token_logits.requires_grad:
        token_nll = F.cross_entropy(token_logits.float(), token_targets, reduction="none")  # [N]
    else:
        token_nll = -token_log_probs(token_logits, token_targets)  # [N]
    return row_means(token_nll, rows, num_rows)


def row_means(token_nll: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Mean of the token NLLs of each row: token_nll [N], row of each token [N] -> [num_rows]."""
    totals = token_nll.new_zeros(num_rows).index_add(0, rows, token_nll)  # [num_rows]
    # of a fixed size (bincount's depends on the largest row index: a dynamic shape that torch.compile cannot trace)
    counts = totals.new_zeros(num_rows).index_add(0, rows, torch.ones_like(token_nll))  # [num_rows]
    return totals / counts


def sequence_nll(logits: torch.Tensor, labels: torch.Tensor, causal: bool) -> torch.Tensor:
    """Mean NLL over the label tokens of each example: logits [B, T, V], labels [B, T] -> [B]."""
    targets = aligned_targets(labels, causal)
    check_targets(targets)
    mask = targets != IGNORE_INDEX  # [B, T]
    rows = mask.nonzero()[:, 0]  # [N]
    return mean_token_nll(logits[mask], targets[mask], rows, labels.shape[0])


def chunked_token_nll(hidden: torch.Tensor, targets: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor],
                      chunk_size: int) -> torch.Tensor:
    """NLL of each token from the hidden states the output layer reads, ``chunk_size`` tokens at a time:
    hidden [N, d], targets [N] -> [N] float32, never more than [chunk_size, V] logits alive at once.

    ``logits_of`` maps hidden states [n, d] to logits [n, V] (the output layer and whatever the model applies to its
    output); it must hold no parameter that trains (the output layer is frozen: it gets no gradient here). Equal to
    ``F.cross_entropy(logits_of(hidden).float(), targets, reduction="none")`` in value and in gradient.
    """
    if torch.is_grad_enabled() and hidden.requires_grad:
        return _ChunkedTokenNLL.apply(hidden, targets, logits_of, chunk_size)
    with torch.no_grad():
        return _token_nll_in_chunks(hidden, targets, logits_of, chunk_size, gradient=None)


def _token_nll_in_chunks(hidden: torch.Tensor, targets: torch.Tensor, logits_of, chunk_size: int,
                         gradient: torch.Tensor | None) -> torch.Tensor:
    """Token NLLs [N] chunk by chunk; with ``gradient`` [N, d], also fills it with d nll_t / d h_t."""
    token_nll = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # [N]
    for start in range(0, hidden.shape[0], chunk_size):
        chunk = slice(start, start + chunk_size)
        states = hidden[chunk].detach().requires_grad_(gradient is not None)  # [n, d]
        nll = F.cross_entropy(logits_of(states).float(), targets[chunk], reduction="none")  # [n]
        if gradient is not None:  # token t's NLL depends on h_t only: the gradient of the sum holds each row's own
            gradient[chunk] = torch.autograd.grad(nll.sum(), states)[0]
        token_nll[chunk] = nll.detach()
    return token_nll


class _ChunkedTokenNLL(torch.autograd.Function):
    """Token NLLs in chunks, with each chunk's gradient computed in the forward while its logits are alive.

    d nll_t / d h_t [d] is known before the loss is, so the backward needs [N, d] (scaled by the incoming gradient)
    instead of the [N, V] float32 log-softmax that the plain cross-entropy keeps, and no logits are computed twice (a
    checkpoint per chunk, or a recomputation in the backward, computes every chunk's logits twice:
    benchmarks/speed/chunked_cross_entropy.py measures the three).
    """

    @staticmethod
    def forward(ctx, hidden, targets, logits_of, chunk_size):
        gradient = torch.empty_like(hidden)  # [N, d]
        with torch.enable_grad():
            token_nll = _token_nll_in_chunks(hidden, targets, logits_of, chunk_size, gradient)
        ctx.save_for_backward(gradient)
        return token_nll

    @staticmethod
    def backward(ctx, grad_nll):
        (gradient,) = ctx.saved_tensors
        grad_hidden = (gradient.float() * grad_nll.unsqueeze(1)).to(gradient.dtype)  # [N, d]
        return grad_hidden, None, None, None
