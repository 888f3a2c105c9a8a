"""What the paper's theory says a model trained on a Markov mixture should reach (Prop. 1, Cor. 1, App. C-D).

All losses are in nats per predicted token: the first token is never predicted, so a sequence of length T
contributes T-1 tokens, as in the paper's figures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from loramcl.recipes.markov.chains import MarkovMixture


def entropy_rate(p: np.ndarray, pi: np.ndarray) -> float:
    """H(x_{t+1} | x_t) of a stationary chain: -sum_i pi_i sum_j P_ij log P_ij (Cover & Thomas, Thm 4.2.4)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(p), 0.0)  # [V, V]
    return float(-(pi * plogp.sum(axis=1)).sum())


def conditional_entropy(mixture: MarkovMixture) -> float:
    """H(x | z) per token (eq. 10): the entropy rates weighted by the mixture; the MCL upper bound."""
    return float(sum(w * entropy_rate(p, pi)
                     for w, p, pi in zip(mixture.weights, mixture.chains, mixture.stationary, strict=True)))


def average_transition(mixture: MarkovMixture) -> np.ndarray:
    """P-bar (eq. 7): p(x_{t+1}=j | x_t=i) under the mixture, which an optimal MLE model predicts on average.

    P-bar_ij = sum_k w_k pi_k(i) P_k(i, j) / sum_k w_k pi_k(i): chain k's posterior given the current state
    alone, times its transition (with uniform weights this is the paper's formula).
    """
    joint = (mixture.weights[:, None] * mixture.stationary)  # [K, V]: p(z=k, x_t=i)
    return np.einsum("ki,kij->ij", joint, mixture.chains) / joint.sum(axis=0)[:, None]


def sequence_log_likelihoods(mixture: MarkovMixture, x: np.ndarray) -> np.ndarray:
    """log p(x_2..x_T | x_1, z=k) for each sequence and chain: [N, K]."""
    with np.errstate(divide="ignore"):
        log_p = np.log(mixture.chains)  # [K, V, V]
    steps = log_p[:, x[:, :-1], x[:, 1:]]  # [K, N, T-1]
    return steps.sum(axis=2).T


def _log_joint_first(mixture: MarkovMixture) -> np.ndarray:
    """log p(z = k, x_1 = v) = log w_k + log pi_k(v): [K, V]."""
    with np.errstate(divide="ignore"):
        return np.log(mixture.weights)[:, None] + np.log(mixture.stationary)


def chain_posterior(mixture: MarkovMixture) -> np.ndarray:
    """p(z = k | x_1 = v) = w_k pi_k(v) / sum_j w_j pi_j(v), [V, K]: which chain drew a sequence, given its first
    state (the context the model reads before predicting x_2). What hypothesis scores p(k | c) must learn."""
    log_joint = _log_joint_first(mixture)  # [K, V]
    return np.exp(log_joint - np.logaddexp.reduce(log_joint, axis=0)).T


def optimal_nll(mixture: MarkovMixture, x: np.ndarray) -> float:
    """The true mixture's mean -log p(x_2..x_T | x_1) per predicted token on the sequences x [N, T]: what a perfect
    density model scores on exactly these sequences (H(x) is its expectation)."""
    log_joint = _log_joint_first(mixture)[:, x[:, 0]].T + sequence_log_likelihoods(mixture, x)  # [N, K]
    log_first = np.logaddexp.reduce(_log_joint_first(mixture), axis=0)[x[:, 0]]  # [N]: log p(x_1)
    return float(-(np.logaddexp.reduce(log_joint, axis=1) - log_first).mean() / (x.shape[1] - 1))


def _entropy(log_p: np.ndarray, axis: int) -> np.ndarray:
    return -(np.exp(log_p) * np.where(np.isfinite(log_p), log_p, 0.0)).sum(axis=axis)


def mixture_entropy(mixture: MarkovMixture, num_samples: int = 50_000, seed: int = 0) -> tuple[float, float]:
    """H(x) per predicted token (eq. 11): the MLE optimum, by Monte Carlo. Returns (estimate, standard error).

    The first token is given to the model, not predicted, so this is H(x_2..x_T | x_1) / (T-1). It is computed
    as H(x | z) + I(x_2..x_T; z | x_1) / (T-1), with I = H(z | x_1) - E[H(z | x)]: H(x | z) and H(z | x_1) are
    exact, and only the posterior entropy H(z | x) of each sampled sequence is averaged. This is the same
    expectation as averaging -log p(x_2..x_T | x_1) over samples, with a far smaller variance (each term lies
    in [0, log K]), and it can never leave H(x) above H(x | z) + log K / (T-1).
    """
    x, _ = mixture.sample(num_samples, seed)
    log_prior_x1 = _log_joint_first(mixture)  # [K, V]: log p(z, x_1)
    log_post_x1 = log_prior_x1 - np.logaddexp.reduce(log_prior_x1, axis=0)  # [K, V]: log p(z | x_1)
    p_x1 = np.exp(log_prior_x1).sum(axis=0)  # [V]
    h_z_given_x1 = float((p_x1 * _entropy(log_post_x1, axis=0)).sum())
    log_joint = log_prior_x1[:, x[:, 0]].T + sequence_log_likelihoods(mixture, x)  # [N, K]: log p(z, x)
    log_post = log_joint - np.logaddexp.reduce(log_joint, axis=1, keepdims=True)  # [N, K]: log p(z | x)
    h_z_given_x = _entropy(log_post, axis=1)  # [N]
    tokens = mixture.seq_len - 1
    estimate = conditional_entropy(mixture) + (h_z_given_x1 - h_z_given_x.mean()) / tokens
    return float(estimate), float(h_z_given_x.std(ddof=1) / np.sqrt(num_samples) / tokens)


def bigram_cross_entropy(mixture: MarkovMixture) -> float:
    """Loss per token of a model that predicts P-bar from the current state alone (no use of the context)."""
    pbar = average_transition(mixture)
    joint = mixture.weights[:, None] * mixture.stationary  # [K, V]
    with np.errstate(divide="ignore"):
        log_pbar = np.where(pbar > 0, np.log(pbar), 0.0)
    return float(-np.einsum("ki,kij,ij->", joint, mixture.chains, log_pbar))


@dataclass
class Theory:
    """The numbers a figure of the paper draws: the MLE optimum H(x), the MCL band [H(x) - log K / (T-1),
    H(x|z)] and P-bar, all per predicted token. (With fewer hypotheses than chains, H(x|z) is no longer an
    upper bound of the MCL optimum; it is kept as the value a perfect one-chain-per-hypothesis split reaches.)"""

    mle_optimum: float  # H(x), Monte Carlo
    mle_optimum_stderr: float
    mcl_lower: float  # H(x) - log K / (T-1)  (Prop. 1 (iii a))
    mcl_upper: float  # H(x | z)               (Prop. 1 (iii b))
    bigram_cross_entropy: float  # loss of predicting P-bar from the current state only
    pbar: list[list[float]]
    entropy_rates: list[float]
    stationary: list[list[float]]
    num_samples: int

    def to_dict(self) -> dict:
        return asdict(self)


def theory(mixture: MarkovMixture, num_hypotheses: int | None = None, num_samples: int = 50_000,
           seed: int = 0) -> Theory:
    """The bounds for K = ``num_hypotheses`` (default: one per chain, where the upper bound H(x|z) is reached
    by a perfect assignment of hypotheses to chains)."""
    h_x, stderr = mixture_entropy(mixture, num_samples, seed)
    k = num_hypotheses or mixture.num_chains
    return Theory(
        mle_optimum=h_x, mle_optimum_stderr=stderr,
        mcl_lower=h_x - np.log(k) / (mixture.seq_len - 1),
        mcl_upper=conditional_entropy(mixture),
        bigram_cross_entropy=bigram_cross_entropy(mixture),
        pbar=average_transition(mixture).tolist(),
        entropy_rates=[entropy_rate(p, pi) for p, pi in zip(mixture.chains, mixture.stationary, strict=True)],
        stationary=mixture.stationary.tolist(), num_samples=num_samples)
