"""When MCL pays: the defaults study's tasks and settings at several training budgets, beside LoRA-MLE decoded four
ways and the K-seed ensemble, every system decoded from its best checkpoint at an equal forward budget (issue 64).

The tasks, the MCL settings and the scoring are the defaults study's (``benchmarks.studies.defaults_study``: markov
K = 3, bilingual K = 2, short K = 3, and on request ``--tasks markov-skewed``: the Markov chains drawn 60/30/10;
SmolLM2-135M-Instruct through `loramcl train`'s own code, LoRA r = 8 per hypothesis on q_proj and v_proj, 16 examples a
step, learning rate 2e-3, cosine after 10 warm-up steps). New here:

  budgets     each budget (optimizer steps) is a whole run with its own schedule, as a user's budget is
  validation  ``--validation`` rows of the task's data held out (``build_data``: the training rows are the defaults
              study's but on the short answers, whose last 64 words go), validated every budget / ``--evaluations``
              steps, the adapters of the lowest validation loss kept (TrainConfig keep_best: ``<run>/best``), and
              every system decoded and scored from them
  systems     at K rows of forward budget per prompt: each MCL setting greedy per hypothesis; LoRA-MLE at equal
              trainable parameters (one LoRA of rank r K: ``mle``) with beam search of K, diverse beam search of K
              groups (lambda ``DIVERSITY_PENALTY``), K samples, and its greedy answer; ``ensemble``: K LoRA-MLE runs of
              rank r (the hypothesis size; training seeds seed K .. seed K + K - 1) assembled into one K-hypothesis
              model (``loramcl.mcl.ensemble.assemble_hypotheses``, through the recipes' ``recipes.ensemble.assemble``),
              greedy per member, each member from its own best checkpoint
  oracle NLL  of the test references (markov: 60 sequences drawn from the mixture, grouped by first state), by
              `loramcl nll`'s code: per reference the lowest mean token NLL over the K hypotheses (one LoRA: its NLL;
              the ensemble: over its members), averaged over the references
  crossover   per task and MCL setting, the smallest budget from which on (at it and every larger budget measured) it
              beats each baseline (beam K, diverse beam K, samples, the ensemble) on best-of-K and modes covered: as
              good on both and better on one (``beats``), each budget on the seeds both finished and at the same
              learning rate; else "not within <largest budget> steps"; where the one LoRA also ran with an option
              (``mle-loraplus``), a crossover table against it too
  spoken      the issue's fourth task runs through its own recipe (``--spoken_recipe``), at the recipe's learning
  translation rate (1e-3); ``benchmarks.studies.spoken_budgets`` scores its runs into OUT/spoken-translation as
              this study's runs, which ``--table`` reads with them
  learning    2e-3 for every system (``LEARNING_RATE``); the same command with another ``--learning_rate`` adds runs
  rates       named by it (``run_name``: relaxed-0.05-lr0.004-s0) beside the study's, and ``--table`` then shows too
              the systems run at two rates or more each at its rate of lowest validation loss (``budget_tables.tuned``:
              the oracle NLL of the kept adapters, which every results.json holds as ``best_eval_loss``, on the seeds
              that ran every rate), with every seed run at that rate: tune on seed 0, add seed 1 at the rate chosen

    python -m benchmarks.studies.budget_study --model models/SmolLM2-135M-Instruct --out /tmp/budgets \
        --budgets 60 200 600 --tasks markov bilingual short --seeds 0 1
    python -m benchmarks.studies.budget_study --out /tmp/budgets --table

Finished runs (a results.json) are skipped, a run killed while training resumes from its last checkpoint (one at each
validation), so the command can be stopped and started again. ``--record DIR`` copies each finished run's scores and
answers to DIR (``record``; the repository's: ``RECORDS``), where ``--table`` and ``verdict_agreement`` read them after
the run's folder is gone. ``--device cuda`` trains with bfloat16 autocast and TF32
(``--no-bf16``: float32) and decodes in float32 on the GPU; ``--prune`` deletes each finished run's weights.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from benchmarks.studies import defaults_study as study

ENSEMBLE = "ensemble"
MCL_SETTINGS = ("relaxed-0.05", "shared", "bias", "bias-0.1", "staged", "loraplus", "eps-mean", "combined",
                "shared-loraplus")  # today's default and issue 63's options
DEFAULT_SETTINGS = (*MCL_SETTINGS, "mle", ENSEMBLE)
CHOICES = (*study.SETTINGS, ENSEMBLE)
MLE_STRATEGIES = ("beam", "diverse_beam", "sample", "greedy")  # the one LoRA's: K beams, K groups, K samples, 1
DIVERSITY_PENALTY = 0.8  # lambda of diverse beam search (the paper: 0.8 or 1.0; the spoken-translation recipe's 0.8)
MARKOV_REFERENCES = 60  # sequences drawn from the mixture as the markov task's test references (for the NLL)
# MCL runs decode this many validation prompts per hypothesis at each validation and at the end: the output verdict
# (training.outputs, issue 64) with the rows' "mode" column, kept in results.json beside the NLL verdict
OUTPUT_PROMPTS = 16
# the finished runs the repository keeps (--record): a machine's runs go with it, these stay and add up
RECORDS = Path(__file__).parent / "records" / "budget"
DATA_FILES = ("train.jsonl", "validation.jsonl", "test.jsonl", "references.jsonl")  # build_data's
LEARNING_RATE = 2e-3  # the study's, for every system; runs at another (--learning_rate) carry it in their names


def rate_suffix(learning_rate: float) -> str:
    """"" at the study's learning rate, else "-lr<rate>" (e.g. "-lr0.004"): in a run's name and its system's."""
    return "" if learning_rate == LEARNING_RATE else f"-lr{learning_rate:g}"


def run_name(setting: str, seed: int, learning_rate: float = LEARNING_RATE) -> str:
    """A run's folder in <task>/<budget>-steps: ``<setting>-s<seed>``, ``<setting>-lr<rate>-s<seed>`` at a learning
    rate not the study's, so that one system's runs at several rates sit side by side (``budget_tables.tuned``
    picks each system's by its validation loss)."""
    return f"{setting}{rate_suffix(learning_rate)}-s{seed}"


# ---- data ----------------------------------------------------------------------------------------------------

def build_data(task: str, folder: Path, train: int, validation: int, test: int) -> None:
    """train.jsonl, validation.jsonl, test.jsonl and references.jsonl (prompt, references: what the NLL scores) in
    ``folder``, from the defaults study's ``build_task``: the Markov task's ``train`` rows and ``validation`` more
    drawn apart (seed 2); a translation task's next ``validation`` messages after its ``train`` ones held out (the
    short-answer task has fewer words than that: its last ``validation`` go). validation.jsonl, written last, marks
    the folder done."""
    if (folder / "validation.jsonl").exists():
        return
    markov, weights = study.is_markov(task), study.MARKOV_WEIGHTS.get(task)
    study.build_task(task, folder / "all", train if markov else train + validation, test)
    rows = study.read_rows(folder / "all" / "train.jsonl")
    if markov:
        rows += study.markov_rows(validation, seed=2, weights=weights)
    if len(rows) <= validation:
        raise ValueError(f"task {task} has {len(rows)} training rows, too few to hold {validation} out for "
                         "validation: lower --validation")
    tests = study.read_rows(folder / "all" / "test.jsonl")
    if markov:  # its test prompts have no references: sequences drawn from the mixture (seed 1), by first state
        drawn = study.markov_rows(MARKOV_REFERENCES, seed=1, weights=weights)
        references = [{"prompt": row["prompt"], "references": [r["target"] for r in drawn
                                                                if r["prompt"] == row["prompt"]]} for row in tests]
    else:
        references = [{"prompt": row["prompt"], "references": row["references"]} for row in tests]
    for name, part in (("test", tests), ("references", [r for r in references if r["references"]]),
                       ("train", rows[:-validation]), ("validation", rows[-validation:])):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part),
                                              encoding="utf-8")


# ---- training ------------------------------------------------------------------------------------------------

def evaluation_interval(budget: int, evaluations: int) -> int:
    """Validation (and a checkpoint) every this many steps: ``evaluations`` times in a run of ``budget`` steps."""
    return max(1, budget // evaluations)


def train_run(args, data: Path, out: Path, setting: str, hypotheses: int, seed: int, budget: int) -> None:
    """One `loramcl train` run (finetune.train) of ``setting`` (``defaults_study.run_configs``) for ``budget`` steps,
    validated every ``evaluation_interval`` steps, its best adapters kept in out/best; resumed from its last
    checkpoint if it was stopped."""
    from loramcl.mcl.config import MCLConfig
    from loramcl.training import fit as finetune
    from loramcl.training.config import DataConfig, TrainConfig

    mcl, training = study.run_configs(setting, hypotheses, args.rank)
    every = evaluation_interval(budget, args.evaluations)
    cuda = args.device == "cuda"
    schedule = TrainConfig(steps=budget, seed=seed, learning_rate=args.learning_rate, logging_steps=min(5, every),
                           eval_every=every, keep_best=True, save_every=every, keep_checkpoints=1,
                           bf16=cuda and args.bf16, tf32=cuda, **training,
                           output_verdict=0 if study.is_mle(setting) else OUTPUT_PROMPTS)
    files = DataConfig(train_file=str(data / "train.jsonl"), validation_file=str(data / "validation.jsonl"),
                       eval_examples=None)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        finetune.train(model=str(args.model), out=str(out), data=files,
                       mcl=MCLConfig(target_modules=["q_proj", "v_proj"], **mcl), training=schedule,
                       threads=args.threads, resume=True)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # a finished run is never resumed


# ---- decoding and scoring ------------------------------------------------------------------------------------

def decode(net, tokenizer, task: str, rows: list[dict], hypotheses: int, strategy: str) -> list[list[str]]:
    """K candidates per test prompt: an MCL model greedy per hypothesis; one LoRA's beam search of K beams, diverse
    beam search of K groups of one beam, K samples, or (``greedy``) its one greedy answer."""
    from loramcl.decoding import generate_hypotheses

    options = {"strategy": strategy, "max_new_tokens": study.MAX_NEW_TOKENS[task]}
    if strategy != "greedy":
        options |= {"num_sequences": hypotheses, "seed": 0}
    if strategy in ("beam", "diverse_beam"):
        options["num_beams"] = hypotheses
    if strategy == "diverse_beam":
        options["diversity_penalty"] = DIVERSITY_PENALTY
    outs = []
    for start in range(0, len(rows), 20):
        prompts = [r["prompt"] for r in rows[start:start + 20]]
        outs += [[c.text for c in cands] for cands in generate_hypotheses(net, tokenizer, prompts, log_probs=False,
                                                                          **options)]
    return outs


def reference_nll(args, adapters: Path, data: Path) -> float:
    """Oracle NLL of the test references under ``adapters`` (`loramcl nll`, ``metrics.oracle_nll``): per reference
    the lowest mean token NLL over the hypotheses, averaged over the references."""
    import numpy as np

    from loramcl.metrics.nll import oracle_nll
    from loramcl.training.reference_nll import nll

    out = adapters / "reference_nll.jsonl"
    with contextlib.redirect_stdout(io.StringIO()):
        nll(str(args.model), str(adapters), str(data / "references.jsonl"), out=str(out), device=args.device,
            threads=args.threads, progress=False)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return oracle_nll([np.array(row["nll"]) for row in rows])["oracle_nll"]


def evaluate(args, task: str, adapters: Path, hypotheses: int, strategies) -> tuple[dict, dict]:
    """({strategy: scores} and the oracle NLL, {strategy: candidates}) of the adapters in ``adapters``."""
    from transformers import AutoTokenizer

    from loramcl.models import load_model

    data = args.out / "data" / task
    rows = study.read_rows(data / "test.jsonl")
    identifier = None if study.is_markov(task) else study.language_identifier(data, task)
    tokenizer = AutoTokenizer.from_pretrained(args.model)  # the runs save it; an assembled ensemble does not
    net = load_model(str(args.model), adapters=str(adapters), device=args.device)
    decoded = {s: decode(net, tokenizer, task, rows, hypotheses, s) for s in strategies}
    del net
    scores = {"test": {s: study.score(task, rows, c, identifier) for s, c in decoded.items()},
              "oracle_nll": reference_nll(args, adapters, data)}
    return scores, decoded


def best(run: Path) -> dict:
    """The step and validation loss of ``run``'s kept adapters (best.json: the oracle NLL min_k for K >= 2)."""
    return json.loads((run / "best" / "best.json").read_text())


KEPT = ("results.json", "candidates.json", "run.json", "train_log.json", "best.json", "reference_nll.jsonl")


def prune(folder: Path) -> None:
    """All but the records and scores (``KEPT``) of a finished run: its adapters, its best's, the tokenizer files,
    checkpoints (a K = 3 run keeps about 100 kB instead of 20 MB)."""
    for path in sorted(folder.rglob("*"), reverse=True):  # files before their folders
        if path.is_file() and path.name not in KEPT:
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()


# ---- the study -----------------------------------------------------------------------------------------------

def one_run(args, task: str, budget: int, setting: str, seed: int) -> dict:
    """Train (or reuse), decode from the best checkpoint and score one system of ``setting`` at ``budget`` steps;
    its results.json, once written, is read back instead."""
    folder = args.out / task / f"{budget}-steps"
    run = folder / run_name(setting, seed, args.learning_rate)
    if (run / "results.json").exists():
        return json.loads((run / "results.json").read_text())
    data, hypotheses = args.out / "data" / task, study.TASKS[task]
    common = {"task": task, "setting": setting, "seed": seed, "K": hypotheses, "budget": budget,
              "learning_rate": args.learning_rate, "rank": args.rank, "device": args.device,
              "bf16": args.device == "cuda" and args.bf16}
    if setting == ENSEMBLE:
        return ensemble_run(args, task, budget, seed, common)
    if not (run / "run.json").exists():
        train_run(args, data, run, setting, hypotheses, seed, budget)
    record, kept = json.loads((run / "run.json").read_text()), best(run)
    started = time.perf_counter()
    scores, decoded = evaluate(args, task, run / "best", hypotheses,
                               MLE_STRATEGIES if study.is_mle(setting) else ("greedy",))
    result = common | {"train_seconds": record["seconds"], "resumed_from": record.get("resumed_from"),
                       "best_step": kept["step"], "best_eval_loss": kept["eval_loss"],
                       "trainable_parameters": record.get("trainable_parameters")} | scores
    if not study.is_mle(setting):
        table = study.wins_by_mode(args.model, run / "best", data, hypotheses)
        result |= {"verdict": record.get("specialisation"), "output_verdict": record.get("outputs"),
                   "curve": study.logged_curve(run),
                   "wins_by_mode": table, "mode_purity": study.mode_purity(table)}
    result["eval_seconds"] = round(time.perf_counter() - started, 1)
    return finish(args, run, result, decoded)


def ensemble_run(args, task: str, budget: int, seed: int, common: dict) -> dict:
    """The K-seed ensemble of ``seed``: K LoRA-MLE runs of rank r (training seeds seed K + i), each kept at its
    best checkpoint, assembled into one K-hypothesis model (run and best) and decoded greedy per member."""
    from loramcl.recipes.ensemble import assemble

    folder, data, hypotheses = args.out / task / f"{budget}-steps", args.out / "data" / task, study.TASKS[task]
    rate = rate_suffix(args.learning_rate)
    members = [f"mle-r{args.rank}{rate}-s{seed * hypotheses + i}" for i in range(hypotheses)]
    for member in members:
        if not (folder / member / "run.json").exists():
            train_run(args, data, folder / member, "mle", 1, int(member.rsplit("-s", 1)[1]), budget)
    run = folder / run_name(ENSEMBLE, seed, args.learning_rate)
    if not (run / "run.json").exists():
        assemble(folder, run.name, {"model": str(args.model), "dtype": "float32"}, members, best=True)
    record, kept = json.loads((run / "run.json").read_text()), [best(folder / m) for m in members]
    started = time.perf_counter()
    scores, decoded = evaluate(args, task, run / "best", hypotheses, ("greedy",))
    result = common | {"members": members, "train_seconds": record["seconds"],
                       "best_step": [b["step"] for b in kept], "best_eval_loss": [b["eval_loss"] for b in kept],
                       "trainable_parameters": record.get("trainable_parameters")} | scores
    result["eval_seconds"] = round(time.perf_counter() - started, 1)
    if args.prune:
        for member in members:
            prune(folder / member)
    return finish(args, run, result, decoded)


def finish(args, run: Path, result: dict, decoded: dict) -> dict:
    """Write the candidates, then the results (each whole: a study stopped by a time limit leaves no half file)."""
    for name, values, indent in (("candidates", decoded, 0), ("results", result, 1)):  # results last: it is finished
        staged = run / f"{name}.json.tmp"
        staged.write_text(json.dumps(values, ensure_ascii=False, indent=indent) + "\n", encoding="utf-8")
        staged.replace(run / f"{name}.json")
    if args.prune:
        prune(run)
    return result


# ---- records --------------------------------------------------------------------------------------------------

def data_digest(folder: Path) -> dict:
    """The SHA-256 of each of a task's data files (``build_data``'s in ``folder``)."""
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in DATA_FILES}


def check_data(records: Path, data: Path, task: str, digest=data_digest, files: tuple[str, ...] = DATA_FILES,
               build: str | None = None) -> None:
    """Refuse ``data`` (a task's folder) unless it is the data ``records``' runs of ``task`` were scored on: the
    ``digest`` of its ``files`` (another task's: spoken_budgets'), ``build`` saying how to build it again."""
    kept = records / "data" / f"{task}.json"
    if not kept.exists():
        return
    missing = [name for name in files if not (data / name).exists()]
    if missing or json.loads(kept.read_text())["sha256"] != digest(data):
        what = f"no {', '.join(missing)}" if missing else f"not the {task} data the runs of {records} were scored on"
        build = build or (f"build it with this checkout's `budget_study --data_only --tasks {task}` on a machine "
                          "with the same gettext catalogs")
        raise SystemExit(f"{data}: {what} ({kept}): {build}, or record into another folder")


def record(out: Path, records: Path, task: str, budget: int, setting: str, seed: int,
           learning_rate: float = LEARNING_RATE) -> Path:
    """Copy one finished run from ``out`` to ``records``, in the same layout: its scores (results.json, with its
    run.json's ``seconds_partial`` in it) and its decoded answers (candidates.json), what ``--table`` and
    ``verdict_agreement`` read; and records/data/<task>.json, the SHA-256 of the task's data files (the data is built
    again from the code, never kept: the translation tasks' comes from this machine's gettext catalogs). A run scored
    on other data than the runs recorded before is refused."""
    from benchmarks.studies.budget_tables import read_result

    run = out / task / f"{budget}-steps" / run_name(setting, seed, learning_rate)
    data, digest = out / "data" / task, records / "data"
    check_data(records, data, task)
    if not (digest / f"{task}.json").exists():  # the first run of the task recorded
        digest.mkdir(parents=True, exist_ok=True)
        (digest / f"{task}.json").write_text(json.dumps({"sha256": data_digest(data)}, indent=1) + "\n")
    result = read_result(run / "results.json")
    kept = records / task / f"{budget}-steps" / run.name
    kept.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run / "candidates.json", kept / "candidates.json")
    (kept / "results.json").write_text(json.dumps(result, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    return kept


def parser() -> argparse.ArgumentParser:
    parse = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parse.add_argument("--model", type=Path, default=Path("models/SmolLM2-135M-Instruct"))
    parse.add_argument("--out", type=Path, required=True)
    parse.add_argument("--budgets", nargs="+", type=int, default=[60, 200, 600], help="optimizer steps, one run each")
    parse.add_argument("--tasks", nargs="+", default=list(study.MAIN_TASKS), choices=list(study.TASKS))
    parse.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS), choices=list(CHOICES),
                       help="MCL settings (defaults_study.SETTINGS), mle (one LoRA of rank r K) and ensemble")
    parse.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parse.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parse.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                       help="--device cuda: bfloat16 autocast in training (--no-bf16: float32)")
    parse.add_argument("--threads", type=int, default=1, help="torch CPU threads of each run")
    parse.add_argument("--learning_rate", type=float, default=LEARNING_RATE, help="of every run; runs at another "
                       "than the study's carry it in their names (a second command adds a learning rate)")
    parse.add_argument("--rank", type=int, default=8, help="LoRA rank of each hypothesis (LoRA-MLE: rank * K)")
    parse.add_argument("--evaluations", type=int, default=5, help="validations (and checkpoints) per run")
    parse.add_argument("--train_examples", type=int, default=2000)
    parse.add_argument("--validation", type=int, default=64, help="training rows held out for validation")
    parse.add_argument("--test_prompts", type=int, default=60)
    parse.add_argument("--prune", action="store_true", help="delete each finished run's weights (keep its scores)")
    parse.add_argument("--data_only", action="store_true", help="only build the tasks' data in OUT/data (the "
                       "bilingual and short tasks read this machine's gettext catalogs)")
    parse.add_argument("--spoken_recipe", type=Path, help="only write a copy of the spoken-translation recipe with its "
                       "runs at --budgets and --seeds in this folder (its outputs: OUT/spoken-translation; "
                       "benchmarks.studies.spoken_budgets) and print the command that runs it")
    parse.add_argument("--record", type=Path, help="copy each finished run's scores and answers to this folder (the "
                       f"repository's: {RECORDS.relative_to(Path(__file__).parents[2])})")
    parse.add_argument("--table", action="store_true", help="only print the tables of the finished runs (of --out: "
                       "a study's or a --record folder)")
    return parse


def main() -> None:
    args = parser().parse_args()
    if args.table:
        from benchmarks.studies.budget_tables import tables

        print(tables(args.out))
        return
    if min(args.budgets) < 1 or min(args.seeds) < 0 or args.evaluations < 1:
        raise SystemExit(f"--budgets {args.budgets}, --seeds {args.seeds}, --evaluations {args.evaluations}: budgets "
                         "and evaluations are positive counts, seeds 0 or more")
    if args.spoken_recipe is not None:
        from benchmarks.studies.spoken_budgets import write_recipe

        command = write_recipe(args.spoken_recipe, args.out.absolute() / "spoken-translation", args.budgets,
                               args.seeds, args.evaluations)
        print(f"the spoken-translation recipe at {args.budgets} steps: {args.spoken_recipe}; run it with\n"
              + " ".join(command) + "\nthen score its runs as this study's (--table reads them) with\n"
              f"python -m benchmarks.studies.spoken_budgets --out {args.out}")
        return
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch starts CUDA: training would take a GPU it sees
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU here: run with --device cpu")
    torch.set_num_threads(args.threads)
    from transformers.utils import logging

    logging.set_verbosity_error()
    for task in args.tasks:
        build_data(task, args.out / "data" / task, args.train_examples, args.validation, args.test_prompts)
    if args.data_only:
        print(f"the tasks' data: {args.out / 'data'}")
        return
    for budget in sorted(args.budgets):
        for seed in args.seeds:
            for task in args.tasks:
                for setting in args.settings:
                    result = one_run(args, task, budget, setting, seed)
                    if args.record is not None:
                        record(args.out, args.record, task, budget, setting, seed, args.learning_rate)
                    print(json.dumps({k: result[k] for k in ("task", "budget", "setting", "seed", "train_seconds",
                                                             "best_step", "oracle_nll", "test")}), flush=True)


if __name__ == "__main__":
    main()
