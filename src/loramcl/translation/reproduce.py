"""`loramcl translation`: diverse machine translation (paper §4.4, App. H.6), data -> train -> decode -> evaluate ->
report, every stage reused when its outputs exist with the same settings.

A recipe folder holds `experiment.yaml` (what this command does: the data, the K candidates, the forward budgets,
which runs are decoded and which enter the NLL table), `common.yaml` and one file per training run (each a `loramcl
train --config` file). Two ship inside the package (`loramcl recipes`):

- translation/smollm2 (the default): SmolLM2-135M on a multi-reference set built from the machine's gettext
  catalogs, on the CPU (docs/translation.md);
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

from loramcl.recipe.grid import DecodeConfig, System, chosen_budgets, equal_budget_systems
from loramcl.validate import require, require_int

EXPERIMENT, COMMON = "experiment.yaml", "common.yaml"
SMOLLM2_FOLDER = "SmolLM2-135M-Instruct"
DEFAULT_RECIPES = "translation/smollm2"
# Quick: the same pipeline on a few sentences and steps, at the smallest budget (numbers meaningless).
QUICK_DATA = {"train": 32, "validation": 4, "test": 3}
QUICK_TRAIN = {"training": {"steps": 1, "batch_size": 2, "eval_every": 0, "logging_steps": 1, "warmup_steps": 0,
                            "save_every": 0},
               "data": {"eval_examples": 2}}
QUICK_DECODING = {"max_new_tokens": 6, "batch_size": 3}
SINGLE_MODEL_DECODINGS = ("beam", "diverse_beam")
DATA_FIELDS = ("data", "source_lang", "target_lang", "gettext", "files")  # the settings the data stage depends on


@dataclass(frozen=True)
class Experiment:
    """experiment.yaml: what `loramcl translation` does with the runs of a recipe folder."""

    out: str = "runs/translation"
    """Output folder (the run files' paths point inside it). Paths in experiment.yaml (`out`, the `files:`) are
    relative to that file, as in the run files."""

    data: str = "gettext"
    """'gettext': build the multi-reference set from the machine's gettext catalogs (`gettext:` settings); 'files':
    read the training pairs and the test set named under `files:`."""

    source_lang: str = "en"
    target_lang: str = "de"

    packaged_model: str | None = None
    """'smollm2': convert the packaged SmolLM2-135M-Instruct into <out>/SmolLM2-135M-Instruct and train on it (the
    run files' `model`); None: the run files' `model` is a local folder."""

    candidates: int = 3
    """K candidates per source for every system (the paper: 3)."""

    budgets: list[int] = field(default_factory=lambda: [3, 6, 9])
    """Forward budgets B: single models decode with beam B (and diverse beam search, K groups of B/K), MCL runs with
    K hypotheses with beam B/K each (greedy at B = K)."""

    decoded: list[str] | None = None
    """Runs whose candidates are decoded and scored (default: every run with K = 1 or K = candidates)."""

    mcl_decodings: list[str] = field(default_factory=lambda: ["beam"])
    """How runs with K hypotheses decode: 'beam' (greedy at B = K, beam B/K per hypothesis above; the paper) and
    'diverse_beam' (diverse MCL decoding, hypothesis k being group k of one diverse beam search, λ =
    decoding.diversity_penalty)."""

    nll_table: list[str] | None = None
    """Runs of the oracle-NLL table (paper Table 1), in order (default: every run)."""

    decoding: dict = field(default_factory=dict)
    """DecodeConfig settings (max_new_tokens, repetition_penalty, batch_size, diversity_penalty)."""

    bleu_tokenize: str = "13a"
    """sacrebleu tokenizer of every BLEU ('13a' as the paper; 'none' for Moses-tokenized references as fairseq's
    score.py, after tokenizing the candidates the same way)."""

    gettext: dict = field(default_factory=dict)
    """data: gettext: MultiReferenceSettings (locale_dir, min_chars, min_references, validation, ...)."""

    files: dict = field(default_factory=dict)
    """data: files: train_file (ALMA JSON, or plain text with target_file), validation_file (optional, the same
    form), test_file (fairseq extra_refs or JSONL), include_target (fairseq: the T line is a reference too)."""

    def __post_init__(self) -> None:
        from loramcl.data.translation import language_name

        require(self.data in ("gettext", "files"), f"data must be 'gettext' or 'files', got {self.data!r}")
        language_name(self.source_lang), language_name(self.target_lang)
        require(self.packaged_model in (None, "smollm2"), f"packaged_model must be smollm2 or null, got "
               f"{self.packaged_model!r}")
        require_int("candidates", self.candidates, minimum=2)
        require(isinstance(self.budgets, list) and self.budgets, f"budgets must be a non-empty list, got "
               f"{self.budgets!r}")
        for budget in self.budgets:
            require_int("budgets", budget)
            require(budget % self.candidates == 0, f"every budget must be a multiple of candidates = "
                   f"{self.candidates} (B/K beams per hypothesis), got {budget}")
        if self.data == "files":
            require(isinstance(self.files, dict) and self.files.get("train_file") and self.files.get("test_file"),
                   "data: files needs files: {train_file: ..., test_file: ...}")
        DecodeConfig(**self.decoding)

    @classmethod
    def read(cls, path: Path) -> Experiment:
        import os

        from loramcl.recipe.files import experiment_values, path_base

        values = experiment_values(path, list(cls.__dataclass_fields__), paths=("out",))

        def absolute(value):
            return os.path.abspath(path_base(path) / os.path.expanduser(value)) if isinstance(value, str) else value

        if isinstance(values.get("files"), dict):
            values["files"] = {name: absolute(value) if name.endswith("_file") else value
                               for name, value in values["files"].items()}
        return cls(**values)


def systems_of(experiment: Experiment, values: dict[str, dict], budgets: list[int]) -> list[System]:
    """The systems compared at equal forward budgets: each decoded run x each decoding x each budget."""
    k = experiment.candidates
    hypotheses = {run: v["mcl"]["num_hypotheses"] for run, v in values.items()}
    decoded = experiment.decoded if experiment.decoded is not None else [
        run for run, n in hypotheses.items() if n in (1, k)]
    unknown = [run for run in decoded if run not in values]
    require(not unknown, f"decoded: no run file for {unknown} (runs: {sorted(values)})")
    return equal_budget_systems({run: hypotheses[run] for run in decoded}, k, budgets, SINGLE_MODEL_DECODINGS,
                                experiment.mcl_decodings)


def prepare_data(out: Path, experiment: Experiment, tokenizer_folder: str, chat_template: bool, quick: bool) -> dict:
    """Write the recipe's JSONL files to ``out``: train / validation {"id", "source", "translation", "prompt",
    "target"} and test {"id", "source", "prompt", "references", "targets"}; "target(s)" are the texts the model
    learns or is scored on after the prompt (the separator the tokenizer reads first, see
    ``data.translation.target_separator``), "references" the texts candidates are scored against."""
    from transformers import AutoTokenizer

    from loramcl.data.gettext_references import MultiReferenceSettings, multi_reference_splits
    from loramcl.data.translation import read_test_set, read_training_pairs, target_separator, translation_prompt

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
    (out / "stats.json").write_text(json.dumps(stats, indent=1) + "\n", encoding="utf-8")
    return stats


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def translation(out: str | None = None, recipes: str | None = None, quick: bool = False,
                budgets: list[int] | None = None, stop_after: str | None = None, threads: int | None = None,
                device: str = "cpu") -> dict:
    """Diverse machine translation (paper §4.4, App. H.6) from a recipe folder, data to report.

    Trains LoRA-MLE and LoRA-MCL runs, decodes K candidates per source at equal forward budgets, and reports
    Loo-BLEU against Pairwise-BLEU (paper Fig. 4), #references covered, oracle sentence BLEU / chrF, the oracle
    test NLL per K (paper Table 1) and how the hypotheses differ.

    Writes to `out`: data/, one folder per run (adapters, logs), predictions/, nll/, figures/, report.json and
    report.md. Finished stages are reused when their settings are unchanged; an interrupted training resumes.

    Args:
        out: output folder (default: experiment.yaml's `out`, where the run files point).
        recipes: recipe folder with experiment.yaml, common.yaml and one file per run, or a packaged recipe's name
            (default: smollm2; alma is the paper's scale; `loramcl recipes` lists them).
        quick: a few sentences, one training step of the decoded runs only, the smallest budget: checks the whole
            pipeline in about a minute (numbers meaningless).
        budgets: forward budgets to decode at (default: experiment.yaml's).
        stop_after: "data" or "train": stop after that stage (e.g. to train each run with `accelerate launch ...
            loramcl train` on several GPUs, then run this command again to decode and report).
        threads: torch CPU threads (default: torch's choice).
        device: e.g. cpu or cuda.
    """
    import torch

    from loramcl.config import DataConfig, MCLConfig, TrainConfig
    from loramcl.file_io import sha256
    from loramcl.finetune import PEFT_FOLDER, nll, run_settings, train
    from loramcl.generation.predictions import generate
    from loramcl.recipe.files import recipe_folder, run_arguments, run_names
    from loramcl.recipe.stages import Stages
    from loramcl.runs import file_stamp, run_record, run_stamp
    from loramcl.translation.report import build_report

    require(stop_after in (None, "data", "train"), f"stop_after must be data or train, got {stop_after!r}")
    if threads is not None:
        torch.set_num_threads(threads)
    folder = recipe_folder(recipes, DEFAULT_RECIPES, [EXPERIMENT, COMMON])
    experiment = Experiment.read(folder / EXPERIMENT)
    root = Path(out if out is not None else experiment.out)
    stages = Stages(root)
    chosen = chosen_budgets(budgets, experiment.budgets, quick)

    model = None
    if experiment.packaged_model == "smollm2":
        from loramcl.pretrained import convert_smollm2

        model = str(stages.timed("convert model", convert_smollm2, root / SMOLLM2_FOLDER))
    runs = run_names(folder, reserved=(EXPERIMENT, COMMON))
    values = {run: run_arguments(folder, run, root, model, QUICK_TRAIN if quick else None, COMMON) for run in runs}
    systems = systems_of(experiment, values, chosen)
    table = experiment.nll_table if experiment.nll_table is not None else runs
    for run in table:
        require(run in values, f"nll_table: no run file {run}.yaml (runs: {runs})")
    decoded = {s.run for s in systems}
    if quick:  # the decoded runs only: every stage and table, fewer trainings
        runs = [run for run in runs if run in decoded]
        table = [run for run in table if run in runs]
    runs.sort(key=lambda run: (run not in decoded, table.index(run) if run in table else len(table)))  # decoded first
    first = values[runs[0]]
    model = first["model"]
    chat_template = DataConfig(**first["data"]).chat_template
    for run, v in values.items():
        require(v["model"] == model and v.get("data", {}).get("chat_template", False) == chat_template,
               f"run {run}: every run of a recipe folder trains the same model with the same prompt format")

    data = root / "data"
    data_settings = {name: getattr(experiment, name) for name in DATA_FIELDS} | {
        "model": model, "chat_template": chat_template, "quick": quick, "files_sha256": {
            name: sha256(path) for name, path in experiment.files.items() if name.endswith("_file") and path}}
    stages.run("prepare data", data / "prepare.json", data_settings, prepare_data, data, experiment, model,
               chat_template, quick)
    if stop_after == "data":
        return {"data": str(data)}
    if not (data / "validation.jsonl").is_file():  # no validation pairs given: the runs train without
        for v in values.values():
            v["data"]["validation_file"] = None

    for run in runs:  # retrained when its recipe or its data changed, resumed when it was interrupted
        v = values[run]
        mcl, data_config = MCLConfig.from_dict(v["mcl"]), DataConfig(**v["data"])
        training, dtype = TrainConfig(**v.get("training", {})), v.get("dtype", "float32")
        settings = run_settings(v["model"], mcl, data_config, training, dtype)
        stages.train(f"train {run}", Path(v["out"]), settings, train, model=v["model"], out=v["out"], mcl=mcl,
                     data=data_config, training=training, resume=True, threads=threads, dtype=dtype)
    if stop_after == "train":
        return {"runs": {run: str(root / run) for run in runs}}

    decode = DecodeConfig(**(experiment.decoding | (QUICK_DECODING if quick else {})))
    test = str(data / "test.jsonl")
    for system in systems:
        v = values[system.run]
        single = v["mcl"]["num_hypotheses"] == 1
        arguments = system.decoding(experiment.candidates, single, decode)
        adapters = root / system.run / (PEFT_FOLDER if single else "")
        stages.decode(system, arguments, decode.batch_size, test, generate, model=model, input=test,
                      out=str(stages.predictions(system.name)), adapters=str(adapters), device=device,
                      batch_size=decode.batch_size, chat_template=chat_template, dtype=v.get("dtype", "float32"),
                      **arguments)
    for run in table:
        path = root / "nll" / f"{run}.jsonl"
        stamps = {"trained": run_stamp(root / run), "test": file_stamp(test)}
        stages.run(f"nll {run}", path.with_suffix(".settings.json"), stamps, nll,
                   model=model, adapters=str(root / run), input=test, out=str(path), references_key="targets",
                   chat_template=chat_template, batch_size=decode.batch_size,
                   dtype=values[run].get("dtype", "float32"), device=device)

    report = stages.timed("evaluate and report", build_report, root, experiment, systems, table, runs)
    report["timing_s"] = stages.timings | {"runs": {run: run_record(root / run)["seconds"] for run in runs}}
    (root / "report.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print((root / "report.md").read_text(encoding="utf-8"))
    print(f"report: {root / 'report.md'} (+ report.json, figures/)")
    return report


__all__ = ["Experiment", "translation", "prepare_data", "systems_of"]
