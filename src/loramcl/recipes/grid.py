"""The systems a recipe compares, each a trained run decoded by one strategy at one forward budget, and the
decoding arguments that give them the same forward budget (paper §4.1, App. H): a single model (LoRA-MLE) decodes
with beam B and returns its K best beams; an MCL model decodes each of its K hypotheses with beam B/K (with beam
search, or with diverse MCL decoding: 'diverse_beam' on an MCL run, hypothesis k being group k)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from loramcl.decoding.options import BASELINE_STRATEGIES, MCL_STRATEGIES, UNCOMPILED_STRATEGIES
from loramcl.utils.validate import require, require_int, require_real, require_seed

# the baselines a recipe compares: every single-model strategy but LoRA-MoE's stochastic router
SINGLE_MODEL_STRATEGIES = tuple(s for s in BASELINE_STRATEGIES if s != "stochastic_router")
MCL_DECODINGS = ("beam", "greedy", "diverse_beam")  # an experiment's MCL decodings with a forward budget
BEST = "@best"  # '<run>@best' (in decoded and nll_table): the run's best-validation adapters (training.keep_best)


def trained_run(entry: str) -> str:
    """The run a decoded or NLL table entry reads: 'mle@best' -> 'mle'."""
    return entry.removesuffix(BEST)


@dataclass(frozen=True)
class DecodeConfig:
    """Decoding settings shared by every system of a recipe (arguments of ``generate_hypotheses``)."""

    max_new_tokens: int = 64
    """Longest candidate, in tokens."""

    repetition_penalty: float = 1.1
    """The paper decodes every system with 1.1."""

    batch_size: int = 8
    """Inputs per generate call (an MCL model decodes K x batch_size rows at once)."""

    diversity_penalty: float = 0.8
    """λ of diverse beam search's Hamming penalty (the paper: 0.8, and 1.0 for audio), for a single model's
    diverse beam search and diverse MCL decoding alike; a system may override it."""

    seed: int = 0
    """Seed of sampling and test-time augmentation (batch b uses seed + b)."""

    compile: bool = False
    """Decode on a static KV cache with the steps compiled (``generate_hypotheses(compile=True)``; for a GPU) every
    system whose strategy it serves; diverse beam search (diverse MCL decoding, and beam 1 per hypothesis at B = K)
    and the stochastic router run their own steps and decode eagerly."""

    def __post_init__(self) -> None:
        require_int("max_new_tokens", self.max_new_tokens)
        require_real("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        require_int("batch_size", self.batch_size)
        require_real("diversity_penalty", self.diversity_penalty, low=0.0)
        require_seed("seed", self.seed)
        require(isinstance(self.compile, bool), f"compile must be true or false, got {self.compile!r}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class System:
    """One way of producing K candidates per input: the run ``run`` decoded with ``strategy`` at forward budget
    ``budget`` (sequences advanced per decoding step and input). ``options``: further ``generate_hypotheses``
    arguments of this system only (e.g. {"top_p": 0.95} for nucleus sampling, {"diversity_penalty": 1.0}).
    ``best``: it decodes the run's best-validation adapters (root/<run>/best, ``training.keep_best``), not its last;
    a run given as '<run>@best' (experiment.yaml's ``decoded``) is read as run '<run>' with ``best``."""

    name: str
    run: str
    strategy: str
    budget: int
    options: dict = field(default_factory=dict)
    best: bool = False

    def __post_init__(self) -> None:
        require(isinstance(self.name, str) and self.name, f"a system needs a name, got {self.name!r}")
        # read here (frozen: set once), so that every way of building a system reads '<run>@best' alike
        if isinstance(self.run, str) and self.run.endswith(BEST):
            object.__setattr__(self, "run", trained_run(self.run))
            object.__setattr__(self, "best", True)
        require(self.strategy in SINGLE_MODEL_STRATEGIES + MCL_STRATEGIES,
               f"system {self.name}: unknown strategy {self.strategy!r}; single models decode with "
               f"{SINGLE_MODEL_STRATEGIES}, MCL models with {MCL_STRATEGIES}")
        require_int("budget", self.budget)

    def decoding(self, num_candidates: int, single_model: bool, decode: DecodeConfig) -> dict:
        """The ``generate_hypotheses`` arguments of this system for K = ``num_candidates`` candidates per input,
        from a single model (``single_model``) or from an MCL model with K hypotheses."""
        from loramcl.decoding.budget import equal_budget

        k, strategy = num_candidates, self.strategy
        budget = equal_budget(self.budget, k)
        arguments = {"strategy": strategy, "max_new_tokens": decode.max_new_tokens,
                     "repetition_penalty": decode.repetition_penalty, "seed": decode.seed}
        if single_model:
            require(strategy in SINGLE_MODEL_STRATEGIES, f"system {self.name}: a single model (K = 1 run) decodes with "
                   f"{SINGLE_MODEL_STRATEGIES}, not {strategy!r}")
            arguments["num_sequences"] = k
            if strategy in ("beam", "diverse_beam"):
                arguments["num_beams"] = budget.mle_num_beams
            if strategy == "diverse_beam":
                arguments |= {"num_beam_groups": k, "diversity_penalty": decode.diversity_penalty}
            if strategy == "tta":
                arguments["num_beams"] = budget.tta_num_beams
        else:
            require(strategy in MCL_STRATEGIES, f"system {self.name}: an MCL model decodes with {MCL_STRATEGIES}, not "
                   f"{strategy!r}")
            if strategy in ("beam", "diverse_beam"):
                arguments["num_beams"] = budget.mcl_num_beams
            if strategy == "diverse_beam":  # diverse MCL decoding: the groups are the K hypotheses
                arguments["diversity_penalty"] = decode.diversity_penalty
            if strategy == "beam" and budget.mcl_num_beams == 1:
                # beam 1 per hypothesis through beam search (diverse MCL decoding with λ = 0: the groups independent),
                # which applies the repetition penalty to log-probabilities as the single models' beam search does;
                # transformers' num_beams=1 would decode greedily, the penalty on the logits (docs/guide/decoding.md)
                arguments |= {"strategy": "diverse_beam", "diversity_penalty": 0.0}
        if strategy in ("greedy", "sample"):
            per_candidate = budget.mcl_num_beams if not single_model else budget.budget // k
            require(per_candidate == 1, f"system {self.name}: {strategy} advances one sequence per candidate, so its "
                   f"forward budget is K = {k}, not {self.budget}")
        arguments |= self.options
        if decode.compile and arguments["strategy"] not in UNCOMPILED_STRATEGIES:
            arguments["compile"] = True
        return arguments

    @property
    def entry(self) -> str:
        """The adapters it decodes as decoded and nll_table name them: '<run>', or '<run>@best'."""
        return self.run + BEST if self.best else self.run

    def to_dict(self) -> dict:
        values = asdict(self)
        if not self.best:  # a system of the last adapters is recorded as before '@best' systems existed
            values.pop("best")
        return values


def systems_of(experiment, hypotheses: dict[str, int], budgets: list[int]) -> list[System]:
    """The systems of a recipe whose experiment gives ``candidates`` (K), ``mcl_decodings``, ``diversity_penalties``,
    ``tta`` (strengths) and ``sampling`` (settings), as the audio tasks' do: every decoded run (``hypotheses``: run ->
    its K) at every budget: MCL runs with each of ``mcl_decodings`` (``equal_budget_systems``); single models
    (LoRA-MLE, LoRA-MoE) with beam search, diverse beam search per λ and test-time augmentation per strength (beam
    B/K per augmented input); every run with each sampling setting at B = K (paper Tables 8-9)."""
    k = experiment.candidates
    mcl = {run: n for run, n in hypotheses.items() if n > 1}
    single = [run for run, n in hypotheses.items() if n == 1]
    systems = equal_budget_systems(mcl, k, budgets, mcl_strategies=experiment.mcl_decodings) + equal_budget_systems(
        dict.fromkeys(single, 1), k, budgets, ("beam",))
    for run in single:
        for budget in budgets:
            systems += [System(f"{run}-dbs{penalty:g}-b{budget}", run, "diverse_beam", budget,
                               {"diversity_penalty": penalty}) for penalty in experiment.diversity_penalties]
            systems += [System(f"{run}-tta{i + 1}-b{budget}", run, "tta", budget, {"tta_strength": strength})
                        for i, strength in enumerate(experiment.tta)]
    if k in budgets:  # sampling advances one sequence per candidate: budget K only
        systems += [System(f"{run}-{sampling_name(s)}-b{k}", run, "sample", k, dict(s))
                    for run in hypotheses for s in experiment.sampling]
    return systems


def sampling_name(settings: dict) -> str:
    """e.g. {"top_k": 50} -> "topk50", {"typical_p": 0.95} -> "typical0.95"."""
    return "-".join(f"{key.removesuffix('_p').replace('_', '')}{value:g}" for key, value in settings.items())


def check_tta(strengths: list) -> None:
    """Test-time augmentation strengths: each [time fraction, frequency fraction] in [0, 1] (SpecAugment masks)."""
    require(isinstance(strengths, list), f"tta must be a list of strengths, got {strengths!r}")
    for strength in strengths:
        require(isinstance(strength, list) and len(strength) == 2 and all(0 <= s <= 1 for s in strength),
               f"tta: each strength is [time fraction, frequency fraction] in [0, 1], got {strength!r}")


def check_sampling(settings: list) -> None:
    """Sampling systems: a list of non-empty mappings of ``generate_hypotheses`` arguments (e.g. {"top_p": 0.95})."""
    require(isinstance(settings, list) and all(isinstance(s, dict) and s for s in settings),
            f"sampling: a list of non-empty mappings, got {settings!r}")


def check_budgets(candidates: int, budgets: list[int]) -> None:
    """An experiment's K candidates per input (>= 2) and its forward budgets: a non-empty list of multiples of K
    (B/K beams per hypothesis)."""
    require_int("candidates", candidates, minimum=2)
    require(isinstance(budgets, list) and budgets, f"budgets must be a non-empty list, got {budgets!r}")
    for budget in budgets:
        require_int("budgets", budget)
        require(budget % candidates == 0, f"every budget must be a multiple of candidates = {candidates} (B/K beams "
               f"per hypothesis), got {budget}")


def equal_budget_systems(hypotheses: dict[str, int], candidates: int, budgets: Sequence[int],
                         single_model_strategies: Sequence[str] = ("beam", "diverse_beam"),
                         mcl_strategies: Sequence[str] = ("beam",)) -> list[System]:
    """Every run decoded at every budget B, named '<run>-<strategy>-b<B>': a run with one hypothesis (a single model)
    with each of ``single_model_strategies``; a run with K = ``candidates`` hypotheses with each of ``mcl_strategies``:
    'beam' is beam B/K per hypothesis (at B = K one beam through beam search, the repetition penalty on the scale of
    the single models' beam search: equal footing), 'greedy' greedy decoding at B = K only (the paper's protocol,
    the penalty on the logits), 'diverse_beam' diverse MCL decoding with B/K beams per hypothesis.
    ``hypotheses``: {run: its number of hypotheses}."""
    require(set(mcl_strategies) <= set(MCL_DECODINGS), f"mcl_strategies must be among {', '.join(MCL_DECODINGS)} "
           f"(the decodings with a forward budget), got {list(mcl_strategies)}")
    systems = []
    for run, num_hypotheses in hypotheses.items():
        require(num_hypotheses in (1, candidates), f"run {run} has K = {num_hypotheses} hypotheses: a system gives "
               f"{candidates} candidates, from a single model (K = 1) or from K = {candidates} hypotheses")
        for budget in budgets:
            require(budget % candidates == 0, f"budget {budget} is not a multiple of the {candidates} candidates")
            strategies = single_model_strategies if num_hypotheses == 1 else [
                s for s in mcl_strategies if s != "greedy" or budget == candidates]
            systems += [System(f"{run}-{s.replace('_', '')}-b{budget}", run, s, budget) for s in strategies]
    return systems


def one_per_strategy(systems: Sequence[System]) -> list[System]:
    """The first system of each (run, its last or best adapters, strategy): a quick run's every decoding code path,
    with fewer decodes."""
    seen: set = set()
    return [s for s in systems if (s.entry, s.strategy) not in seen and not seen.add((s.entry, s.strategy))]


def chosen_budgets(budgets: Sequence[int] | None, available: Sequence[int], quick: bool) -> list[int]:
    """The forward budgets a recipe command decodes at: ``budgets`` if given (a non-empty subset of the recipe's
    ``available`` ones), else the smallest in a quick run, else all."""
    chosen = list(budgets) if budgets is not None else ([min(available)] if quick else list(available))
    require(bool(chosen) and set(chosen) <= set(available),
           f"budgets must be a non-empty subset of {list(available)}, got {chosen}")
    return chosen
