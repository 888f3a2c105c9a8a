"""The scoring head (``MCLConfig(scoring=True)``) trains apart from the hypotheses: its gradients clipped by their own
norm (``ScoringGradients``) and its own learning rate (``with_scoring_group``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback


def gradient_norm(parameters: list[nn.Parameter]) -> torch.Tensor:
    """The 2-norm of the gradients of ``parameters`` (of this rank's shards, where sharded: enough to tell a norm that
    is not finite, which the ranks then share)."""
    return torch.nn.utils.get_total_norm([p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                                          for p in parameters])


class ScoringGradients(TrainerCallback):
    """Gradient clipping, the hypotheses and the scoring head each by their own norm: the head's gradients must not
    shrink the hypotheses' step (with them separate, the hypotheses train bit-identically with and without scores).
    Trainer clips every gradient by one norm after the step's last backward, then calls ``on_pre_optimizer_step``. So
    ``after_backward`` (from the trainer's ``training_step``, after that backward) clips the head's gradients by their
    norm and holds them back while Trainer clips the hypotheses' (the norm it logs); ``on_pre_optimizer_step`` gives
    them back. Under DeepSpeed or FSDP (whose clipping spans the whole model), with gradients on device meshes
    (DTensor) or with fp16's loss scaler (which must unscale every gradient at once), Trainer clips them all together.
    Every norm that is not finite is given to ``record`` (``LogStore.record_grad_norm``); fp16's scaler skips such a
    step itself, and DeepSpeed keeps its gradients out of reach.

    accelerator: the trainer's; max_grad_norm: its arguments' (0: no clipping, nothing done here); head: the scoring
    head (``MCLModel.scoring_head``), None without scores."""

    def __init__(self, accelerator: Accelerator, max_grad_norm: float, head: nn.Module | None,
                 record: Callable[[torch.Tensor | None], None]) -> None:
        self.accelerator, self.max_grad_norm, self.head, self.record = accelerator, max_grad_norm, head, record
        self.held: list[tuple[nn.Parameter, torch.Tensor]] = []  # the head's clipped gradients, until the step

    def after_backward(self, model: nn.Module) -> None:
        accelerator = self.accelerator
        if not (accelerator.sync_gradients and self.max_grad_norm > 0):  # only the gradients Trainer clips next
            return
        distributed = accelerator.distributed_type
        if distributed == DistributedType.DEEPSPEED or accelerator.scaler is not None:
            return
        parameters = [p for p in model.parameters() if p.grad is not None]
        if self.head is None or distributed == DistributedType.FSDP or any(isinstance(p.grad, DTensor)
                                                                           for p in parameters):
            self.record(gradient_norm(parameters))
            return
        head_parameters = set(self.head.parameters())
        head_gradients = [p for p in parameters if p in head_parameters]
        self.record(accelerator.clip_grad_norm_(head_gradients, self.max_grad_norm))
        self.record(gradient_norm([p for p in parameters if p not in head_parameters]))
        self.held = [(p, p.grad) for p in head_gradients]
        for p in head_gradients:
            p.grad = None

    def restore(self) -> None:
        for parameter, gradient in self.held:
            parameter.grad = gradient
        self.held = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.restore()


def with_scoring_group(optimizer: torch.optim.Optimizer, head: nn.Module | None, learning_rate: float | None
                       ) -> torch.optim.Optimizer:
    """``optimizer`` with the scoring head's parameters moved to a group of their own at ``learning_rate`` (no weight
    decay; the same schedule applies): a probe on detached features may learn faster than the hypotheses without
    disturbing them. As given without a head or a rate."""
    if head is None or learning_rate is None:
        return optimizer
    head_parameters = set(head.parameters())
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if p not in head_parameters]
    # with the hypotheses frozen (fitting the scores of a finished run) only the head's group is left
    optimizer.param_groups[:] = [group for group in optimizer.param_groups if group["params"]]
    optimizer.add_param_group({"params": list(head_parameters), "lr": learning_rate, "weight_decay": 0.0})
    return optimizer
