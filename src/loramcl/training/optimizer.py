"""MCLTrainer's parameter groups: Trainer's optimizer (its weight-decay split, optimizer class and arguments kept),
with LoRA+'s B matrices at their own rate (``with_loraplus_groups``) and the scoring head at its own
(``scoring_head.with_scoring_group``).

LoRA+ (Hayou et al., ICML 2024, "LoRA+: Efficient Low Rank Adaptation of Large Models"): B learns at lambda times A's
rate (lr_B = loraplus_lr_ratio x lr_A); the paper recommends about 16 with Adam on language models. PEFT's
``peft.optimizers.create_loraplus_optimizer`` builds a new optimizer from a ``PeftModel`` instead: it would drop
Trainer's choice of optimizer and its arguments (``optim``, betas, the DTensor mesh split), give A the decay of its own
``loraplus_weight_decay`` (0 by default) rather than Trainer's ``weight_decay``, and put every 1-D tensor (the scoring
head's bias) at B's rate. Here each of Trainer's groups is split in two instead, B at lambda times the group's rate.
"""

from __future__ import annotations

import torch
from torch import nn

from loramcl.training.arguments import MCLTrainerSettings
from loramcl.training.scoring_head import with_scoring_group

LORA_B = "lora_B"  # the name of a LoRA B tensor (MCLLoraLinear's [K, r, d_out], the MoE experts' [E, r, d_out])


def loraplus_b_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable tensors LoRA+ speeds up: every ``lora_B``. A, the LoRA-MoE routers and the scoring head keep the
    trainer's rate (LoRA+'s argument is about the product B A; a router is no such factor)."""
    return [p for name, p in model.named_parameters() if p.requires_grad and name.rsplit(".", 1)[-1] == LORA_B]


def with_loraplus_groups(optimizer: torch.optim.Optimizer, model: nn.Module, ratio: float | None
                         ) -> torch.optim.Optimizer:
    """``optimizer`` with the LoRA B tensors of each param group moved to a group of their own, after it, at ``ratio``
    times that group's learning rate (its weight decay and other settings kept; the schedule scales every group's
    rate alike). As given when ``ratio`` is None or 1 (the optimizer of plain LoRA, to the bit). A model without LoRA
    B tensors (the multi-head baseline duplicates whole modules) is refused: the ratio would do nothing."""
    if ratio is None or ratio == 1:
        return optimizer
    b_parameters = set(loraplus_b_parameters(model))
    if not b_parameters:
        raise ValueError(f"loraplus_lr_ratio {ratio!r} sets the learning rate of LoRA's B matrices, and this model has "
                         "none (the multi-head baseline trains whole copies of a module): leave loraplus_lr_ratio out")
    groups = []
    for group in optimizer.param_groups:
        options = {key: value for key, value in group.items() if key != "params"}
        b_group = [p for p in group["params"] if p in b_parameters]
        group["params"] = [p for p in group["params"] if p not in b_parameters]
        groups.append((group, {**options, "params": b_group, "lr": options["lr"] * ratio} if b_group else None))
    optimizer.param_groups[:] = []
    for group, b_group in groups:  # each group followed by its B group, in Trainer's order
        optimizer.param_groups.append(group)
        if b_group is not None:
            optimizer.add_param_group(b_group)
    return optimizer


def mcl_param_groups(optimizer: torch.optim.Optimizer, model: nn.Module, settings: MCLTrainerSettings
                     ) -> torch.optim.Optimizer:
    """Trainer's ``optimizer`` for ``model`` (an ``MCLModel``) in MCLTrainer's groups: LoRA+'s B groups
    (``settings.loraplus_lr_ratio``), then the scoring head's own (``settings.scoring_learning_rate``)."""
    optimizer = with_loraplus_groups(optimizer, model, settings.loraplus_lr_ratio)
    return with_scoring_group(optimizer, model.scoring_head, settings.scoring_learning_rate)
