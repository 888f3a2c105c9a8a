"""Mixtures of first-order Markov chains (paper §3.3, App. C-D): definition, validation, sampling, presets."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from loramcl.utils.files import read_utf8


def two_state(p: float, q: float) -> list[list[float]]:
    """The paper's P(p, q) = [[1-p, p], [q, 1-q]]."""
    return [[1 - p, p], [q, 1 - q]]


@dataclass
class MarkovMixture:
    """x ~ sum_k w_k MC(P_k): pick chain k with probability w_k, draw x_1 from its stationary distribution,
    then x_{t+1} ~ P_k[x_t] up to length ``seq_len``.

    chains: [K, V, V] transition matrices, rows are probability vectors (P[i, j] = p(x_{t+1}=j | x_t=i)).
    weights: [K] mixture weights (uniform when None).
    """

    chains: np.ndarray
    weights: np.ndarray | None = None
    seq_len: int = 32
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        chains = _numbers(self.chains, "chains")
        if chains.ndim != 3 or chains.shape[1] != chains.shape[2]:
            raise ValueError(f"chains must be a list of square transition matrices [K][V][V], got shape "
                             f"{chains.shape}")
        if chains.shape[1] < 2:
            raise ValueError(f"the vocabulary needs at least 2 states, got V={chains.shape[1]}")
        if not np.isfinite(chains).all() or (chains < 0).any():
            raise ValueError("transition matrices must hold finite, non-negative probabilities")
        sums = chains.sum(axis=2)  # [K, V]
        bad = np.argwhere(np.abs(sums - 1) > 1e-6)
        if len(bad):
            k, i = bad[0]
            raise ValueError(f"row {i} of chain {k} sums to {sums[k, i]:.6g}, not 1: each row P[i] is the "
                             f"distribution of the next state after state {i}")
        k = chains.shape[0]
        weights = np.full(k, 1 / k) if self.weights is None else _numbers(self.weights, "weights")
        if (weights.shape != (k,) or not np.isfinite(weights).all() or (weights <= 0).any()
                or abs(weights.sum() - 1) > 1e-6):
            raise ValueError(f"weights must be {k} positive numbers summing to 1 (one per chain), got "
                             f"{np.asarray(self.weights).tolist()}")
        if not isinstance(self.seq_len, int) or isinstance(self.seq_len, bool) or self.seq_len < 2:
            raise ValueError(f"seq_len must be an integer >= 2 (the first token is never predicted), got "
                             f"{self.seq_len!r}")
        self.chains, self.weights = chains, weights
        self.stationary = np.stack([stationary_distribution(p) for p in chains])  # [K, V]

    @property
    def num_chains(self) -> int:
        return self.chains.shape[0]

    @property
    def num_states(self) -> int:
        return self.chains.shape[1]

    def sample(self, num: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """``num`` sequences [num, T] (int64) and the chain that drew each [num]."""
        rng = np.random.default_rng(seed)
        component = rng.choice(self.num_chains, size=num, p=self.weights)  # [N]
        cumulative = np.cumsum(self.chains, axis=2)  # [K, V, V]
        cumulative[..., -1] = 1.0  # rounding never leaves a uniform draw past the last state
        first = np.cumsum(self.stationary, axis=1)  # [K, V]
        first[:, -1] = 1.0
        x = np.empty((num, self.seq_len), dtype=np.int64)
        u = rng.random((num, self.seq_len))  # [N, T]
        x[:, 0] = (u[:, :1] > first[component]).sum(axis=1)
        for t in range(1, self.seq_len):
            rows = cumulative[component, x[:, t - 1]]  # [N, V]
            x[:, t] = (u[:, t:t + 1] > rows).sum(axis=1)
        return x, component

    def to_dict(self) -> dict:
        return {"chains": self.chains.tolist(), "weights": self.weights.tolist(), "seq_len": self.seq_len}

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> MarkovMixture:
        """Read ``{"chains": [[[...]]], "weights": [...], "seq_len": 32}`` (weights and seq_len optional)."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"chains file {path} does not exist")
        try:
            spec = json.loads(read_utf8(path))
        except json.JSONDecodeError as e:
            raise ValueError(f"chains file {path} is not valid JSON: {e}") from None
        if not isinstance(spec, dict) or "chains" not in spec:
            raise ValueError(f'chains file {path} must hold an object {{"chains": [[[...], ...], ...], '
                             f'"weights": [...], "seq_len": 32}} ("weights" and "seq_len" optional)')
        unknown = set(spec) - {"chains", "weights", "seq_len"}
        if unknown:
            raise ValueError(f"chains file {path} has unknown keys {sorted(unknown)}; allowed: chains, weights, "
                             "seq_len")
        try:
            return cls(spec["chains"], spec.get("weights"), spec.get("seq_len", 32), name=os.path.basename(str(path)))
        except ValueError as e:
            raise ValueError(f"chains file {path}: {e}") from None


def _numbers(values, name: str) -> np.ndarray:
    """A float64 array of ``values``, which must be numbers (nested lists of the same sizes): the text "0.8" or a
    boolean is refused rather than converted."""
    try:
        array = np.asarray(values)
    except ValueError:  # ragged nested lists
        raise ValueError(f"{name} must be nested lists of numbers, all the same size") from None
    if array.dtype.kind not in "iuf":
        raise ValueError(f"{name} must hold numbers only (not text or true/false), got {str(values)[:200]}")
    return array.astype(np.float64)


def stationary_distribution(p: np.ndarray) -> np.ndarray:
    """pi with pi P = pi, sum(pi) = 1 (least squares on [P^T - I; 1], unique for an irreducible chain)."""
    v = p.shape[0]
    system = np.vstack([p.T - np.eye(v), np.ones((1, v))])  # [V+1, V]
    target = np.zeros(v + 1)
    target[-1] = 1.0
    pi, _, rank, _ = np.linalg.lstsq(system, target, rcond=None)
    if rank < v or np.abs(system @ pi - target).max() > 1e-8 or (pi < -1e-10).any():
        raise ValueError("this chain has no unique stationary distribution (it is reducible); make every state "
                         "reachable from every other")
    return np.clip(pi, 0, None) / np.clip(pi, 0, None).sum()


PRESET_CHAINS = {
    "fig2": [two_state(0.2, 0.9), two_state(0.8, 0.25)],  # paper Fig. 2
    "fig6": [two_state(0.7, 0.8), two_state(0.8, 0.25)],  # paper Fig. 6 (App. D)
    # three chains over three states, each with its own favourite cycle
    "three": [[[0.1, 0.8, 0.1], [0.1, 0.1, 0.8], [0.8, 0.1, 0.1]],
              [[0.1, 0.1, 0.8], [0.8, 0.1, 0.1], [0.1, 0.8, 0.1]],
              [[0.8, 0.1, 0.1], [0.1, 0.8, 0.1], [0.1, 0.1, 0.8]]],
}


# presets with unequal mixture weights (uniform otherwise)
PRESET_WEIGHTS = {"fig2-weighted": [0.7, 0.3]}
PRESET_CHAINS["fig2-weighted"] = PRESET_CHAINS["fig2"]  # fig2's chains, drawn 70% / 30%


def preset_mixture(name: str) -> MarkovMixture:
    if name not in PRESET_CHAINS:
        raise ValueError(f"unknown chains preset {name!r}; choose one of {sorted(PRESET_CHAINS)}")
    return MarkovMixture(np.array(PRESET_CHAINS[name]), PRESET_WEIGHTS.get(name), name=name)
