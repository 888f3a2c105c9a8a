"""Typed configuration of a LoRA-MCL model, validated on construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

LossName = Literal["wta", "relaxed", "annealed"]
LOSS_NAMES: tuple[str, ...] = ("wta", "relaxed", "annealed")
ADAPTER_DTYPES: tuple[str, ...] = ("float32", "base")


@dataclass
class MCLConfig:
    """K LoRA hypotheses on a frozen model, trained with a winner-takes-all loss (paper §3.3).

    Defaults follow the paper where it has one value; the loss defaults to vanilla WTA (eq. 2).
    The paper's settings are: audio r=alpha=8, dropout 0.1, K=5, relaxed epsilon in
    {0.0005, 0.05} or annealed; vision r=8 alpha=32, K=3, relaxed epsilon=0.1; translation
    r=16 alpha=32, K=3, relaxed epsilon=0.05.
    """

    num_hypotheses: int = 2
    """K, the number of hypotheses (LoRA adapter sets). K=1 is plain LoRA fine-tuning (LoRA-MLE)."""

    r: int = 8
    """LoRA rank of every hypothesis. For a LoRA-MLE baseline with the same trainable count, use rank K*r."""

    alpha: float = 8.0
    """LoRA scaling numerator: the adapter output is multiplied by alpha / r, in training and inference alike."""

    dropout: float = 0.0
    """Dropout on the adapter input (the frozen branch is not affected), active in training mode only."""

    target_modules: list[str] | str | None = None
    """Layers that get adapters, matched as PEFT matches them: a list of names (a layer matches if its full
    name equals an entry or ends with '.' + entry), a regular expression string (full match), or 'all-linear'
    (every linear layer but the output layer). None takes PEFT's default for the architecture."""

    loss: LossName = "wta"
    """Training loss over the per-hypothesis NLLs: 'wta' (eq. 2, only the winner learns), 'relaxed'
    (eq. 4: 1-epsilon on the winner, epsilon/(K-1) on each other) or 'annealed' (eq. 5: softmax(-nll/tau))."""

    epsilon: float = 0.0
    """Relaxed-WTA weight shared by the non-winning hypotheses, in [0, (K-1)/K]; used when loss='relaxed'."""

    temperature0: float = 1.0
    """Annealed MCL: initial temperature tau(0)."""

    temperature_decay: float = 0.999
    """Annealed MCL: tau(t) = temperature0 * temperature_decay**t, t counting optimizer steps."""

    temperature_min: float = 1e-6
    """Annealed MCL: once tau(t) < temperature_min the loss is vanilla WTA."""

    adapter_dtype: Literal["float32", "base"] = "float32"
    """dtype of the adapter tensors and their matmuls: 'float32' (as PEFT does by default, so bf16/fp16 bases
    still train stable adapters) or 'base' (the frozen layer's dtype)."""

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, tuple | set):
            self.target_modules = sorted(self.target_modules)
        _check(isinstance(self.num_hypotheses, int) and self.num_hypotheses >= 1,
               f"num_hypotheses must be an integer >= 1, got {self.num_hypotheses!r}")
        _check(isinstance(self.r, int) and self.r >= 1, f"r (LoRA rank) must be an integer >= 1, got {self.r!r}")
        _check(self.alpha > 0, f"alpha must be > 0 (the adapter output is scaled by alpha/r), got {self.alpha!r}")
        _check(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout!r}")
        _check(self.loss in LOSS_NAMES, f"loss must be one of {LOSS_NAMES}, got {self.loss!r}")
        _check(self.adapter_dtype in ADAPTER_DTYPES,
               f"adapter_dtype must be one of {ADAPTER_DTYPES}, got {self.adapter_dtype!r}")
        _check(self.epsilon >= 0.0, f"epsilon must be >= 0, got {self.epsilon!r}")
        if self.loss == "relaxed":
            k = self.num_hypotheses
            upper = (k - 1) / k
            hint = (" With one hypothesis there is no other hypothesis to share epsilon: set epsilon=0 "
                    "(or loss='wta'), which is plain LoRA fine-tuning." if k == 1 else
                    " Above that bound a losing hypothesis would weigh more than the winner.")
            _check(self.epsilon <= upper,
                   f"epsilon must be in [0, (K-1)/K] = [0, {upper:.4g}] for K={k}, got {self.epsilon!r}.{hint}")
        _check(self.temperature0 > 0, f"temperature0 must be > 0, got {self.temperature0!r}")
        _check(0 < self.temperature_decay <= 1,
               "temperature_decay must be in (0, 1] (1 keeps the temperature constant), "
               f"got {self.temperature_decay!r}")
        _check(self.temperature_min >= 0, f"temperature_min must be >= 0, got {self.temperature_min!r}")
        _check(self.target_modules is None or isinstance(self.target_modules, str)
               or (isinstance(self.target_modules, list) and self.target_modules
                   and all(isinstance(t, str) and t for t in self.target_modules)),
               "target_modules must be None, a non-empty list of layer names, a regular expression string or "
               f"'all-linear', got {self.target_modules!r}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> MCLConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        _check(not unknown, f"unknown MCLConfig fields {unknown}; known fields are {sorted(known)}")
        return cls(**values)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


__all__ = ["MCLConfig", "LOSS_NAMES"]
