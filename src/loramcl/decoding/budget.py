"""Beam sizes at an equal forward budget (paper §4.1 and App. H): every method advances the same number B of
sequences per decoding step and input, so candidates of all methods are compared at the same cost."""

from __future__ import annotations

from dataclasses import dataclass

from loramcl.utils.validate import OptionError


@dataclass(frozen=True)
class EqualBudget:
    """Beam sizes at an equal number of forward passes per decoding step (paper §4.1 and App. H)."""

    budget: int
    """B: sequences advanced per decoding step and per input, for every method."""
    num_hypotheses: int
    """K: candidates per input."""
    mle_num_beams: int
    """Beam search and diverse beam search of a single model returning K sequences: B."""
    mcl_num_beams: int
    """MCL, per hypothesis (each returns its best beam), with beam search or diverse MCL decoding: B / K."""
    tta_num_beams: int
    """Test-time augmentation, per perturbed context, and stochastic-router decoding of a LoRA-MoE model, per pass
    (each returns its best beam): B / K."""

    def num_beams(self, strategy: str, mcl: bool) -> int:
        """The beam size of ``strategy`` ('beam', 'diverse_beam', 'tta', 'stochastic_router') for an MCL
        (``mcl=True``) or a single model."""
        if strategy not in ("beam", "diverse_beam", "tta", "stochastic_router"):
            raise ValueError(f"a forward budget sets beam sizes; strategy {strategy!r} has none "
                             "(use 'beam', 'diverse_beam', 'tta' or 'stochastic_router', or give num_beams)")
        if mcl:
            if strategy not in ("beam", "diverse_beam"):
                raise ValueError(f"strategy {strategy!r} is a single-model baseline, not an MCL decoding")
            return self.mcl_num_beams
        return self.tta_num_beams if strategy in ("tta", "stochastic_router") else self.mle_num_beams


def equal_budget(budget: int, num_hypotheses: int) -> EqualBudget:
    """Beam sizes giving every method the same forward budget B for K candidates per input (paper §4.1).

    A single model (LoRA-MLE) decodes with beam B and returns its K best beams (needs B >= K); an MCL model
    decodes each of its K hypotheses with beam B/K and each returns one sequence; test-time augmentation decodes
    each of its K perturbed contexts with beam B/K. So B must be a multiple of K.
    """
    for name, value in (("budget", budget), ("num_hypotheses", num_hypotheses)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if budget % num_hypotheses:
        lower, upper = budget - budget % num_hypotheses, budget + num_hypotheses - budget % num_hypotheses
        raise OptionError("budget", f"budget {budget} cannot be split among K={num_hypotheses} hypotheses (beam "
                          f"{budget}/{num_hypotheses} per hypothesis): choose a multiple of K, e.g. {lower or upper} "
                          f"or {upper}")
    per_hypothesis = budget // num_hypotheses
    return EqualBudget(budget, num_hypotheses, mle_num_beams=budget, mcl_num_beams=per_hypothesis,
                       tta_num_beams=per_hypothesis)
