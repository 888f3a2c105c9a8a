"""MCLTrainer's own settings: documented fields of a ``TrainingArguments`` subclass, checked when made (as TRL's
``SFTConfig`` holds ``SFTTrainer``'s).

``MCLTrainer(args=MCLTrainingArguments(output_dir=..., two_pass_wta=False))``; plain ``TrainingArguments`` give the
defaults, and the older form ``MCLTrainer(..., two_pass_wta=False)`` still works (``trainer_settings``: the keywords
override the arguments' fields).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields

from transformers import TrainingArguments

from loramcl.training.specialisation import CollapseWatch


@dataclass
class MCLTrainerSettings:
    """The settings of ``MCLTrainer`` that transformers' ``TrainingArguments`` has no field for."""

    two_pass_wta: bool = field(default=True, metadata={"help": (
        "With loss='wta' only the winner of each example gets a gradient, so the trainer scores all K hypotheses "
        "under torch.no_grad(), then runs forward + backward on the winner rows only: the same gradient for about "
        "(K+2)/2 MLE steps of compute instead of K, and K times less activation memory. False backpropagates "
        "through all K (the one-pass reference). With dropout, the two passes draw different dropout masks, so the "
        "winner is picked on another draw of the noise.")})
    scoring_examples_per_block: int | str | None = field(default="auto", metadata={"help": (
        "Two-pass WTA's scoring pass runs the batch this many examples at a time (MCLModel.forward("
        "examples_per_block=)), so that its peak memory, K*n rows at once, stays within that of the winners' "
        "forward + backward on B rows. 'auto': scoring_block(B, K); None: the whole batch at once (K*B rows). The "
        "winners and the gradient are the same either way.")})
    collapse_window: int = field(default=100, metadata={"help": (
        "A warning (once) when a hypothesis has won less than collapse_share of the examples over the last "
        "collapse_window optimizer steps, or over the last quarter of them less than a quarter of a fair share with "
        "a training NLL 10% above the others' (specialisation.CollapseWatch), naming the remedies; the end-of-"
        "training verdict reads the last min(collapse_window, steps / 2) steps.")})
    collapse_share: float = field(default=0.01, metadata={"help": "See collapse_window: a share in [0, 1)."})
    scoring_learning_rate: float | None = field(default=None, metadata={"help": (
        "The learning rate of the hypothesis-scores head (MCLConfig(scoring=True)); None: the trainer's. With Adam "
        "the scoring loss's weight beta barely matters (the step is normalised), this does.")})
    loraplus_lr_ratio: float | None = field(default=None, metadata={"help": (
        "LoRA+ (Hayou et al., ICML 2024): LoRA's B matrices learn at this many times the rate of the rest (A, routers; "
        "lr_B = ratio x lr_A), each of Trainer's param groups split in two (training.optimizer); the paper "
        "recommends about 16 with Adam. None or 1: one rate, the optimizer as without it.")})

    def __post_init__(self) -> None:
        per_block = self.scoring_examples_per_block
        if not (per_block in (None, "auto") or isinstance(per_block, int) and not isinstance(per_block, bool)
                and per_block >= 1):
            raise ValueError(f"scoring_examples_per_block must be 'auto', None or a number of examples >= 1, got "
                             f"{per_block!r}")
        CollapseWatch(self.collapse_window, self.collapse_share)  # checks them
        rate = self.scoring_learning_rate
        if rate is not None and not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"scoring_learning_rate must be a finite number > 0, got {rate!r}")
        ratio = self.loraplus_lr_ratio
        if ratio is not None and not (isinstance(ratio, int | float) and not isinstance(ratio, bool)
                                      and math.isfinite(ratio) and ratio > 0):
            raise ValueError(f"loraplus_lr_ratio must be a finite number > 0 (LoRA+: about 16) or None, got {ratio!r}")


SETTING_NAMES = tuple(setting.name for setting in fields(MCLTrainerSettings))


@dataclass
class MCLTrainingArguments(MCLTrainerSettings, TrainingArguments):
    """``TrainingArguments`` with ``MCLTrainer``'s own settings (``MCLTrainerSettings``'s fields, after
    transformers')."""

    def __post_init__(self) -> None:
        TrainingArguments.__post_init__(self)
        MCLTrainerSettings.__post_init__(self)


def trainer_settings(args: TrainingArguments | None, keywords: dict) -> MCLTrainerSettings:
    """The settings an ``MCLTrainer`` runs with: ``args``' fields where it is an ``MCLTrainingArguments`` (else the
    defaults), each of ``keywords`` (the older ``MCLTrainer(two_pass_wta=...)`` form) overriding its field."""
    given = {name: getattr(args, name) for name in SETTING_NAMES} if isinstance(args, MCLTrainerSettings) else {}
    return MCLTrainerSettings(**{**given, **keywords})


def trainer_copy(args: TrainingArguments | None) -> TrainingArguments:
    """MCLTrainer's copy of the caller's arguments (Trainer's default when None), with ``ddp_find_unused_parameters``
    False unless set: every adapter tensor takes part in every MCL forward (all routings index the stacked tensors), so
    DDP need not search the graph for unused ones, which Trainer assumes it must for a model that is not a
    ``PreTrainedModel``."""
    args = TrainingArguments(output_dir="tmp_trainer") if args is None else copy.copy(args)
    if args.ddp_find_unused_parameters is None:
        args.ddp_find_unused_parameters = False
    return args


def refuse_ignored_options(args: TrainingArguments, compute_loss_func) -> None:
    """MCLTrainer's compute_loss is its own: these Trainer options would otherwise be silently ignored."""
    if args.label_smoothing_factor:
        raise ValueError("label_smoothing_factor is not supported: the MCL losses are computed on the plain "
                         "per-example NLL (paper eq. 2-5); set it to 0")
    if compute_loss_func is not None:
        raise ValueError("compute_loss_func is not used by MCLTrainer: the loss is MCLConfig.loss; choose it there")
