"""The settings every task's experiment.yaml holds (where the outputs go, the K candidates, the forward budgets, which
runs are decoded and how): one base that each task extends with its data and decoding settings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

from loramcl.recipes.grid import BEST, MCL_DECODINGS, DecodeConfig, check_budgets, trained_run
from loramcl.utils.validate import require

__all__ = ["BEST", "Experiment", "trained_run"]  # BEST and trained_run: defined beside System, which reads '@best' too


@dataclass(frozen=True, kw_only=True)
class Experiment:
    """experiment.yaml: what a task command does with the runs of a recipe folder. Paths (``PATHS``) are relative to
    that file, as those of the run files are to theirs."""

    PATHS: ClassVar[tuple[str, ...]] = ("out",)
    """The settings that are paths, made absolute when the file is read."""

    out: str = "runs/recipe"
    """Output folder."""

    candidates: int = 2
    """K candidates per input for every system (LoRA-MCL's K)."""

    budgets: list[int] = field(default_factory=lambda: [2, 4])
    """Forward budgets B (sequences advanced per decoding step and input): single models decode with beam B,
    runs with K hypotheses with beam B/K each."""

    decoded: list[str] | None = None
    """Runs whose candidates are decoded and scored (default: every run). '<run>@best' decodes the run's
    best-validation adapters (its `training: keep_best: true`) as systems of their own, named '<run>@best-...'."""

    mcl_decodings: list[str] = field(default_factory=lambda: ["beam", "greedy"])
    """How runs with K hypotheses decode: 'beam' (beam B/K per hypothesis; at B = K one beam through beam search, so
    the repetition penalty acts on log-probabilities as in the single models' beam search: equal footing), 'greedy'
    (at B = K: the paper's protocol, the penalty on the logits; docs/guide/decoding.md) and 'diverse_beam' (diverse MCL
    decoding: hypothesis k is group k of one diverse beam search)."""

    decoding: dict = field(default_factory=dict)
    """DecodeConfig settings (max_new_tokens, repetition_penalty, batch_size, diversity_penalty, seed)."""

    nll_table: list[str] | None = None
    """Runs of the oracle-NLL table (paper Table 1), in order, for a task that scores its test references (default:
    every run); trained after the decoded runs, never decoded unless they are in ``decoded`` too. '<run>@best' scores
    the run's best-validation adapters (its `training: keep_best: true`) in a row of its own."""

    sources: dict = field(default_factory=dict)
    """Where each data file of ``data_files`` comes from, by the name of its setting (e.g. train_file: "ALMA's
    human-written parallel data, ..."): said when the file is missing, since nothing is downloaded at run time."""

    def __post_init__(self) -> None:
        check_budgets(self.candidates, self.budgets)
        require(isinstance(self.mcl_decodings, list) and bool(self.mcl_decodings)
                and set(self.mcl_decodings) <= set(MCL_DECODINGS),
                f"mcl_decodings must be among {', '.join(MCL_DECODINGS)}, got {self.mcl_decodings!r}")
        for name in ("decoded", "nll_table"):
            chosen = getattr(self, name)
            names = isinstance(chosen, list) and all(isinstance(run, str) for run in chosen)
            require(chosen is None or names, f"{name} must be a list of run names, got {chosen!r}")
        DecodeConfig(**self.decoding)
        require(isinstance(self.sources, dict) and all(isinstance(v, str) for v in self.sources.values()),
                f"sources must map a data file's setting to where the file comes from, got {self.sources!r}")

    def data_files(self) -> dict[str, str]:
        """The files the data stage reads, by the name of their setting: each must exist before any work starts
        (default: none; a task whose experiment.yaml names its data files says which)."""
        return {}

    def decoded_runs(self, runs: Sequence[str], default: Sequence[str] | None = None) -> list[str]:
        """The runs decoded: ``decoded`` (each one of ``runs``, or '<run>@best' of one), or ``default`` (every run if
        None)."""
        return self._chosen_runs("decoded", runs, default)

    def table_runs(self, runs: Sequence[str]) -> list[str]:
        """The runs of the NLL table: ``nll_table`` (each one of ``runs``, or '<run>@best' of one), or every run."""
        return self._chosen_runs("nll_table", runs)

    def _chosen_runs(self, name: str, runs: Sequence[str], default: Sequence[str] | None = None) -> list[str]:
        """The run names of setting ``name``, each one of ``runs``; when unset, ``default`` (every run if None)."""
        chosen = getattr(self, name)
        if chosen is None:
            return list(runs if default is None else default)
        unknown = sorted({trained_run(run) for run in chosen} - set(runs))
        require(not unknown, f"{name}: no run file for {unknown} (runs: {sorted(runs)})")
        return list(chosen)

    @classmethod
    def read(cls, path: Path) -> Experiment:
        from loramcl.recipes.files import experiment_values

        return cls(**experiment_values(path, [f.name for f in fields(cls)], paths=cls.PATHS))
