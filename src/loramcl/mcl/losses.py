"""Winner-takes-all losses as pure functions of the per-example, per-hypothesis NLL matrix.

Every loss is ``mean_b sum_k q[b, k] * nll[b, k]`` with assignment weights ``q`` that are detached
(paper eq. 4): the variants differ only in how ``q`` is computed from ``nll``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from loramcl.mcl.config import MCLConfig


def winners(nll: torch.Tensor, tie_break: str = "lowest") -> torch.Tensor:
    """argmin_k nll[b, k] per example: [B, K] -> [B]. Exact ties (identical hypotheses, e.g. every hypothesis at
    initialisation, where LoRA's B = 0) go to the lowest k (``tie_break="lowest"``, the paper's eq. 2), or to one of
    the tied hypotheses drawn uniformly from torch's RNG (``"random"``: seeded by the trainer and restored on resume),
    so that no hypothesis gets every example of the first steps. A row holding NaN gives the NaN's position either way
    (its weight then carries the NaN into the loss). One hypothesis draws nothing: K = 1 trains as plain LoRA does,
    whatever ``tie_break``, to the bit."""
    if tie_break == "lowest" or nll.shape[1] == 1:
        return nll.argmin(dim=1)  # torch.argmin returns the first minimum
    tied = nll == nll.min(dim=1, keepdim=True).values  # [B, K]
    keys = torch.rand(nll.shape, device=nll.device).masked_fill(~tied, -1.0)  # uniform among the tied entries
    return torch.where(tied.any(dim=1), keys.argmax(dim=1), nll.argmin(dim=1))


def wta_weights(nll: torch.Tensor, tie_break: str = "lowest") -> torch.Tensor:
    """Eq. 2: one-hot on the winner argmin_k nll[b, k] (``winners``). [B, K] -> [B, K]."""
    return torch.nn.functional.one_hot(winners(nll, tie_break), nll.shape[1]).to(torch.float32)


def relaxed_weights(nll: torch.Tensor, epsilon: float, tie_break: str = "lowest") -> torch.Tensor:
    """Relaxed WTA (Rupprecht et al. 2017): 1 - epsilon on the winner, epsilon / (K-1) on each other."""
    num_hypotheses = nll.shape[1]
    winner = wta_weights(nll, tie_break)
    if num_hypotheses == 1:
        return winner
    return winner * (1.0 - epsilon) + (1.0 - winner) * (epsilon / (num_hypotheses - 1))


def relaxed_mean_weights(nll: torch.Tensor, epsilon: float, tie_break: str = "lowest") -> torch.Tensor:
    """Relaxed WTA as the released code's multi-head audio model weighs it (``epsilon_form="mean"``): the loss
    (1 - epsilon - epsilon/(K-1)) min_k nll + epsilon/(K-1) mean_k nll, whose weights are 1 - epsilon - epsilon/K on
    the winner (torch.min's first minimum: ``tie_break="lowest"``) and epsilon / (K (K-1)) on each other; they sum to
    1 - epsilon. Eq. 4 at epsilon / (K (1 - epsilon)), scaled by 1 - epsilon. [B, K] -> [B, K]."""
    num_hypotheses = nll.shape[1]
    winner = wta_weights(nll, tie_break)
    if num_hypotheses == 1:
        return winner
    share = epsilon / (num_hypotheses - 1)  # the reference code's coefficient of mean_k
    return winner * (1.0 - epsilon - share) + share / num_hypotheses


def annealed_weights(nll: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """Eq. 5: q_k = p_k^(1/tau) / sum_s p_s^(1/tau) = softmax_k(-nll / tau), computed in log space.

    Shifting by the row minimum (softmax is shift-invariant) puts the winner's logit at exactly 0 and
    the others at -inf at worst, so tiny temperatures and large NLLs give the hard assignment, never 0/0.
    """
    nll = nll.float()
    gap = nll - nll.min(dim=1, keepdim=True).values  # [B, K], >= 0, 0 at the winner(s)
    floor = temperature.clamp_min(1e-30).to(gap.dtype) if torch.is_tensor(temperature) else max(temperature, 1e-30)
    return torch.softmax(-gap / floor, dim=1)


# temperature_decay "auto": tau reaches temperature_min at this fraction of the run's optimizer steps, and the loss is
# vanilla WTA from there, as in our two annealed runs that split (docs/experiments/bilingual.md: WTA from step 182 of
# 200; markov.md's three chains: from step 458 of 500).
AUTO_FLOOR_FRACTION = 0.9


def floor_step(total_steps: int) -> int:
    """The optimizer step from which ``temperature_decay="auto"`` is vanilla WTA: ceil(AUTO_FLOOR_FRACTION * T)."""
    return max(1, math.ceil(AUTO_FLOOR_FRACTION * total_steps))


def temperature_decay(config: MCLConfig, total_steps: int | None = None) -> float:
    """rho of tau(t) = tau0 * rho^t: ``config.temperature_decay``, or for "auto" the rho that brings tau0 to
    temperature_min at ``floor_step(total_steps)``: (tau_min / tau0)^(1 / floor_step)."""
    if config.temperature_decay != "auto":
        return config.temperature_decay
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"temperature_decay 'auto' sets rho from the run's number of optimizer steps, and none is "
                         f"known (got {total_steps!r}): train with MCLTrainer (it passes the run's max_steps), pass "
                         "total_steps to the forward (model(..., step=t, total_steps=T)) or to mcl_step yourself, or "
                         "give temperature_decay a number (the paper's: 0.999)")
    return math.exp((math.log(config.temperature_min) - math.log(config.temperature0)) / floor_step(total_steps))


def schedule_line(config: MCLConfig, total_steps: int) -> str | None:
    """What an annealed run's "auto" schedule chose, for its log; None for any other loss or decay."""
    if config.loss != "annealed" or config.temperature_decay != "auto":
        return None
    return (f"annealed MCL: temperature_decay auto = {temperature_decay(config, total_steps):.6g} per step, tau "
            f"{config.temperature0:g} -> {config.temperature_min:g} at step {floor_step(total_steps)} of "
            f"{total_steps}, vanilla WTA from there")


def temperature_at(step: int, config: MCLConfig, total_steps: int | None = None) -> float | None:
    """tau(t) = tau0 * rho^t at optimizer step t, or None once below temperature_min (hard WTA from then on); with
    ``temperature_decay="auto"``, rho from ``total_steps`` (``temperature_decay``) and None from ``floor_step`` on."""
    decay = temperature_decay(config, total_steps)
    if config.temperature_decay == "auto" and step >= floor_step(total_steps):
        return None  # tau has reached its floor (computed, it may round a hair above it)
    if decay == 1.0:
        tau = config.temperature0
    else:
        # In log space: rho^t underflows to 0.0 long before tau0 * rho^t stops being representable.
        log_tau = math.log(config.temperature0) + step * math.log(decay)
        tau = math.exp(log_tau) if log_tau > -700 else 0.0
    return None if tau < config.temperature_min or tau == 0.0 else tau


def temperature_tensor(step: torch.Tensor, config: MCLConfig, total_steps: int | None = None) -> torch.Tensor:
    """``temperature_at`` of a 0-dim tensor ``step``, as a 0-dim float64 tensor, 0 once hard WTA: tensor ops only, so
    that a compiled forward reads the step as a value (an int step is a constant of its graph: one graph per step)."""
    step = step.double()
    log_tau = math.log(config.temperature0) + step * math.log(temperature_decay(config, total_steps))
    tau = torch.where(log_tau > -700, log_tau.exp(), 0.0)  # in log space, as temperature_at
    hard = tau < config.temperature_min
    if config.temperature_decay == "auto":
        hard = hard | (step >= floor_step(total_steps))
    return torch.where(hard, 0.0, tau)


def split_step(config: MCLConfig, total_steps: int | None) -> int:
    """The first optimizer step of the configured loss under a staged split (``split_after`` > 0):
    ceil(split_after * T) of the run's T optimizer steps (0 without a split: the configured loss from the start)."""
    if not config.split_after:
        return 0
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"split_after {config.split_after!r} is a share of the run's optimizer steps, and none is "
                         f"known (got {total_steps!r}): train with MCLTrainer (it passes the run's max_steps), pass "
                         "total_steps to the forward or to mcl_step yourself, or set split_after 0")
    return max(1, math.ceil(config.split_after * total_steps - 1e-9))  # 1e-9: 0.1 * 30 is 3.0000000000000004


def shared_phase(step: int | torch.Tensor, config: MCLConfig, total_steps: int | None) -> bool | torch.Tensor:
    """Whether optimizer step ``step`` (an int, or a 0-dim tensor: then a 0-dim bool tensor) is in a staged split's
    shared phase, where every hypothesis learns from every example."""
    return step < split_step(config, total_steps)


def step_tensor(kept: torch.Tensor, step: int, device: torch.device) -> torch.Tensor:
    """``step`` in a 0-dim tensor on ``device``, ``kept`` refilled where it is there already (filling it queues a
    kernel, no host sync; a CPU step read by a GPU graph would be copied in, waiting for the stream): what a compiled
    forward passes to ``temperature_tensor``."""
    kept = kept if kept.device == device else torch.zeros((), dtype=torch.long, device=device)
    return kept.fill_(step)


def weighted_nll(nll: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """mean_b sum_k q[b, k] nll[b, k] with q detached.

    A non-finite NLL anywhere makes the loss non-finite, even under a zero weight (0 * inf is NaN) or a NaN weight
    (annealed weights of a row holding NaN), so that MCLTrainer's guard stops training: an overflowing or corrupted
    hypothesis must never be trained around in silence.
    """
    return (weights.detach().to(nll.dtype) * nll).sum(dim=1).mean()


WeightFn = Callable[[torch.Tensor, MCLConfig, int, int | None], torch.Tensor]


def _annealed(nll: torch.Tensor, config: MCLConfig, step: int | torch.Tensor, total_steps: int | None
              ) -> torch.Tensor:
    if torch.is_tensor(step):  # a compiled forward's: no branch on the temperature's value
        tau = temperature_tensor(step, config, total_steps).to(nll.device)
        return torch.where(tau > 0, annealed_weights(nll, tau), wta_weights(nll, config.tie_break))
    temperature = temperature_at(step, config, total_steps)
    return wta_weights(nll, config.tie_break) if temperature is None else annealed_weights(nll, temperature)


ASSIGNMENTS: dict[str, WeightFn] = {
    "wta": lambda nll, config, step, total_steps: wta_weights(nll, config.tie_break),
    "relaxed": lambda nll, config, step, total_steps: (relaxed_mean_weights if config.epsilon_form == "mean" else
                                                       relaxed_weights)(nll, config.relaxed_epsilon, config.tie_break),
    "annealed": _annealed,
}


def balanced(nll: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """nll [B, K] less the balancing bias b [K] (``MCLConfig.balance``), what the winner is the argmin of: argmin_k
    (nll[b, k] - b_k), and the annealed loss's softmax(-(nll - b) / tau); ``nll`` itself, detached, without a bias."""
    return nll.detach() if bias is None else nll.detach().float() - bias.to(nll.device, torch.float32)


def mcl_loss(nll: torch.Tensor, config: MCLConfig, step: int | torch.Tensor = 0, total_steps: int | None = None,
             training: bool = True, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The configured loss of ``nll`` [B, K] at optimizer step ``step`` (an int, or a 0-dim tensor in a compiled
    forward: ``temperature_tensor``) of ``total_steps`` (needed by the annealed
    loss's ``temperature_decay="auto"`` and by ``split_after``): (scalar loss, weights q [B, K]). Outside training
    (``training`` False) or with K = 1, an "auto" schedule of unknown length is read at its end: vanilla WTA (no run's
    length to fit, and nothing learns from these weights; MCLTrainer's evaluation loss is WTA anyway), and a staged
    split is over. ``bias`` [K]: the balancing bias subtracted before the winners are picked (``balanced``)."""
    if nll.dim() != 2 or nll.shape[1] != config.num_hypotheses:
        raise ValueError(f"nll must have shape [batch, K={config.num_hypotheses}], got {tuple(nll.shape)}")
    assignment = ASSIGNMENTS[config.loss]
    if (config.loss == "annealed" and config.temperature_decay == "auto" and total_steps is None
            and (not training or config.num_hypotheses == 1)):
        assignment = ASSIGNMENTS["wta"]
    with torch.no_grad():
        weights = assignment(balanced(nll, bias), config, step, total_steps)
        if config.split_after and training and config.num_hypotheses > 1:  # the staged split's shared phase: 1/K
            shared = shared_phase(step, config, total_steps)
            uniform = torch.full_like(weights, 1.0 / config.num_hypotheses)
            weights = torch.where(shared.to(weights.device), uniform, weights) if torch.is_tensor(shared) else (
                uniform if shared else weights)
    return weighted_nll(nll, weights), weights
