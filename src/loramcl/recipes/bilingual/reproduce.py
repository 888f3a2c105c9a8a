"""`loramcl bilingual`: SmolLM2-135M learns an ambiguous translation task (English -> French OR German), end to end.

The paper's bilingual experiment (§4.3, App. H.5) on a real pretrained model and human translations, on the CPU:
build the data from the machine's gettext catalogs, train LoRA-MLE and two LoRA-MCL runs (K = 2, relaxed and
annealed, with hypothesis scores p(k | c)) from the packaged recipe bilingual/, decode every system at equal
forward budgets (MCL also with diverse MCL decoding), score the test references under every run of the NLL table
(paper Table 1: K = 1 and 2, and 3 when it names the K = 3 runs), score the candidates (oracle sentence BLEU and
chrF, mBLEU-4, oracle and mixture NLL, the scores' ranking and calibration), identify the language of every
candidate, and probe the sentence embeddings for specialisation (PCA, linear SVM). Every stage skips work whose
outputs exist with the same settings, so an interrupted run resumes and the report can be rebuilt alone (the
shared runner, ``loramcl.recipes``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from loramcl.recipes.command import Option, task_command
from loramcl.recipes.grid import System
from loramcl.recipes.text import TextExperiment, TextTask
from loramcl.utils.inputs import LocalPath
from loramcl.utils.validate import require

# Quick: the same pipeline on a few examples and steps, to check it end to end in a few minutes.
QUICK_DATA = {"validation": 4, "test": 6}
QUICK_TRAIN = {"training": {"steps": 3, "batch_size": 4, "eval_every": 0, "logging_steps": 1, "warmup_steps": 0},
               "data": {"eval_examples": 4}}
QUICK_DECODING = {"max_new_tokens": 8}
METRICS = "sacrebleu,chrf,mbleu4,div2"
PROBED = ("mcl-relaxed-greedy-b2", "mcl-annealed-greedy-b2", "mle-diversebeam-b2", "mle-beam-b2")


@dataclass(frozen=True, kw_only=True)
class Experiment(TextExperiment):
    """experiment.yaml: what `loramcl bilingual` does with the runs of its recipe folder."""

    out: str = "runs/bilingual"
    packaged_model: str | None = "smollm2"

    locale_dir: str = "/usr/share/locale"
    """Where the gettext catalogs are (<language>/LC_MESSAGES/*.mo)."""

    gettext: dict = field(default_factory=dict)
    """Further settings of the data (``data.gettext_pairs.BuildSettings``: min_chars, validation, test, seed...)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.gettext, dict) and "locale_dir" not in self.gettext,
               f"gettext: a mapping of BuildSettings without locale_dir (a setting of its own), got {self.gettext!r}")
        self.settings(quick=False)

    def settings(self, quick: bool):
        from loramcl.data.gettext_pairs import BuildSettings

        return BuildSettings(locale_dir=self.locale_dir, **self.gettext, **(QUICK_DATA if quick else {}))


class Bilingual(TextTask):
    """Train LoRA-MLE and LoRA-MCL (K = 2) to translate English UI messages to French or German, and report.

    Writes to `out`: the converted model, data/, one folder per run (adapters, logs), predictions/, nll/,
    figures/, report.json and report.md. Finished stages are reused when their settings are unchanged.
    """

    experiment_type = Experiment
    default_recipes = "bilingual"
    quick_settings = QUICK_TRAIN
    quick_decoding = QUICK_DECODING
    options = {
        "out": "output folder (default: experiment.yaml's, ./runs/bilingual). The runs record their paths, and a "
               "finished stage is reused only when they are the same.",
        "quick": "a few examples and training steps, the smallest budget: checks the whole pipeline in a few minutes "
                 "(numbers meaningless).",
        "budgets": "forward budgets to decode at (default [2, 4]): 2 is MLE beam 2 / DBS vs MCL beam 1 per hypothesis "
                   "(and greedy), 4 is MLE beam 4 / DBS vs MCL beam 2; on 2 CPU cores each budget-4 system takes "
                   "about 10 minutes.",
        "recipes": Option(LocalPath | None, None, "folder with experiment.yaml, common.yaml and the run files (the "
                          "packaged bilingual recipe's: mle, mcl-relaxed, mcl-annealed, decoded; mle-r24, mcl-k3 for "
                          "a K = 1, 2, 3 NLL table when experiment.yaml's nll_table names them; ensemble-k2 and "
                          "ensemble-k3, the K-seed ensembles of mle-r8, mle-r8-seed1 (and mle-r8-seed2), when named; "
                          "moe and multihead, trained by hand; `loramcl recipes copy bilingual DIR` writes a copy to "
                          "edit)."),
        "locale_dir": Option(LocalPath | None, None, "where the gettext catalogs are (<language>/LC_MESSAGES/*.mo; "
                             "default: experiment.yaml's)."),
    }
    option_order = ("out", "quick", "budgets", "recipes", "locale_dir", "stop_after", "runs", "threads", "device")

    def prepare_data(self, model: str, values: dict[str, dict]) -> None:
        from loramcl.data.gettext_pairs import build_dataset

        settings = self.experiment.settings(self.quick)
        self.stages.run("build data", self.data / "build.json", asdict(settings), build_dataset, self.data, settings)

    def report(self, systems: list[System], runs: list[str]) -> dict:
        from loramcl.recipes.bilingual.report import build_report

        probed = tuple(name for name in PROBED if name in {s.name for s in systems})
        return build_report(self.root, systems, runs, self.scored_runs(runs, systems), METRICS, probed)


bilingual = task_command(Bilingual, "bilingual")


__all__ = ["Bilingual", "Experiment", "bilingual"]
