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

from loramcl.decoding.budget import equal_budget
from loramcl.utils.validate import OptionError, names_its_options, require, require_int, require_real, require_seed

Strategy = Literal["greedy", "beam", "sample", "diverse_beam", "tta", "stochastic_router"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
MCL_STRATEGIES = ("greedy", "beam", "sample", "diverse_beam")
BASELINE_STRATEGIES = ("beam", "diverse_beam", "sample", "tta", "stochastic_router")
BEAM_STRATEGIES = ("beam", "diverse_beam", "tta", "stochastic_router")  # those that take num_beams or a budget
UNCOMPILED_STRATEGIES = ("diverse_beam", "stochastic_router")  # their own steps: compile does not serve them
# Beams, candidates, groups or a forward budget per input: every one is a row of each decoding step, times the batch
# (and K for an MCL model). The paper's largest budget is 15 (K = 5, beam 3 per hypothesis); torch's sizes overflow
# long before 10^18.
MAX_BEAMS = 4096
# The sampling settings at which they leave the model's distribution as it is: any other value acts on 'sample' only.
_SAMPLING_NEUTRAL = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "typical_p": 1.0}
_BEAMS_HINT = " (beams or candidates per input: each is a row of every decoding step, times the batch)"


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
        temperature: sampling temperature, > 0. The sampling settings act on 'sample' only (another strategy refuses
            them); their defaults (1.0, 0, 1.0, 1.0) are pure ancestral sampling and override the model's
            generation_config.
        top_k: sampling: keep the k most likely tokens (0: no limit).
        top_p: sampling: nucleus mass, in (0, 1] (1.0: no limit).
        typical_p: sampling: typical-decoding mass, in (0, 1] (1.0: no limit).
        seed: seeds torch's RNG for sampling and augmentation inside a forked RNG state (the global state is left
            as it was), so the same call with the same seed gives the same outputs; `loramcl generate` gives batch
            b seed + b. None: the global RNG (for stochastic_router: a seed drawn from it).
        num_beam_groups: diverse_beam of a single model: groups (default K); for MCL the groups are the hypotheses.
        diversity_penalty: diverse_beam: λ of the Hamming diversity term (the paper: 0.8 or 1.0).
        compile: decode on a static KV cache with the decoding step compiled (torch.compile; CUDA graphs on a GPU,
            where eager decoding waits on the host): the same tokens, faster on a GPU once compiled (the first call
            compiles). greedy, beam, sample and tta; not with diverse_beam, stochastic_router or adapters whose
            context is computed once (adapt_context=False). Off by default: on the CPU it is not faster.
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
    compile: bool = False

    def __post_init__(self) -> None:
        require(self.strategy in STRATEGIES, f"unknown strategy {self.strategy!r}: MCL models decode with "
                f"{MCL_STRATEGIES}, single models with {BASELINE_STRATEGIES}")
        for name in ("num_beams", "budget", "num_sequences", "num_beam_groups"):
            if getattr(self, name) is not None:
                require_int(name, getattr(self, name), maximum=MAX_BEAMS, hint=_BEAMS_HINT)
        hypotheses = self.hypotheses
        require(hypotheses is None or (isinstance(hypotheses, list | tuple) and all(
            isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in hypotheses)),
            f"hypotheses must be a list of hypothesis indices (integers >= 0), e.g. [0, 2], got {hypotheses!r}",
            "hypotheses")
        require(hypotheses is None or len(hypotheses) > 0, "hypotheses is empty: leave it out to decode all hypotheses",
                "hypotheses")
        require_int("max_new_tokens", self.max_new_tokens)
        require_real("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True, hint=" (1: no penalty)")
        require_real("temperature", self.temperature, low=0.0, low_open=True,
                     hint=" (1: the model's distribution; lower: sharper)")
        require_int("top_k", self.top_k, minimum=0, what="(0: no limit)")
        for name in ("top_p", "typical_p"):
            require_real(name, getattr(self, name), low=0.0, high=1.0, low_open=True, hint=" (1: no limit)")
        if self.seed is not None:
            require_seed("seed", self.seed)
        if self.diversity_penalty is not None:
            require_real("diversity_penalty", self.diversity_penalty, low=0.0)
        self._check_strategy()

    def _check_strategy(self) -> None:
        """The options that belong to another strategy, checked whatever the model (``plan`` checks the rest)."""
        strategy = self.strategy
        require(self.num_beams is None or self.budget is None, f"num_beams {self.num_beams} and budget "
                f"{self.budget}: give one of them, not both (a budget sets the beam sizes)", "num_beams")
        if strategy in ("greedy", "sample"):
            require(self.num_beams in (None, 1), f"num_beams {self.num_beams}: strategy {strategy!r} decodes one beam; "
                    "use strategy 'beam' for beams", "num_beams")
            require(self.budget is None, f"budget {self.budget}: a forward budget sets beam sizes, and strategy "
                    f"{strategy!r} has none (use one of {BEAM_STRATEGIES}, or leave budget out)", "budget")
        elif strategy in ("beam", "diverse_beam"):
            require(self.num_beams is not None or self.budget is not None,
                    f"strategy {strategy!r} needs num_beams (or a forward budget: budget=B)", "strategy")
        for name in ("num_beam_groups", "diversity_penalty"):
            require(strategy == "diverse_beam" or getattr(self, name) is None,
                    f"{name} {getattr(self, name)} belongs to strategy 'diverse_beam' (strategy is {strategy!r})", name)
        for name, neutral in _SAMPLING_NEUTRAL.items():
            value = getattr(self, name)
            require(strategy == "sample" or value == neutral, f"{name} {value} acts on strategy 'sample' only "
                    f"(strategy is {strategy!r}, which would ignore it): set strategy 'sample' or leave {name} out",
                    name)
        require(isinstance(self.compile, bool), f"compile must be true or false, got {self.compile!r}", "compile")
        require(not self.compile or strategy not in UNCOMPILED_STRATEGIES, f"compile: strategy "
                f"{strategy!r} runs its own steps (diverse beam search's groups, the router's sampled experts), not "
                "transformers' compiled decoding step: decode it with compile=False", "compile")
        require(strategy != "diverse_beam" or self.diversity_penalty is not None,
                f"strategy {strategy!r} needs diversity_penalty >= 0 (λ of the Hamming diversity term: the paper "
                "uses 0.8 or 1.0; 0 gives beam search per group)", "strategy")


FIELDS = frozenset(field.name for field in dataclasses.fields(Decoding))


def split_options(decoding: Decoding | None, options: Mapping) -> tuple[Decoding, dict]:
    """(``decoding`` with the fields named in ``options`` replaced, the other ``options``)."""
    if decoding is not None and not isinstance(decoding, Decoding):
        raise TypeError(f"decoding must be a loramcl.decoding.Decoding, got {type(decoding).__name__}")
    fields = {name: value for name, value in options.items() if name in FIELDS}
    rest = {name: value for name, value in options.items() if name not in FIELDS}
    return dataclasses.replace(decoding or Decoding(), **fields), rest


@dataclass(frozen=True)
class DecodedModel:
    """What a decoding is checked against, known before the model loads (`loramcl generate` reads it from the
    adapters' mcl_config.json) as well as from the model."""

    num_hypotheses: int | None
    """K of an MCL model (multi-head MCL: its K heads; LoRA-MoE: 1); None: a model without hypotheses."""
    router: bool = False
    """A LoRA-MoE model, whose router can be sampled ('stochastic_router')."""
    scoring: bool = False
    """An MCL model with hypothesis scores p(k | c)."""
    name: str = "the model"
    """What the messages call it (its class)."""
    context_once: bool = False
    """An MCL model whose context is computed once (``MCLConfig(adapt_context=False)``)."""


@dataclass(frozen=True)
class Plan:
    """How a ``generate_hypotheses`` call decodes, from ``plan``."""

    selected: list[int] | None
    """The MCL hypotheses decoded, in order; None for a model without hypotheses."""
    mcl: bool
    """One candidate per selected hypothesis (else a single model's num_sequences candidates)."""
    num_beams: int


def plan(decoding: Decoding, model: DecodedModel, augment: bool = False, sort_by_score: bool = False) -> Plan:
    """The hypotheses, the path (MCL or a single-model baseline) and the beam size of ``decoding`` on ``model``,
    checked: every mistake that the model's kind and K show is an OptionError naming the option, before any
    decoding (and, in `loramcl generate`, before the model loads). ``augment``: a 'tta' function is given."""
    strategy, num_sequences, k = decoding.strategy, decoding.num_sequences, model.num_hypotheses
    require(strategy != "stochastic_router" or model.router, "strategy 'stochastic_router' samples the experts of a "
            f"LoRA-MoE model (loramcl.baselines.get_moe_model); {model.name} has no router", "strategy")
    require(not (decoding.compile and model.context_once), f"compile: {model.name} computes its context once "
            "(MCLConfig(adapt_context=False)) into a dynamic cache shared by the hypotheses, which the static KV cache "
            "of compiled decoding cannot hold yet: decode with compile=False", "compile")
    selected = None
    if decoding.hypotheses is not None:
        selected = list(decoding.hypotheses)
        require(k is not None, f"hypotheses {selected} selects adapter sets of an MCLModel; {model.name} has none",
                "hypotheses")
        bad = [h for h in selected if h >= k]
        require(not bad, f"hypotheses {bad} do not exist: this model has K={k} (0..{k - 1})", "hypotheses")
    elif k is not None:
        selected = list(range(k))
    mcl = selected is not None and strategy in MCL_STRATEGIES and num_sequences in (None, len(selected))
    if selected is not None and not mcl and len(selected) != 1:
        if strategy in MCL_STRATEGIES:
            raise OptionError("num_sequences", f"num_sequences={num_sequences} does not match the {len(selected)} "
                              f"hypotheses to decode ({selected}): an MCL model gives one candidate per hypothesis. "
                              "Leave num_sequences out, or pass hypotheses=[k] to run a single-model baseline on "
                              "hypothesis k.")
        raise OptionError("strategy", f"strategy {strategy!r} is a single-model baseline; an MCL model decodes with "
                          f"{MCL_STRATEGIES}. To run it on one hypothesis of this model, pass hypotheses=[k].")
    if mcl and strategy == "diverse_beam":
        require(len(selected) >= 2, f"strategy 'diverse_beam' on an MCL model is diverse MCL decoding: it makes "
                "hypotheses avoid each other's tokens, so it needs 2 or more hypotheses; this call decodes "
                f"{selected} (the model has K={k}). To run diverse beam search on one hypothesis k as a single "
                "model, pass hypotheses=[k] and num_sequences.", "strategy")
        require(decoding.num_beam_groups in (None, len(selected)), f"num_beam_groups {decoding.num_beam_groups}: "
                f"in diverse MCL decoding the groups are the {len(selected)} hypotheses decoded: leave it out",
                "num_beam_groups")
    if not mcl:
        require(strategy != "greedy", "strategy 'greedy': greedy decoding gives one sequence per input; a single "
                f"model's K candidates come from {BASELINE_STRATEGIES} (with num_sequences=K)", "strategy")
        require(num_sequences is not None, f"strategy {strategy!r} on a single model needs num_sequences=K "
                "(candidates per input)", "strategy")
    num_beams = decoding.num_beams or 1
    if decoding.budget is not None:
        num_beams = equal_budget(decoding.budget, len(selected) if mcl else num_sequences).num_beams(strategy, mcl)
    if strategy in ("beam", "diverse_beam") and not mcl:
        require(num_beams >= num_sequences, f"num_sequences {num_sequences} is more than the beams: beam search "
                f"returns at most num_beams sequences (num_beams={num_beams} < num_sequences={num_sequences}); use "
                f"num_beams >= {num_sequences}", "num_sequences")
    if strategy == "diverse_beam" and not mcl:
        groups = num_sequences if decoding.num_beam_groups is None else decoding.num_beam_groups
        require(num_beams % groups == 0, f"num_beam_groups {groups}: diverse beam search splits num_beams="
                f"{num_beams} into num_beam_groups={groups} groups of equal size: num_beams must be a multiple of "
                "num_beam_groups", "num_beam_groups")
    require(strategy == "tta" or not augment, "augment belongs to strategy='tta'", "augment")
    require(strategy != "tta" or augment, "strategy 'tta' needs augment: a function (inputs, k) -> perturbed inputs",
            "strategy")
    require(not sort_by_score or (mcl and model.scoring and sorted(selected) == list(range(k))),
            "sort_by_score needs an MCL model with hypothesis scores (MCLConfig(scoring=True)) decoding all of its "
            "hypotheses with an MCL strategy", "sort_by_score")
    return Plan(selected, mcl, num_beams)
