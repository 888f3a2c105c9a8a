"""How to decode: the options of one ``generate_hypotheses`` call (``Decoding``), in one place for the library, the
`loramcl generate` command (its flags are these fields: jsonargparse resolves the command's ``**decoding`` through
``Decoding``) and the recipes. Torch-free, so that ``loramcl --help`` stays fast.

As transformers' ``generate(generation_config, **kwargs)``, ``generate_hypotheses`` takes a ``Decoding`` and/or its
fields as keyword arguments (``split_options``): a keyword replaces the field, any other keyword goes to
transformers' ``generate``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from loramcl.validate import names_its_options, require, require_int, require_real

Strategy = Literal["greedy", "beam", "sample", "diverse_beam", "tta", "stochastic_router"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
MCL_STRATEGIES = ("greedy", "beam", "sample", "diverse_beam")
BASELINE_STRATEGIES = ("beam", "diverse_beam", "sample", "tta", "stochastic_router")


@names_its_options
@dataclass(frozen=True)
class Decoding:
    """The options of a decoding: which strategy, how many beams and candidates, and transformers' logits settings.

    Args:
        strategy: MCL (and multi-head MCL): greedy, beam, sample, diverse_beam (diverse MCL decoding: hypothesis k
            is group k of one diverse beam search, penalised by diversity_penalty for the tokens the hypotheses
            before it chose at the same step). Single model (LoRA-MLE, LoRA-MoE's MLE decoding): beam,
            diverse_beam, sample, tta; LoRA-MoE also stochastic_router (K passes, each sampling one expert per
            layer and token from the router).
        num_beams: beams (MCL: per hypothesis; tta: per perturbed context; stochastic_router: per pass; a single
            model's beam/diverse_beam: in all).
        budget: instead of num_beams, a forward budget B: beam B for a single model, B/K per MCL hypothesis, tta
            context or stochastic-router pass (paper §4.1).
        num_sequences: K candidates per input for a single-model baseline (an MCL model gives one per hypothesis).
        hypotheses: MCL hypotheses to decode, e.g. [2, 0] (default: all, in order).
        max_new_tokens: maximum generated tokens per candidate (prompt + max_new_tokens must fit the model's
            positions: `loramcl generate` checks it before decoding).
        repetition_penalty: as in transformers' generate, > 0 (1: none; the paper decodes with 1.1).
        temperature: sampling temperature, > 0. The sampling settings act on 'sample' only; their defaults (1.0, 0,
            1.0, 1.0) are pure ancestral sampling and override the model's generation_config.
        top_k: sampling: keep the k most likely tokens (0: no limit).
        top_p: sampling: nucleus mass, in (0, 1] (1.0: no limit).
        typical_p: sampling: typical-decoding mass, in (0, 1] (1.0: no limit).
        seed: seeds torch's RNG for sampling and augmentation inside a forked RNG state (the global state is left
            as it was), so the same call with the same seed gives the same outputs; `loramcl generate` gives batch
            b seed + b. None: the global RNG (for stochastic_router: a seed drawn from it).
        num_beam_groups: diverse_beam of a single model: groups (default K); for MCL the groups are the hypotheses.
        diversity_penalty: diverse_beam: λ of the Hamming diversity term (the paper: 0.8 or 1.0).
    """

    strategy: Strategy = "greedy"
    num_beams: int | None = None
    budget: int | None = None
    num_sequences: int | None = None
    hypotheses: list[int] | None = None
    max_new_tokens: int = 64
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    seed: int | None = 0
    num_beam_groups: int | None = None
    diversity_penalty: float | None = None

    def __post_init__(self) -> None:
        require(self.strategy in STRATEGIES, f"unknown strategy {self.strategy!r}: MCL models decode with "
                f"{MCL_STRATEGIES}, single models with {BASELINE_STRATEGIES}")
        for name in ("num_beams", "budget", "num_sequences", "num_beam_groups"):
            if getattr(self, name) is not None:
                require_int(name, getattr(self, name))
        hypotheses = self.hypotheses
        require(hypotheses is None or (isinstance(hypotheses, list | tuple) and all(
            isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in hypotheses)),
            f"hypotheses must be a list of hypothesis indices (integers >= 0), e.g. [0, 2], got {hypotheses!r}",
            "hypotheses")
        require_int("max_new_tokens", self.max_new_tokens)
        require_real("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True, hint=" (1: no penalty)")
        require_real("temperature", self.temperature, low=0.0, low_open=True,
                     hint=" (1: the model's distribution; lower: sharper)")
        require_int("top_k", self.top_k, minimum=0, what="(0: no limit)")
        for name in ("top_p", "typical_p"):
            require_real(name, getattr(self, name), low=0.0, high=1.0, low_open=True, hint=" (1: no limit)")
        if self.seed is not None:
            require_int("seed", self.seed, minimum=0)
        if self.diversity_penalty is not None:
            require_real("diversity_penalty", self.diversity_penalty, low=0.0)


FIELDS = frozenset(field.name for field in dataclasses.fields(Decoding))


def split_options(decoding: Decoding | None, options: Mapping) -> tuple[Decoding, dict]:
    """(``decoding`` with the fields named in ``options`` replaced, the other ``options``)."""
    if decoding is not None and not isinstance(decoding, Decoding):
        raise TypeError(f"decoding must be a loramcl.generation.Decoding, got {type(decoding).__name__}")
    fields = {name: value for name, value in options.items() if name in FIELDS}
    rest = {name: value for name, value in options.items() if name not in FIELDS}
    return dataclasses.replace(decoding or Decoding(), **fields), rest
