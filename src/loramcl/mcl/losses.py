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


def annealed_weights(nll: torch.Tensor, temperature: float) -> torch.Tensor:
    """Eq. 5: q_k = p_k^(1/tau) / sum_s p_s^(1/tau) = softmax_k(-nll / tau), computed in log space.

    Shifting by the row minimum (softmax is shift-invariant) puts the winner's logit at exactly 0 and
    the others at -inf at worst, so tiny temperatures and large NLLs give the hard assignment, never 0/0.
    """
    nll = nll.float()
    gap = nll - nll.min(dim=1, keepdim=True).values  # [B, K], >= 0, 0 at the winner(s)
    return torch.softmax(-gap / max(temperature, 1e-30), dim=1)


def temperature_at(step: int, config: MCLConfig) -> float | None:
    """tau(t) = tau0 * rho^t at optimizer step t, or None once below temperature_min (hard WTA from then on)."""
    if config.temperature_decay == 1.0:
        tau = config.temperature0
    else:
        # In log space: rho^t underflows to 0.0 long before tau0 * rho^t stops being representable.
        log_tau = math.log(config.temperature0) + step * math.log(config.temperature_decay)
        tau = math.exp(log_tau) if log_tau > -700 else 0.0
    return None if tau < config.temperature_min or tau == 0.0 else tau


def weighted_nll(nll: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """mean_b sum_k q[b, k] nll[b, k] with q detached.

    A non-finite NLL anywhere makes the loss non-finite, even under a zero weight (0 * inf is NaN) or a NaN weight
    (annealed weights of a row holding NaN), so that MCLTrainer's guard stops training: an overflowing or corrupted
    hypothesis must never be trained around in silence.
    """
    return (weights.detach().to(nll.dtype) * nll).sum(dim=1).mean()


WeightFn = Callable[[torch.Tensor, MCLConfig, int], torch.Tensor]


def _annealed(nll: torch.Tensor, config: MCLConfig, step: int) -> torch.Tensor:
    temperature = temperature_at(step, config)
    return wta_weights(nll, config.tie_break) if temperature is None else annealed_weights(nll, temperature)


ASSIGNMENTS: dict[str, WeightFn] = {
    "wta": lambda nll, config, step: wta_weights(nll, config.tie_break),
    "relaxed": lambda nll, config, step: relaxed_weights(nll, config.epsilon, config.tie_break),
    "annealed": _annealed,
}


def mcl_loss(nll: torch.Tensor, config: MCLConfig, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The configured loss of ``nll`` [B, K] at optimizer step ``step``: (scalar loss, weights q [B, K])."""
    if nll.dim() != 2 or nll.shape[1] != config.num_hypotheses:
        raise ValueError(f"nll must have shape [batch, K={config.num_hypotheses}], got {tuple(nll.shape)}")
    with torch.no_grad():
        weights = ASSIGNMENTS[config.loss](nll.detach(), config, step)
    return weighted_nll(nll, weights), weights
