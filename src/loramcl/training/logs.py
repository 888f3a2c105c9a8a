"""MCLTrainer's log values in one store (as TRL's ``_metrics`` feeds ``SFTTrainer.log``): filled by ``compute_loss``
and the gradient clipping without a host read, reduced over the ranks and emptied when the trainer logs."""

from __future__ import annotations

from collections.abc import Callable

import torch

from loramcl.mcl.step import MCLStepOutput
from loramcl.training.specialisation import log_values

Reduce = Callable[[torch.Tensor], torch.Tensor]  # a sum over the ranks (accelerator.reduce)


class LogStore:
    """Training: sums on the device since the last log (wins, NLLs, oracle NLL, the first step's NLL), the flags of a
    loss or gradient norm that was not finite, the latest annealed temperature. Evaluation: each batch's per-example
    NLL [B, K] and mixture NLL [B], turned into metrics named ``{prefix}_...`` when the evaluation logs."""

    def __init__(self, num_hypotheses: int, device: torch.device) -> None:
        self.wins = torch.zeros(num_hypotheses, dtype=torch.long, device=device)  # [K] examples won
        self.nll = torch.zeros(num_hypotheses, device=device)  # [K] sum over the examples
        self.oracle = torch.zeros((), device=device)  # sum of min_k nll
        self.initial_nll = torch.zeros(2, device=device)  # [NLL sum, examples] of the first step
        self.nonfinite_loss = torch.zeros((), dtype=torch.bool, device=device)  # checked when logging and saving
        self.nonfinite_grad_norm = torch.zeros((), dtype=torch.bool, device=device)  # likewise
        self.temperature: float | None = None  # tau of the latest training step (annealed loss)
        # MCLConfig.balance "bias" (training.balance owns them): the bias [K] the training step subtracts before it
        # picks the winners, logged as bias_h{k}, and the wins [K] of this optimizer step's micro-batches
        self.balance_bias: torch.Tensor | None = None
        self.step_wins: torch.Tensor | None = None
        self.eval_prefix = "eval"
        self.eval_nll: list[torch.Tensor] = []  # [B, K] per batch, gathered over the ranks, on the CPU
        self.eval_mixture: list[torch.Tensor] = []  # [B] per batch, likewise

    def record_step(self, step: MCLStepOutput, first: bool) -> None:
        """A training step's loss, winners [B] and nll [B, K] (``first``: of the run's first optimizer step, the base
        model's NLL, against which the split gap is judged)."""
        self.nonfinite_loss |= ~torch.isfinite(step.loss.detach())  # no host sync here
        wins = torch.bincount(step.winners, minlength=self.wins.shape[0]).to(self.wins.device)  # [K]
        self.wins += wins
        if self.step_wins is not None:
            self.step_wins += wins
        nll = step.nll.detach().float()  # [B, K], what the loss saw
        self.nll += nll.sum(dim=0).to(self.nll.device)
        self.oracle += nll.min(dim=1).values.sum().to(self.oracle.device)
        if first:
            self.initial_nll[0] += nll.mean(dim=1).sum().to(self.initial_nll.device)
            self.initial_nll[1] += nll.shape[0]

    def record_grad_norm(self, norm) -> None:
        """Record a gradient norm that is not finite: clipping by it zeroes the step (or makes it NaN), so training
        would go on without learning."""
        if norm is not None:
            finite = torch.isfinite(torch.as_tensor(norm)).to(self.nonfinite_grad_norm.device)
            self.nonfinite_grad_norm |= ~finite  # no host sync here

    def check_finite(self, step: int, reduce: Reduce | None = None) -> None:
        """Raise if a loss or a gradient norm was not finite (on any rank, with ``reduce``), before ``step``."""
        flags = torch.stack([self.nonfinite_loss, self.nonfinite_grad_norm])  # this rank's own
        if reduce is not None:
            flags = reduce(flags.int())
        if flags[0]:
            raise FloatingPointError(
                f"the training loss became NaN or infinite before step {step}; stopping before any checkpoint is "
                "written with broken adapters. Lower the learning rate, train in bf16 or fp32 rather than fp16, or "
                "check the inputs of the base model.")
        if flags[1]:
            raise FloatingPointError(
                f"the gradient norm became infinite or NaN before step {step}: clipping by it zeroes the update, so "
                "the adapters stop learning; stopping before any checkpoint is written. Lower the adapters' scaling "
                "alpha / r (the paper's: 1 to 4) or the learning rate, or check the inputs of the base model.")

    def drain(self, reduce: Reduce) -> dict[str, float]:
        """``win_rate_h{k}``, ``nll_h{k}``, ``split_gap`` (and ``initial_nll`` in the first log) of the steps since
        the last log, summed over the ranks; the sums start again from 0. With a balancing bias, ``bias_h{k}``: its
        value now (the same on every rank)."""
        totals = (self.wins, self.nll, self.oracle, self.initial_nll)
        sums = [reduce(total.clone()) for total in totals]
        for total in totals:
            total.zero_()
        logs = log_values(*sums)
        if self.balance_bias is not None and logs:
            logs |= {f"bias_h{k}": value for k, value in enumerate(self.balance_bias.tolist())}
        return logs

    def start_evaluation(self, prefix: str) -> None:
        self.eval_prefix, self.eval_nll, self.eval_mixture = prefix, [], []

    def record_evaluation(self, nll: torch.Tensor, mixture: torch.Tensor | None) -> None:
        """An evaluation batch's nll [B, K] and mixture NLL [B] (or None), gathered over the ranks."""
        self.eval_nll.append(nll.float().cpu())
        if mixture is not None:
            self.eval_mixture.append(mixture.float().cpu())

    def evaluation_metrics(self) -> dict[str, float]:
        """``{prefix}_nll_h{k}``, ``{prefix}_win_rate_h{k}`` and ``{prefix}_mixture_nll`` of the evaluation recorded
        since it began; the records are dropped."""
        metrics, prefix = {}, self.eval_prefix
        if self.eval_nll:
            nll = torch.cat(self.eval_nll)  # [N, K]
            wins = torch.bincount(nll.argmin(dim=1), minlength=nll.shape[1]).float() / nll.shape[0]
            for k in range(nll.shape[1]):
                metrics[f"{prefix}_nll_h{k}"] = nll[:, k].mean().item()
                metrics[f"{prefix}_win_rate_h{k}"] = wins[k].item()
        if self.eval_mixture:
            metrics[f"{prefix}_mixture_nll"] = torch.cat(self.eval_mixture).mean().item()
        self.eval_nll, self.eval_mixture = [], []
        return metrics
