"""`loramcl translation`: diverse machine translation (paper §4.4, App. H.6), data -> train -> decode -> evaluate ->
report, every stage reused when its outputs exist with the same settings.

A recipe folder holds `experiment.yaml` (what this command does: the data, the K candidates, the forward budgets,
which runs are decoded and which enter the NLL table), `common.yaml` and one file per training run (each a `loramcl
train --config` file). Two ship inside the package (`loramcl recipes`):

- translation/smollm2 (the default): SmolLM2-135M on a multi-reference set built from the machine's gettext
  catalogs, on the CPU (docs/experiments/translation.md);
- translation/alma (`--recipes alma`): the paper's scale, ALMA-7B-Pretrain on ALMA's human-written en->de pairs,
  evaluated on the newstest2014 subset of Ott et al. 2018 with ten references (fairseq's extra_refs file); its files
  say how to launch the training on several GPUs.

Adding a run (e.g. a LoRA-MoE baseline) is one more run file in the folder (and its name under `decoded:` if its
candidates are to be decoded).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from loramcl.recipes.command import task_command
from loramcl.recipes.grid import System
from loramcl.recipes.text import TextExperiment, TextTask
from loramcl.utils.files import write_json
from loramcl.utils.validate import require

DEFAULT_RECIPES = "translation/smollm2"
# Quick: the same pipeline on a few sentences and steps, at the smallest budget (numbers meaningless).
QUICK_DATA = {"train": 32, "validation": 4, "test": 3}
QUICK_TRAIN = {"training": {"steps": 1, "batch_size": 2, "eval_every": 0, "logging_steps": 1, "warmup_steps": 0,
                            "save_every": 0},
               "data": {"eval_examples": 2}}
QUICK_DECODING = {"max_new_tokens": 6, "batch_size": 3}
DATA_FIELDS = ("data", "source_lang", "target_lang", "gettext", "files")  # the settings the data stage depends on


@dataclass(frozen=True, kw_only=True)
class Experiment(TextExperiment):
    """experiment.yaml: what `loramcl translation` does with the runs of a recipe folder. Paths in it (`out`, the
    `files:`) are relative to that file, as in the run files."""

    out: str = "runs/translation"

    data: str = "gettext"
    """'gettext': build the multi-reference set from the machine's gettext catalogs (`gettext:` settings); 'files':
    read the training pairs and the test set named under `files:`."""

    source_lang: str = "en"
    target_lang: str = "de"

    candidates: int = 3
    """K candidates per source for every system (the paper: 3)."""

    budgets: list[int] = field(default_factory=lambda: [3, 6, 9])
    """Forward budgets B: single models decode with beam B (and diverse beam search, K groups of B/K), MCL runs with
    K hypotheses with beam B/K each."""

    bleu_tokenize: str = "13a"
    """sacrebleu tokenizer of every BLEU ('13a' as the paper; 'none' for Moses-tokenized references as fairseq's
    score.py, after tokenizing the candidates the same way)."""

    gettext: dict = field(default_factory=dict)
    """data: gettext: MultiReferenceSettings (locale_dir, min_chars, min_references, validation, ...)."""

    files: dict = field(default_factory=dict)
    """data: files: train_file (ALMA JSON, or plain text with target_file), validation_file (optional, the same
    form), test_file (fairseq extra_refs or JSONL), include_target (fairseq: the T line is a reference too)."""

    def __post_init__(self) -> None:
        from loramcl.recipes.translation.readers import language_name

        super().__post_init__()
        require(self.data in ("gettext", "files"), f"data must be 'gettext' or 'files', got {self.data!r}")
        language_name(self.source_lang), language_name(self.target_lang)
        if self.data == "files":
            require(isinstance(self.files, dict) and self.files.get("train_file") and self.files.get("test_file"),
                   "data: files needs files: {train_file: ..., test_file: ...}")

    def data_files(self) -> dict[str, str]:
        """The `files:` that ``prepare_data`` reads (data: files)."""
        if self.data != "files":
            return {}
        return {name: path for name, path in self.files.items() if name.endswith("_file") and path}

    @classmethod
    def read(cls, path: Path) -> Experiment:
        """experiment.yaml, its `files:` paths relative to it too."""
        import dataclasses
        import os

        from loramcl.recipes.files import path_base

        experiment = super().read(path)
        if not isinstance(experiment.files, dict):
            return experiment
        files = {name: os.path.abspath(path_base(path) / os.path.expanduser(value))
                 if name.endswith("_file") and isinstance(value, str) else value
                 for name, value in experiment.files.items()}
        return dataclasses.replace(experiment, files=files)


def prepare_data(out: Path, experiment: Experiment, tokenizer_folder: str, chat_template: bool, quick: bool) -> dict:
    """Write the recipe's JSONL files to ``out``: train / validation {"id", "source", "translation", "prompt",
    "target"} and test {"id", "source", "prompt", "references", "targets"}; "target(s)" are the texts the model
    learns or is scored on after the prompt (the separator the tokenizer reads first, see
    ``data.translation.target_separator``), "references" the texts candidates are scored against."""
    from transformers import AutoTokenizer

    from loramcl.data.gettext_references import MultiReferenceSettings, multi_reference_splits
    from loramcl.recipes.translation.readers import (
        read_test_set,
        read_training_pairs,
        target_separator,
        translation_prompt,
    )

    if experiment.data == "gettext":
        settings = {"target_lang": experiment.target_lang, **experiment.gettext}
        if quick:
            settings |= {"max_train": QUICK_DATA["train"], "validation": QUICK_DATA["validation"],
                         "max_test": QUICK_DATA["test"]}
        splits = multi_reference_splits(MultiReferenceSettings(**settings))
        pairs = {name: [{"source": r["source"], "target": r["target"]} for r in splits[name]]
                 for name in ("train", "validation")}
        test = splits["test"]
    else:
        files = experiment.files
        unknown = set(files) - {"train_file", "target_file", "validation_file", "validation_target_file",
                                "test_file", "include_target"}
        require(not unknown, f"files: unknown settings {sorted(unknown)}")
        langs = (experiment.source_lang, experiment.target_lang)
        pairs = {"train": read_training_pairs(files["train_file"], *langs, files.get("target_file"))}
        if files.get("validation_file"):
            pairs["validation"] = read_training_pairs(files["validation_file"], *langs,
                                                      files.get("validation_target_file"))
        test = read_test_set(files["test_file"], files.get("include_target", False))
        if quick:
            pairs = {name: rows[:QUICK_DATA[name]] for name, rows in pairs.items()}
            test = test[:QUICK_DATA["test"]]

    def prompt(source: str) -> str:
        return translation_prompt(source, experiment.source_lang, experiment.target_lang)

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    every = [(prompt(r["source"]), r["target"]) for rows in pairs.values() for r in rows]
    every += [(prompt(item["source"]), ref) for item in test for ref in item["references"]]
    separator = target_separator(tokenizer, *zip(*every, strict=True), chat_template=chat_template)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in pairs.items():
        lines = [{"id": f"{name}-{i}", "source": r["source"], "translation": r["target"],
                  "prompt": prompt(r["source"]), "target": separator + r["target"]} for i, r in enumerate(rows)]
        _write_jsonl(out / f"{name}.jsonl", lines)
    _write_jsonl(out / "test.jsonl", [{"id": item["id"], "source": item["source"], "prompt": prompt(item["source"]),
                                       "references": item["references"],
                                       "targets": [separator + r for r in item["references"]]} for item in test])
    counts: dict[int, int] = {}
    for item in test:
        counts[len(item["references"])] = counts.get(len(item["references"]), 0) + 1
    stats = {"examples": {name: len(rows) for name, rows in pairs.items()} | {"test": len(test)},
             "test_references": {str(n): counts[n] for n in sorted(counts)}, "separator": separator}
    write_json(out / "stats.json", stats)
    return stats


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


class Translation(TextTask):
    """Diverse machine translation (paper §4.4, App. H.6) from a recipe folder, data to report.

    Trains LoRA-MLE and LoRA-MCL runs, decodes K candidates per source at equal forward budgets, and reports
    Loo-BLEU against Pairwise-BLEU (paper Fig. 4), #references covered, oracle sentence BLEU / chrF, the oracle
    test NLL per K (paper Table 1) and how the hypotheses differ.

    Writes to `out`: data/, one folder per run (adapters, logs), predictions/, nll/, figures/, report.json and
    report.md. Finished stages are reused when their settings are unchanged; an interrupted training resumes.
    """

    experiment_type = Experiment
    default_recipes = DEFAULT_RECIPES
    quick_settings = QUICK_TRAIN
    quick_decoding = QUICK_DECODING
    references_key = "targets"  # the references after the separator the tokenizer reads first
    options = {
        "out": "output folder (default: experiment.yaml's `out`, where the run files point).",
        "recipes": "recipe folder with experiment.yaml, common.yaml and one file per run, or a packaged recipe's name "
                   "(default: smollm2; alma is the paper's scale; `loramcl recipes` lists them).",
        "quick": "a few sentences, one training step of the decoded runs only, the smallest budget: checks the whole "
                 "pipeline in about a minute (numbers meaningless).",
        "stop_after": '"data" or "train": stop after that stage (e.g. to train each run with `accelerate launch ... '
                      'loramcl train` on several GPUs, then run this command again to decode and report).'}

    def prepare_data(self, model: str, values: dict[str, dict]) -> None:
        from loramcl.utils.files import sha256

        experiment = self.experiment
        settings = {name: getattr(experiment, name) for name in DATA_FIELDS} | {
            "model": model, "chat_template": self.chat_template, "quick": self.quick, "files_sha256": {
                name: sha256(path) for name, path in experiment.files.items() if name.endswith("_file") and path}}
        self.stages.run("prepare data", self.data / "prepare.json", settings, prepare_data, self.data, experiment,
                        model, self.chat_template, self.quick)

    def report(self, systems: list[System], runs: list[str]) -> dict:
        from loramcl.recipes.translation.report import build_report

        return build_report(self.root, self.experiment, systems, self.scored_runs(runs, systems), runs)


translation = task_command(Translation, "translation")


__all__ = ["Experiment", "Translation", "translation", "prepare_data"]
