"""One training step of an MCL model: a batch's loss, weights and winners (docs/architecture.md, "One training step").

``MCLTrainer.compute_loss`` and the benchmarks' ``train_step`` both call ``mcl_step``, so a benchmark times the step
that training runs. Two ways to the gradient (docs/architecture.md, "Two-pass hard WTA"):

  stacked:  forward of all K hypotheses with gradient [K*B rows] -> nll [B, K] -> loss (``losses.mcl_loss``) in the
            forward, its weights q [B, K]; the winners are argmax_k q (ties broken as the loss broke them)
  two-pass: forward of all K without gradient, ``examples_per_block`` examples at a time -> nll [B, K]
            -> winners [B] (``losses.winners``, ties broken as ``MCLConfig.tie_break`` says)
            -> forward of each example's winner with gradient [B rows] -> loss = mean_b nll[b, winner_b]

With hypothesis scores (``MCLConfig(scoring=True)``) the scoring head learns from the pass that ran all K (the
scoring pass, two-pass) and ``scoring_weight`` times its loss is in ``loss``. The schedule position (``step`` of
``total_steps``, for the annealed temperature) is an argument: nothing is kept on the model between steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loramcl.mcl.config import MCLConfig
from loramcl.mcl.losses import balanced, shared_phase
from loramcl.mcl.losses import winners as loss_winners
from loramcl.mcl.model import MCLOutput


@dataclass
class MCLStepOutput(MCLOutput):
    """``MCLOutput`` of a training step: ``loss`` (scalar, the scoring loss included), ``nll`` [B, K] (what the
    winners were picked from: the scoring pass's, two-pass), ``weights`` [B, K] (the stacked loss's q; None two-pass,
    where they are one-hot on the winners), ``log_scores``, ``mixture_nll``, ``scoring_loss`` (with scores), and:

    winners: [B] the hypothesis that won each example, which the loss trained.
    """

    winners: torch.Tensor | None = None


def scoring_block(batch: int, num_hypotheses: int) -> int:
    """Examples per block of two-pass WTA's scoring pass: about as many rows per block (K*n) as the winners' pass
    has (B), so that the scoring pass, which keeps no activations, peaks below the winners' forward + backward."""
    return max(1, -(-batch // num_hypotheses))  # ceil(B / K)


def hard_wta_at(step: int, config: MCLConfig, total_steps: int | None) -> bool:
    """Whether the loss at optimizer step ``step`` is hard WTA of K >= 2 hypotheses, whose gradient two-pass WTA
    computes: ``loss="wta"``, outside a staged split's shared phase (``MCLConfig.split_after``)."""
    return config.loss == "wta" and config.num_hypotheses > 1 and not shared_phase(step, config, total_steps)


def mcl_step(model: nn.Module, inputs: dict, config: MCLConfig, *, step: int | torch.Tensor = 0,
             total_steps: int | None = None, two_pass: bool = False, examples_per_block: int | str | None = None,
             target_index: torch.Tensor | None = None, balance_bias: torch.Tensor | None = None) -> MCLStepOutput:
    """The loss of one training step of ``model`` (an ``MCLModel`` as called: wrapped by DDP or compiled, in train
    mode) on ``inputs`` (the batch with its ``labels``), ``config`` its ``MCLConfig``; the caller runs the backward.

    step, total_steps: the optimizer step and the run's optimizer steps (the annealed temperature's t and T; T for
        ``temperature_decay="auto"`` only). ``step`` is an int, or for a compiled model a 0-dim tensor on the adapters'
        device (``losses.step_tensor``), so that one graph serves every step.
    two_pass: two-pass hard WTA (``loss="wta"`` only, outside a staged split's shared phase: ``hard_wta_at``, which
        the caller checks for a tensor ``step``); else the stacked forward.
    examples_per_block: the scoring pass's examples per call; "auto": ``scoring_block(B, K)`` where ``target_index``
        is given (else the whole batch); None: the whole batch.
    target_index: the batch's ``checked_target_index`` [N] (``loramcl.mcl.batch.batch_target_index``), found by
        each forward when None.
    balance_bias: [K] the balancing bias (``MCLConfig.balance``, ``loramcl.training.balance``): the winners are
        argmin_k (nll - bias); None: argmin_k nll.
    """
    if not two_pass:
        bias = {} if balance_bias is None else {"balance_bias": balance_bias}
        outputs = model(**inputs, step=step, total_steps=total_steps, target_index=target_index, **bias)
        winners = outputs.weights.argmax(dim=1)  # [B]: ties as the loss broke them
        if config.split_after and config.num_hypotheses > 1:  # the shared phase's q is 1/K: its winners are the nll's
            shared = shared_phase(step, config, total_steps)
            nll_winners = loss_winners(balanced(outputs.nll, balance_bias), config.tie_break)
            winners = torch.where(shared.to(winners.device), nll_winners, winners) if torch.is_tensor(shared) else (
                nll_winners if shared else winners)
        return MCLStepOutput(**outputs, winners=winners)
    if config.loss != "wta":
        raise ValueError(f"two-pass WTA computes hard WTA's gradient; loss={config.loss!r} needs every hypothesis's "
                         "gradient: run the stacked step (two_pass=False)")
    if config.split_after and not torch.is_tensor(step) and shared_phase(step, config, total_steps):
        raise ValueError(f"two-pass WTA computes hard WTA's gradient, and step {step} is in the shared phase of the "
                         f"staged split (split_after={config.split_after!r}), where every hypothesis learns from every "
                         "example: run the stacked step (two_pass=False) there, as MCLTrainer does (hard_wta_at)")
    if examples_per_block == "auto":  # without a target_index, each block would find its label positions on the host
        examples_per_block = None if target_index is None else scoring_block(inputs["labels"].shape[0],
                                                                              config.num_hypotheses)
    with torch.no_grad():  # nll [B, K]; the scoring head, if any, learns from this pass
        scored = model(**inputs, examples_per_block=examples_per_block, target_index=target_index,
                       total_steps=total_steps)  # the run's length, which a staged split's loss reads (weights unused)
    winners = loss_winners(balanced(scored.nll, balance_bias), config.tie_break)  # [B]; no host read between passes
    outputs = model(**inputs, hypotheses=winners, target_index=target_index)  # forward + backward of the winners
    loss = outputs.loss
    if scored.scoring_loss is not None:
        loss = loss + config.scoring_weight * scored.scoring_loss
    return MCLStepOutput(loss=loss, nll=scored.nll, log_scores=scored.log_scores, mixture_nll=scored.mixture_nll,
                         scoring_loss=scored.scoring_loss, winners=winners)
