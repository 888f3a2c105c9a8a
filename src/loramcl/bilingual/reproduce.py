"""`loramcl bilingual`: SmolLM2-135M learns an ambiguous translation task (English -> French OR German), end to end.

The paper's bilingual experiment (§4.3, App. H.5) on a real pretrained model and human translations, on the CPU:
build the data from the machine's gettext catalogs, train LoRA-MLE and two LoRA-MCL runs (K = 2, relaxed and
annealed, with hypothesis scores p(k | c)) from the packaged recipe bilingual/, decode every system at equal
forward budgets (MCL also with diverse MCL decoding), score them (oracle sentence BLEU and chrF, mBLEU-4, oracle
and mixture NLL, the scores' ranking and calibration), identify the language of every candidate, and probe the
sentence embeddings for specialisation (PCA, linear SVM). Every stage skips work whose outputs exist with the same
settings, so an interrupted run resumes and the report can be rebuilt alone.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

from loramcl.inputs import LocalPath
from loramcl.recipe.grid import DecodeConfig, System

RUNS = ("mle", "mcl-relaxed", "mcl-annealed")
MODEL_FOLDER = "SmolLM2-135M-Instruct"
# Quick: the same pipeline on a few examples and steps, to check it end to end in a few minutes.
QUICK_DATA = {"validation": 8, "test": 12}
QUICK_TRAIN = {"training": {"steps": 6, "batch_size": 4, "eval_every": 0, "logging_steps": 3, "warmup_steps": 0},
               "data": {"eval_examples": 8}}
NUM_CANDIDATES = 2  # K: two languages, two hypotheses, two candidates per message for every system

SYSTEMS = (
    System("mle-beam-b2", "mle", "beam", 2), System("mle-dbs-b2", "mle", "diverse_beam", 2),
    System("mcl-relaxed-greedy-b2", "mcl-relaxed", "greedy", 2),
    System("mcl-annealed-greedy-b2", "mcl-annealed", "greedy", 2),
    System("mcl-relaxed-diverse-b2", "mcl-relaxed", "diverse_beam", 2),  # diverse MCL decoding (docs/decoding.md)
    System("mle-beam-b4", "mle", "beam", 4), System("mle-dbs-b4", "mle", "diverse_beam", 4),
    System("mcl-relaxed-beam-b4", "mcl-relaxed", "beam", 4),
    System("mcl-annealed-beam-b4", "mcl-annealed", "beam", 4),
    System("mcl-relaxed-diverse-b4", "mcl-relaxed", "diverse_beam", 4),
)
DECODING = DecodeConfig(max_new_tokens=48, repetition_penalty=1.1, batch_size=16, diversity_penalty=0.8)
QUICK_DECODING = replace(DECODING, max_new_tokens=12)
METRICS = "sacrebleu,chrf,mbleu4,div2"
PROBED = ("mcl-relaxed-greedy-b2", "mcl-annealed-greedy-b2", "mle-dbs-b2", "mle-beam-b2")


def recipe(folder: Path, run: str, out: Path, quick: bool) -> dict:
    """The `loramcl train` arguments of one run: common.yaml + <run>.yaml, paths moved under `out`."""
    from loramcl.recipe.files import run_arguments

    return run_arguments(folder, run, out, str(out / MODEL_FOLDER), QUICK_TRAIN if quick else None)


def bilingual(out: str = "runs/bilingual", quick: bool = False, budgets: list[int] | None = None,
              recipes: LocalPath | None = None, locale_dir: LocalPath = "/usr/share/locale", threads: int | None = None,
              device: str = "cpu") -> dict:
    """Train LoRA-MLE and LoRA-MCL (K = 2) to translate English UI messages to French or German, and report.

    Writes to `out`: the converted model, data/, one folder per run (adapters, logs), predictions/, nll/,
    figures/, report.json and report.md. Finished stages are reused when their settings are unchanged.

    Args:
        out: output folder. As given (relative to the current folder, also in a --config file): the runs record
            their paths, and a finished stage is reused only when they are the same.
        quick: a few examples and training steps: checks the whole pipeline in a few minutes (numbers meaningless).
        budgets: forward budgets to decode at (default [2, 4]): 2 is MLE beam 2 / DBS vs MCL greedy, 4 is MLE beam 4
            / DBS vs MCL beam 2 per hypothesis; on 2 CPU cores each budget-4 system takes about 10 minutes.
        recipes: folder with common.yaml, mle.yaml, mcl-relaxed.yaml, mcl-annealed.yaml (default: the packaged
            bilingual recipe; `loramcl recipes copy bilingual DIR` writes a copy to edit).
        locale_dir: where the gettext catalogs are (<language>/LC_MESSAGES/*.mo).
        threads: torch CPU threads (default: torch's choice).
        device: e.g. cpu or cuda.
    """
    import torch

    from loramcl.bilingual.report import build_report
    from loramcl.config import DataConfig, MCLConfig, TrainConfig
    from loramcl.data.gettext_pairs import BuildSettings, build_dataset
    from loramcl.finetune import PEFT_FOLDER, nll, run_settings, train
    from loramcl.generation.predictions import generate
    from loramcl.pretrained import convert_smollm2
    from loramcl.recipe.files import recipe_folder
    from loramcl.recipe.stages import Stages
    from loramcl.runs import file_stamp, run_record, run_stamp

    known = sorted({s.budget for s in SYSTEMS})
    if budgets is not None and (not budgets or set(budgets) - set(known)):
        raise ValueError(f"budgets must be a non-empty subset of {known}, got {budgets}")
    if threads is not None:
        torch.set_num_threads(threads)
    folder = recipe_folder(recipes, "bilingual", ["common.yaml", *(f"{run}.yaml" for run in RUNS)])
    root = Path(out)
    stages = Stages(root)

    stages.timed("convert model", convert_smollm2, root / MODEL_FOLDER)
    data_settings = BuildSettings(locale_dir=locale_dir, **(QUICK_DATA if quick else {}))
    data = root / "data"
    stages.run("build data", data / "build.json", asdict(data_settings), build_dataset, data, data_settings)

    for run in RUNS:  # a run is retrained when its recipe or its data changed, resumed when it was interrupted
        values = recipe(folder, run, root, quick)
        mcl, data_config = MCLConfig.from_dict(values["mcl"]), DataConfig(**values["data"])
        training = TrainConfig(**values.get("training", {}))
        settings = run_settings(values["model"], mcl, data_config, training, "float32")
        stages.train(f"train {run}", Path(values["out"]), settings, train, model=values["model"], out=values["out"],
                     mcl=mcl, data=data_config, training=training, resume=True, threads=threads)

    model = str(root / MODEL_FOLDER)
    test = str(data / "test.jsonl")
    decoding = QUICK_DECODING if quick else DECODING
    systems = tuple(s for s in SYSTEMS if budgets is None or s.budget in budgets)
    for system in systems:
        single = run_record(root / system.run)["settings"]["mcl"]["num_hypotheses"] == 1
        arguments = system.decoding(NUM_CANDIDATES, single, decoding)
        adapters = root / system.run / (PEFT_FOLDER if single else "")
        stages.decode(system, arguments, decoding.batch_size, test, generate, model=model, input=test,
                      out=str(stages.predictions(system.name)), adapters=str(adapters), device=device,
                      batch_size=decoding.batch_size, **arguments)
    for run in RUNS:
        path = root / "nll" / f"{run}.jsonl"
        stamps = {"trained": run_stamp(root / run), "test": file_stamp(test)}
        stages.run(f"nll {run}", path.with_suffix(".settings.json"), stamps, nll,
                   model=model, adapters=str(root / run), input=test, out=str(path), device=device)

    probed = tuple(name for name in PROBED if name in {s.name for s in systems})
    report = stages.timed("evaluate and report", build_report, root, systems, METRICS, probed)
    report["timing_s"] = stages.timings | {"runs": {run: run_record(root / run)["seconds"] for run in RUNS}}
    (root / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print((root / "report.md").read_text())
    print(f"report: {root / 'report.md'} (+ report.json, figures/)")
    return report
