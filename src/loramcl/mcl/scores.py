"""Hypothesis scores p(k | c) and the mixture likelihood they define (an extension of the paper, off by default).

LoRA-MCL gives K candidates but no probability for them: only the oracle min_k NLL. Following the scoring heads of
resilient MCL (Letzelter et al., NeurIPS 2023), each hypothesis k gets a score s_k = w_k . h_k + b_k from its own
hidden state h_k at the last context position (the position that predicts the first target token; an
encoder-decoder's first decoder position), and p(k | c) = softmax_k(s). Then

    p(x | c) = sum_k p(k | c) p_k(x | c)

is a proper mixture density: ``mixture_nll`` is its negative log-likelihood per target token (log-sum-exp over K).

Training target. The head minimises the mixture NLL with the hypotheses' NLLs detached, whose gradient with respect
to the scores is p(k | c) - r_k, r_k = p(k | c) p_k(x | c) / sum_j p(j | c) p_j(x | c): cross-entropy against the
posterior responsibility of each hypothesis (EM's E-step). We use that rather than the winner index (hard WTA) or
the loss's assignment q: the winner estimates P(k wins | c), which differs from the mixture weight where modes
overlap, and q carries the training devices of the loss (relaxed WTA's epsilon floor, annealing's temperature), not
beliefs. With the posterior target, p(k | c) converges to the mixture weight that maximises the likelihood, which is
what the mixture NLL and the Markov check (the chain's posterior given the context) need.

The head reads the hidden states detached: the hypotheses are trained exactly as without scores (bit-identical), and
the head costs one [K, d] map per forward; with two-pass WTA its loss uses the scoring pass's states.
"""

from __future__ import annotations

import torch
from torch import nn


class HypothesisScores(nn.Module):
    """s_k = w_k . h_k + b_k for each hypothesis k; ``forward`` gives log p(k | c) = log_softmax_k(s).

    weight [K, d], bias [K], both zero at initialisation (p uniform), float32.
    """

    def __init__(self, num_hypotheses: int, hidden_size: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_hypotheses, hidden_size, device=device))
        self.bias = nn.Parameter(torch.zeros(num_hypotheses, device=device))

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """states: [K, B, d] (hypothesis k's hidden state for example b) or [B, d] (one state shared by all
        hypotheses) -> log p(k | c) [B, K]."""
        states = states.to(self.weight.dtype)
        if states.dim() == 2:
            scores = states @ self.weight.T  # [B, K]
        else:
            scores = torch.einsum("kbd,kd->bk", states, self.weight)  # [B, K]
        return (scores + self.bias).log_softmax(dim=-1)

    def extra_repr(self) -> str:
        return f"hypotheses={self.weight.shape[0]}, hidden={self.weight.shape[1]}"


def mixture_nll(log_scores: torch.Tensor, nll: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """-log sum_k p(k | c) p_k(x | c) per target token: log_scores [B, K], nll [B, K] (mean NLL per token of each
    hypothesis), num_tokens [B] -> [B]. Computed by log-sum-exp over the sequence log-likelihoods, never NaN for
    finite inputs. By Jensen it is <= sum_k p(k | c) nll[b, k]."""
    tokens = num_tokens.to(nll.dtype).unsqueeze(1)  # [B, 1]
    return -torch.logsumexp(log_scores.to(nll.dtype) - nll * tokens, dim=1) / tokens.squeeze(1)


def context_positions(positions: torch.Tensor) -> torch.Tensor:
    """The last context position of each row: the first position whose output predicts a target token.
    positions: [rows, T] bool (outputs aligned with a target) -> [rows]."""
    return positions.int().argmax(dim=1)


def scoring_head_for(output_layer: nn.Module | None, model: nn.Module, num_hypotheses: int,
                     device: torch.device) -> HypothesisScores:
    """A new hypothesis-scores head reading the hidden states ``output_layer`` receives."""
    if output_layer is None or getattr(output_layer, "weight", None) is None or output_layer.weight.dim() != 2:
        raise ValueError(f"scoring=True reads the hidden state the output layer receives; "
                         f"{type(model).__name__} has no output layer with a weight matrix")
    hidden_size = output_layer.weight.shape[1]  # nn.Linear's weight is [V, d]
    return HypothesisScores(num_hypotheses, hidden_size, device=device)
