"""The study across budgets on spoken translation (issue 64's 4th task): a copy of the `loramcl spoken-translation`
recipe (docs/experiments/spoken_translation.md) with its runs at several step budgets, written here and run by the
recipe's own command, which already compares LoRA-MCL, LoRA-MLE and the K-seed ensemble with an NLL table.

Per budget B and seed s, run files made of the packaged ones with `training:` overridden (steps B, training seed,
validation and a checkpoint every B / 5 steps, keep_best):
  mcl-B-s<s>           LoRA-MCL with today's default loss (K = 2 of rank 8, relaxed WTA with epsilon 0.05: the
                       packaged mcl-relaxed.yaml, `loramcl train`'s loss)
  mcl-annealed-B-s<s>  the recipe's own LoRA-MCL (mcl.yaml: annealed MCL, the paper's)
  mle-B-s<s>           LoRA-MLE of rank 16 (equal trainable parameters)
  mle-r8-B-s<m>        LoRA-MLE of rank 8, training seeds m = 2 s and 2 s + 1: the members of
  ensemble-B-s<s>      the K-seed ensemble (K = 2)
experiment.yaml decodes the four from their best checkpoints ('<run>@best': an ensemble's, its members' best) at
budget 2 (MCL greedy per hypothesis, LoRA-MLE beam 2, diverse beam of 2 groups (lambda 0.8) and 2 samples) and scores
every run's oracle NLL of the test references at its last and best adapters.

    python -m benchmarks.studies.budget_study --out /tmp/budgets --budgets 60 200 600 --seeds 0 1 \
        --spoken_recipe /tmp/spoken-budgets
    loramcl spoken-translation --recipes /tmp/spoken-budgets --threads 1
    python -m benchmarks.studies.spoken_budgets --out /tmp/budgets
    python -m benchmarks.studies.budget_study --out /tmp/budgets --table

Then ``score`` (the third command) puts each decoded run in the study's layout, OUT/spoken-translation/<B>-steps/
<setting>-lr0.001-s<s>/ (results.json, candidates.json: what ``--table`` reads; ``--record DIR`` copies them as the
study's ``--record`` does): the study's measures (``defaults_study.score``: sentence chrF of each candidate against
the message's references of both modes, best of 2 and mean over 2, distinct answers, modes covered by the recipe's
language identifier, English and French both modes here) and the recipe's oracle NLL of the test references at the
best adapters, best step, validation loss and training seconds. The settings: ``relaxed-0.05`` (mcl-B-s<s>),
``annealed-<decay>`` (mcl-annealed-B-s<s>), ``mle`` and ``ensemble``, at the recipe's learning rate (1e-3).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
from pathlib import Path

KEPT = ("common.yaml",)  # copied as it is; every run file is written from the packaged ones
TASK = "spoken-translation"  # the task's folder in the study's --out and in its records, its name in the tables
HYPOTHESES = 2  # the recipe's K
RUN = re.compile(r"(mcl|mcl-annealed|mle|ensemble)-(\d+)-s(\d+)")  # a run of ``write_recipe``: kind, budget, seed
DATA_FILES = ("train.jsonl", "validation.jsonl", "test.jsonl")
NOT_MODES = ("empty",)  # what no answer's language counts as a mode: English, the transcript, is one here


def read_yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text(encoding="utf-8")) or {}


def write_yaml(path: Path, values: dict, header: str) -> None:
    import yaml

    path.write_text(f"# {header}\n" + yaml.safe_dump(values, sort_keys=False, allow_unicode=True), encoding="utf-8")


def run_file(packaged: Path, name: str, budget: int, seed: int, evaluations: int) -> dict:
    """The packaged run file ``name`` with its `training:` block at ``budget`` steps and training seed ``seed``."""
    from loramcl.recipes.files import merged

    every = max(1, budget // evaluations)
    return merged(read_yaml(packaged / f"{name}.yaml"), {"training": {
        "steps": budget, "seed": seed, "eval_every": every, "save_every": every, "keep_best": True}})


def write_recipe(folder: Path, out: Path, budgets: list[int], seeds: list[int], evaluations: int = 5) -> list[str]:
    """A spoken-translation recipe in ``folder`` (written whole, its outputs in ``out``) with the runs of every budget
    and seed; returns the command that runs it."""
    from loramcl.recipes.files import packaged_recipes

    packaged = packaged_recipes() / "spoken_translation"
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.yaml"):
        stale.unlink()
    for name in KEPT:
        shutil.copy(packaged / name, folder / name)
    decoded = []
    for budget in budgets:
        for seed in seeds:
            members = [f"mle-r8-{budget}-s{m}" for m in (2 * seed, 2 * seed + 1)]
            runs = {f"mcl-{budget}-s{seed}": ("mcl-relaxed", seed), f"mcl-annealed-{budget}-s{seed}": ("mcl", seed),
                    f"mle-{budget}-s{seed}": ("mle", seed),
                    members[0]: ("mle-r8", 2 * seed), members[1]: ("mle-r8", 2 * seed + 1)}
            for run, (packaged_run, run_seed) in runs.items():
                write_yaml(folder / f"{run}.yaml", run_file(packaged, packaged_run, budget, run_seed, evaluations),
                           f"{packaged_run}.yaml at {budget} steps, training seed {run_seed} (budget_study)")
            ensemble = f"ensemble-{budget}-s{seed}"
            write_yaml(folder / f"{ensemble}.yaml", {"ensemble": members},
                       f"the K-seed ensemble of {', '.join(members)} (budget_study)")
            decoded += [f"{run}-{budget}-s{seed}@best" for run in ("mcl", "mcl-annealed", "mle")] + [f"{ensemble}@best"]
    table = [entry for run in decoded for entry in (run.removesuffix("@best"), run)]
    experiment = read_yaml(packaged / "experiment.yaml") | {
        "out": str(out), "decoded": decoded, "nll_table": table, "budgets": [2], "mcl_decodings": ["greedy"],
        "diversity_penalties": [0.8], "tta": [], "sampling": [{"temperature": 1.0}]}
    write_yaml(folder / "experiment.yaml", experiment, "spoken translation at budgets "
               f"{', '.join(map(str, budgets))} steps, seeds {', '.join(map(str, seeds))} (budget_study)")
    return ["loramcl", "spoken-translation", "--recipes", str(folder), "--threads", "1"]


# ---- the recipe's runs as the study's results ----------------------------------------------------------------

def setting_of(kind: str, mcl: dict) -> str:
    """The study's name of a run of ``write_recipe``: mcl -> relaxed-0.05, mcl-annealed -> annealed-<its decay>."""
    from benchmarks.studies.budget_study import ENSEMBLE

    if kind == "mcl":
        return f"{mcl['loss']}-{mcl['epsilon']:g}"
    if kind == "mcl-annealed":
        return f"annealed-{mcl['temperature_decay']:g}"
    return {"mle": "mle", "ensemble": ENSEMBLE}[kind]


def decoded_runs(root: Path) -> dict[str, dict[str, str]]:
    """{run: {strategy: system}} of the runs decoded from their best adapters in ``root`` (predictions/<system>
    .jsonl beside its .settings.json, whichever copy of the recipe decoded them): the one LoRA's beam search, diverse
    beam search and samples; an MCL run's and the ensemble's greedy hypotheses (their samples are not the study's)."""
    from benchmarks.studies.budget_study import MLE_STRATEGIES

    runs: dict[str, dict[str, str]] = {}
    for stamp in sorted((root / "predictions").glob("*@best-*.settings.json")):
        name = stamp.name.removesuffix(".settings.json")
        found, settings = RUN.fullmatch(name.split("@best-")[0]), json.loads(stamp.read_text())["settings"]
        if found and (root / "predictions" / f"{name}.jsonl").exists() and settings["strategy"] in (
                MLE_STRATEGIES if found[1] == "mle" else ("greedy",)):
            runs.setdefault(found[0], {})[settings["strategy"]] = name
    if not runs:
        raise SystemExit(f"{root}: no run decoded from its best adapters: run the recipe to its end first "
                         "(`loramcl spoken-translation --recipes DIR --threads 1`, DIR written by budget_study "
                         "--spoken_recipe)")
    return runs


def members_of(record, run: Path) -> list[str]:
    """An assembled ensemble's members, in order, from its run.json's ``record`` (``recipes.ensemble.assemble``)."""
    members = record.values.get("members")
    if not members:
        raise SystemExit(f"{run}: run.json names no members: is it an ensemble assembled by the recipe?")
    return list(members)


def scored(root: Path) -> list[tuple[dict, dict]]:
    """(results, candidates) of each run decoded from its best adapters by the recipe in ``root``, in the budget
    study's shape (``budget_study.one_run``'s results.json and candidates.json)."""
    from benchmarks.studies import defaults_study as study
    from benchmarks.studies.budget_study import ENSEMBLE, best
    from loramcl.metrics.io import load_nll
    from loramcl.metrics.nll import oracle_nll
    from loramcl.recipes.spoken_translation.messages import read_rows
    from loramcl.recipes.spoken_translation.report import train_identifier
    from loramcl.utils.files import read_jsonl
    from loramcl.utils.run_record import RunRecord

    test = read_rows(root / "data" / "test.jsonl")
    ids, references = [row["id"] for row in test], [row["references"] for row in test]
    identifier, _ = train_identifier(read_rows(root / "data" / "train.jsonl"), test)
    found = []
    for run, systems in decoded_runs(root).items():
        kind, budget, seed = RUN.fullmatch(run).groups()
        record = RunRecord.read(root / run)
        members = members_of(record, root / run) if kind == ENSEMBLE else [run]
        kept = [best(root / m) for m in members]  # an ensemble's best: each member's own
        settings = (RunRecord.read(root / members[0]) if kind == ENSEMBLE else record).settings.values
        decoded = {}
        for strategy, name in systems.items():
            predictions = read_jsonl(root / "predictions" / f"{name}.jsonl", "candidates")
            decoded[strategy] = [predictions[row["id"]]["candidates"] for row in test]
        nll_file = root / "nll" / f"{run}@best.jsonl"
        if not nll_file.exists():
            raise SystemExit(f"{nll_file} does not exist: keep experiment.yaml's nll_table as budget_study "
                             "--spoken_recipe wrote it (every run at its best adapters) and run the recipe again")
        steps, losses = [k["step"] for k in kept], [k["eval_loss"] for k in kept]
        result = {"task": TASK, "setting": setting_of(kind, settings["mcl"]), "seed": int(seed), "K": HYPOTHESES,
                  "budget": int(budget), "learning_rate": settings["training"]["learning_rate"],
                  "rank": settings["mcl"]["r"], "device": "cpu", "train_seconds": record.seconds,
                  "seconds_partial": record.seconds_partial, "resumed_from": record.resumed_from,
                  "best_step": steps if kind == ENSEMBLE else steps[0],
                  "best_eval_loss": losses if kind == ENSEMBLE else losses[0],
                  "trainable_parameters": record.trainable_parameters,
                  "test": {s: study.score(TASK, test, c, identifier, no_mode=NOT_MODES) for s, c in decoded.items()},
                  "oracle_nll": oracle_nll(load_nll(nll_file, ids, references))["oracle_nll"]}
        if kind == ENSEMBLE:
            result["members"] = members
        elif kind != "mle":
            result |= {"verdict": record.values.get("specialisation"), "output_verdict": record.values.get("outputs")}
        found.append((result, decoded))
    return found


def data_digest(data: Path) -> dict:
    """The SHA-256 of each of the recipe's data files, its rows without their clip's path (where the recipe's
    outputs are; espeak-ng speaks the clip again from the row's text and voice)."""
    def rows(name: str) -> bytes:
        lines = (data / name).read_text(encoding="utf-8").splitlines()
        kept = [{k: v for k, v in json.loads(line).items() if k != "audio"} for line in lines if line.strip()]
        return json.dumps(kept, sort_keys=True, ensure_ascii=False).encode()

    return {name: hashlib.sha256(rows(name)).hexdigest() for name in DATA_FILES}


def check_data(records: Path, data: Path) -> None:
    """Refuse the recipe's ``data`` folder unless it is the data the runs of ``records`` were scored on
    (``data_digest``)."""
    from benchmarks.studies import budget_study

    budget_study.check_data(records, data, TASK, data_digest, DATA_FILES, build=(
        "build it with `loramcl spoken-translation --recipes DIR --stop_after data` (DIR written by budget_study "
        "--spoken_recipe) on a machine with the same gettext catalogs"))


def score(out: Path, records: Path | None = None) -> list[Path]:
    """Write each decoded run of the recipe in OUT/spoken-translation (``scored``) as the study writes a run, in
    OUT/spoken-translation/<B>-steps/<run_name>/, and with ``records`` copy it there too, with records/data/
    spoken-translation.json (``data_digest``: of the data's rows): a run scored on other data is refused."""
    from benchmarks.studies.budget_study import run_name

    root, written = out / TASK, []
    if records is not None:
        check_data(records, root / "data")
    for result, decoded in scored(root):
        name = f"{result['budget']}-steps/{run_name(result['setting'], result['seed'], result['learning_rate'])}"
        for folder in [root / name] + ([records / TASK / name] if records is not None else []):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "candidates.json").write_text(json.dumps(decoded, ensure_ascii=False) + "\n", encoding="utf-8")
            (folder / "results.json").write_text(json.dumps(result, ensure_ascii=False, indent=1) + "\n",
                                                 encoding="utf-8")
            written.append(folder)
    if records is not None:
        (records / "data").mkdir(parents=True, exist_ok=True)
        (records / "data" / f"{TASK}.json").write_text(json.dumps({"sha256": data_digest(root / "data")}, indent=1)
                                                       + "\n")
    return written


def main() -> None:
    parse = argparse.ArgumentParser(description="the spoken-translation recipe's runs at budgets as the budget "
                                    "study's results (OUT/spoken-translation/<B>-steps/<run>)")
    parse.add_argument("--out", type=Path, required=True, help="the study's --out (the recipe's outputs in "
                       f"OUT/{TASK}: budget_study --spoken_recipe sets them there)")
    parse.add_argument("--record", type=Path, help="copy them to this folder too (benchmarks/studies/records/budget)")
    args = parse.parse_args()
    for folder in score(args.out, args.record):
        print(folder)


if __name__ == "__main__":
    main()
