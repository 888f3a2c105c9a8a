"""The forward's rows: one call of the base model on them, and the NLL of each row (``MCLModel._forward_nll`` calls
it once per block of examples).

The rows are K*B, hypothesis-major (all K hypotheses, stacked), or B (one hypothesis per example, or the base model);
the routing is set before. The hooks keep the hidden states at label positions only (``loramcl.mcl.logits``), the
context runs once where ``adapt_context=False`` (``loramcl.mcl.context``), and the NLL is that of ``loramcl.mcl.nll``.
"""

from __future__ import annotations

import contextlib

import torch

from loramcl.mcl.batch import flat_index, stacked_target_index
from loramcl.mcl.compat import checkpointing_keeps_cache
from loramcl.mcl.context import without_context
from loramcl.mcl.nll import chunked_token_nll, mean_token_nll, row_means
from loramcl.mcl.scope import ForwardCall
from loramcl.mcl.scores import context_positions


def nll_of_rows(model, inputs: dict, targets: torch.Tensor, positions: torch.Tensor, index: torch.Tensor,
                stacked: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(nll [rows], with hypothesis scores the hidden states they read [rows, d] else None) of one call of the
    base model under the routing already set: rows K*B hypothesis-major (stacked) or B; ``index`` [N_B]: the
    target_index of ``positions`` [B, T]. Fixed shapes throughout (gathers by index, no boolean masks)."""
    base, k, batch = model.base_model, model.num_hypotheses, targets.shape[0]
    given = inputs, targets, positions, index  # the arguments as passed: an unchunked retry starts from them
    keep_cache = contextlib.nullcontext()
    if not model.mcl_config.adapt_context and not model.adapters_disabled:
        inputs, targets, positions = without_context(model, inputs, targets, positions, k if stacked else 1)
        index = flat_index(positions)  # of the positions the call runs
        keep_cache = checkpointing_keeps_cache(base)
    row_positions = positions.repeat(k, 1) if stacked else positions  # [rows, T]
    row_index = stacked_target_index(index, k, positions.numel()) if stacked else index  # [N], over rows*T
    scoring = stacked and model.scoring_head is not None
    chunked = model.label_logits.in_chunks()
    has_output_layer = model.label_logits.output_layer_name is not None
    call = ForwardCall(expand_batch=batch if stacked else None,
                       logit_positions=row_positions if has_output_layer else None, logit_index=row_index,
                       context_positions=context_positions(row_positions) if scoring else None, chunked=chunked)
    with keep_cache:
        outputs = model.run_base({**inputs, "use_cache": False}, call)
    states, label_states = call.context_states, call.label_states
    logits = getattr(outputs, "logits", None)
    if logits is None:
        raise ValueError(f"{type(base).__name__} returns no logits: LoRA-MCL needs a model with a language-"
                         "modeling head (e.g. AutoModelForCausalLM, AutoModelForSeq2SeqLM)")
    token_targets = targets.flatten().index_select(0, index)  # [N_B] in (example, position) order
    if stacked:
        token_targets = token_targets.repeat(k)  # [K*N_B], hypothesis-major like the rows
    rows = torch.div(row_index, positions.shape[1], rounding_mode="floor")  # [N]: the row of each label token
    if chunked:
        logits_of = model.label_logits.logits_of()
        if not model.label_logits.reproduces_logits(logits_of, label_states, logits):
            return nll_of_rows(model, *given, stacked)  # again, unchunked from now on
        token_nll = chunked_token_nll(label_states, token_targets, logits_of, model.mcl_config.logits_chunk_size)
        nll = row_means(token_nll, rows, row_positions.shape[0])  # [rows]
    else:
        token_logits = logits if has_output_layer else logits.flatten(0, 1).index_select(0, row_index)  # [N, V]
        nll = mean_token_nll(token_logits, token_targets, rows, row_positions.shape[0])  # [rows]
    return nll, (states if scoring else None)
