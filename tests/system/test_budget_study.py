"""The study across budgets (benchmarks/studies/budget_study.py, issue 64): its pipeline on a tiny model (two budgets
of one MCL setting, the one LoRA decoded four ways and the K-seed ensemble, each from its best checkpoint; finished
runs read back), and the crossover on hand-made numbers."""

from __future__ import annotations

import json
import shutil
from argparse import Namespace
from dataclasses import replace

import pytest
from tiny_models import save_tiny_run_inputs

from loramcl import MCLConfig
from loramcl.training.fit import COMMAND_MCL

from benchmarks.studies import budget_study as study
from benchmarks.studies import budget_tables
from benchmarks.studies.defaults_study import read_rows


def test_two_budgets_train_keep_the_best_decode_score_and_are_reused(tmp_path, monkeypatch):
    monkeypatch.setitem(study.study.TASKS, "markov", 2)  # K = 2 (the task has 3 chains): two ensemble members to train
    base = save_tiny_run_inputs(tmp_path) / "base"
    args = Namespace(model=base, out=tmp_path / "study", learning_rate=study.LEARNING_RATE, rank=4, evaluations=2,
                     device="cpu", bf16=True, threads=1, prune=False)
    data = args.out / "data" / "markov"
    study.build_data("markov", data, train=40, validation=8, test=3)
    assert [len(read_rows(data / f"{name}.jsonl")) for name in ("train", "validation", "test")] == [40, 8, 3]
    assert all(r["references"] for r in read_rows(data / "references.jsonl"))  # drawn sequences
    results = {(budget, setting): study.one_run(args, "markov", budget, setting, seed=0)
               for budget in (1, 2) for setting in ("relaxed-0.05", "mle", "ensemble")}
    for (budget, setting), result in results.items():
        assert {"train_seconds", "best_step", "best_eval_loss", "oracle_nll", "test", "trainable_parameters"} <= set(
            result)
        assert result["budget"] == budget and result["oracle_nll"] > 0
        steps = result["best_step"] if setting == "ensemble" else [result["best_step"]]
        assert all(1 <= step <= budget for step in steps)  # validated every step: the best is a step of the run
        runs = result["members"] if setting == "ensemble" else [f"{setting}-s0"]
        assert [json.loads((args.out / "markov" / f"{budget}-steps" / run / "best" / "best.json").read_text())[
            "eval_loss"] for run in runs] == (result["best_eval_loss"] if setting == "ensemble" else
                                              [result["best_eval_loss"]])  # the kept adapters' validation loss
        assert result["trainable_parameters"] == 2 * 4 * 224  # K r = r K = K members of rank r: equal
    assert set(results[2, "mle"]["test"]) == {"beam", "diverse_beam", "sample", "greedy"}
    assert set(results[2, "relaxed-0.05"]["test"]) == set(results[2, "ensemble"]["test"]) == {"greedy"}
    assert results[2, "ensemble"]["members"] == ["mle-r4-s0", "mle-r4-s1"]
    verdict = results[2, "relaxed-0.05"]["output_verdict"]  # its answers read: too few examples for a verdict
    assert verdict["kind"] == "no verdict" and "training examples seen" in verdict["reason"]
    assert "output_verdict" not in results[2, "mle"]
    assert len(json.loads((args.out / "markov" / "2-steps" / "ensemble-s0" / "candidates.json").read_text())
               ["greedy"][0]) == 2  # one candidate per member
    folder = args.out / "markov" / "2-steps"
    assert not (folder / "relaxed-0.05-s0" / "checkpoints").exists()  # a finished run is never resumed
    # finished runs are read back, not trained or decoded again
    (folder / "relaxed-0.05-s0" / "run.json").unlink()
    shutil.rmtree(folder / "mle-r4-s1")
    assert study.one_run(args, "markov", 2, "relaxed-0.05", seed=0) == results[2, "relaxed-0.05"]
    assert study.one_run(args, "markov", 2, "ensemble", seed=0) == results[2, "ensemble"]
    study.prune(folder / "mle-s0")  # --prune: the records and scores stay, the weights go
    assert {p.name for p in (folder / "mle-s0").rglob("*") if p.is_file()} <= set(study.KEPT)
    assert study.one_run(args, "markov", 2, "mle", seed=0) == results[2, "mle"]
    printed = budget_tables.tables(args.out)
    assert "| LoRA-MLE r8, diverse beam 2 | 2 | 1 |" in printed
    assert "| ensemble of 2 LoRA-MLE r4, greedy | 1 | 1 |" in printed
    assert "| markov | relaxed-0.05 |" in printed
    # a second learning rate: its runs named by it, tabled beside the study's, and each system at its rate of lowest
    # validation loss
    slower = study.one_run(Namespace(**vars(args) | {"learning_rate": 1e-3}), "markov", 2, "mle", seed=0)
    assert slower["learning_rate"] == 1e-3 and (folder / "mle-lr0.001-s0" / "best").is_dir()
    printed = budget_tables.tables(args.out)
    assert "| LoRA-MLE r8, beam 2 | 2 | 1 |" in printed and "| LoRA-MLE r8 (lr 0.001), beam 2 | 2 | 1 |" in printed
    losses = {1e-3: slower["best_eval_loss"], 2e-3: results[2, "mle"]["best_eval_loss"]}
    assert (f"| markov | mle | 2 | 0 | 0.001: {losses[1e-3]:.3f}, 0.002: {losses[2e-3]:.3f} | "
            f"{min(losses, key=losses.get):g} |") in printed.split("Each system at its own learning rate")[1]
    # --record: the runs' scores and answers kept elsewhere read as the runs did, after the runs are gone
    from benchmarks.studies.verdict_agreement import run_verdicts

    records, verdicts = tmp_path / "records", run_verdicts(args.out)
    for budget, setting in results:
        study.record(args.out, records, "markov", budget, setting, seed=0)
    study.record(args.out, records, "markov", 2, "mle", seed=0, learning_rate=1e-3)
    assert not list(records.rglob("*.safetensors")) and (records / "data" / "markov.json").exists()
    shutil.move(args.out / "markov", tmp_path / "gone")
    assert budget_tables.tables(records) == printed
    assert run_verdicts(records, data.parent) == verdicts and len(verdicts) == 2  # the MCL setting at both budgets
    with pytest.raises(SystemExit, match="no train.jsonl, validation.jsonl, test.jsonl, references.jsonl"):
        run_verdicts(records, tmp_path)  # the data not built again
    (data / "train.jsonl").write_text("{}\n")  # other data: refused, read or recorded
    with pytest.raises(SystemExit, match="not the markov data the runs of .*records were scored on"):
        run_verdicts(records, data.parent)
    shutil.move(tmp_path / "gone", args.out / "markov")
    with pytest.raises(SystemExit, match="build it with this checkout's `budget_study --data_only --tasks markov`"):
        study.record(args.out, records, "markov", 2, "mle", seed=0)


def test_the_repositorys_records_read_as_the_studys_runs():
    """The study's runs kept in the repository (RECORDS, ``--record``): each with its answers and its task's data
    digest, and ``--table`` reads them."""
    results = budget_tables.read_results(study.RECORDS)
    assert results, f"no records in {study.RECORDS}"
    for result in results:
        run = study.RECORDS / result["task"] / f"{result['budget']}-steps" / study.run_name(
            result["setting"], result["seed"], result["learning_rate"])
        assert (run / "candidates.json").exists() and (study.RECORDS / "data" / f"{result['task']}.json").exists()
        assert "seconds_partial" in result and "best_eval_loss" in result
    printed = budget_tables.tables(study.RECORDS)
    assert all(f"{task} (K = " in printed for task in {r["task"] for r in results})


def test_the_crossover_is_the_budget_from_which_mcl_beats_each_baseline(tmp_path):
    def write(setting, budget, **test):
        folder = tmp_path / "short" / f"{budget}-steps" / f"{setting}-s0"
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps(
            {"task": "short", "setting": setting, "seed": 0, "budget": budget, "rank": 8, "best_step": 10,
             "train_seconds": 1.0, "oracle_nll": 2.0, "test": test}))

    def scores(oracle, modes):
        return {"oracle": oracle, "mean": 0.1, "distinct": 2.0, "modes_covered": modes}

    for budget in (60, 200, 600):
        write("mle", budget, beam=scores(0.2, 1.0), diverse_beam=scores(0.1, 1.5), sample=scores(0.05, 1.0),
              greedy=scores(0.1, 0.5))
        write("ensemble", budget, greedy=scores(0.3, 2.5))
    write("shared", 60, greedy=scores(0.1, 1.1))  # worse than beam at 60 steps, better from 200 on
    write("shared", 200, greedy=scores(0.2, 1.6))  # ties beam on best of K, more modes: beats it
    write("shared", 600, greedy=scores(0.25, 1.6))
    write("bias", 60, greedy=scores(0.1, 0.9))
    write("bias", 200, greedy=scores(0.3, 1.6))  # beats beam at 200 steps only: not "from" it
    write("bias", 600, greedy=scores(0.3, 0.9))
    record = {"settings": {"model": "m"}, "seconds": 1.0, "trainable_parameters": 4, "resumed_from": "checkpoint-40"}
    (tmp_path / "short" / "60-steps" / "mle-s0" / "run.json").write_text(json.dumps(record))  # seconds unknown before
    (tmp_path / "short" / "200-steps" / "mle-s0" / "run.json").write_text(json.dumps(record | {
        "seconds_before_resume": 0.6}))  # its checkpoint recorded them: counted
    printed = budget_tables.tables(tmp_path)  # training seconds that count from a resume only are marked
    assert "| LoRA-MLE r24, beam 3 | 60 | 1 | 0.20 | 0.10 | 2.00 | 1.00 | 2.000 | 10 | 1* |" in printed
    assert "| LoRA-MLE r24, beam 3 | 200 | 1 | 0.20 | 0.10 | 2.00 | 1.00 | 2.000 | 10 | 1 |" in printed
    lines = printed.split("Crossover")[1].splitlines()[-2:]
    never = " | ".join(["not within 600 steps"] * 4)
    assert lines == ["| short | shared | 200 | 200 | 60 | not within 600 steps |", f"| short | bias | {never} |"]
    assert "mle-loraplus" not in printed
    write("mle-loraplus", 200, beam=scores(0.2, 1.7), diverse_beam=scores(0.1, 1.0), sample=scores(0.05, 1.0),
          greedy=scores(0.1, 0.5))  # the one LoRA with LoRA+: a crossover table of its own
    markov = tmp_path / "markov" / "200-steps" / "shared-s0"  # a task where it did not run
    markov.mkdir(parents=True)
    (markov / "results.json").write_text((tmp_path / "short" / "200-steps" / "shared-s0" / "results.json").read_text()
                                         .replace('"short"', '"markov"'))
    printed = budget_tables.tables(tmp_path)
    assert "| LoRA-MLE r24-loraplus, beam 3 | 200 | 1 | 0.20 |" in printed
    lines = printed.split("Crossover against the one LoRA of `mle-loraplus`")[1].splitlines()[4:]
    assert lines == ["| short | shared | not within 200 steps | 200 | 200 | not within 600 steps |",
                     "| short | bias | not within 200 steps | 200 | 200 | not within 600 steps |"]  # not markov's
    assert budget_tables.crossover({}) == "-"
    same = scores(1.0, 2.0)
    assert not budget_tables.beats(same, same) and budget_tables.beats(scores(1.0, 2.5), same)  # Markov: modes decide
    assert not budget_tables.beats(scores(0.9, 3.0), same)  # more modes, worse best of K


def test_each_system_is_held_to_the_baselines_at_its_learning_rate_and_at_its_own_best_rate(tmp_path):
    def write(setting, rate, loss, seed=0, **test):
        folder = tmp_path / "short" / "200-steps" / study.run_name(setting, seed, rate)
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps(
            {"task": "short", "setting": setting, "seed": seed, "budget": 200, "rank": 8, "learning_rate": rate,
             "best_step": 10, "best_eval_loss": loss, "train_seconds": 1.0, "oracle_nll": 2.0, "test": test}))

    def scores(oracle, modes):
        return {"oracle": oracle, "mean": 0.1, "distinct": 2.0, "modes_covered": modes}

    assert study.run_name("relaxed-0.05", 1) == "relaxed-0.05-s1"  # the study's rate: the names of before
    assert study.run_name("relaxed-0.05", 1, 4e-3) == "relaxed-0.05-lr0.004-s1"
    assert budget_tables.parts("mle-loraplus-lr0.004:beam") == ("mle-loraplus", "-lr0.004", "beam")
    assert budget_tables.parts("relaxed-0.05") == ("relaxed-0.05", "", "")
    mle = {"beam": scores(0.2, 1.0), "diverse_beam": scores(0.1, 1.0), "sample": scores(0.1, 1.0),
           "greedy": scores(0.1, 0.5)}
    write("mle", 2e-3, 3.0, **mle)
    write("mle", 4e-3, 2.5, **mle | {"beam": scores(0.4, 1.0)})  # better at the higher rate
    write("relaxed-0.05", 2e-3, 2.9, greedy=scores(0.3, 1.5))  # beats the one LoRA at 2e-3
    write("relaxed-0.05", 4e-3, 2.95, greedy=scores(0.35, 1.5))  # loses to it at 4e-3 (beam 0.4)
    write("ensemble", 2e-3, [2.0, 4.0], greedy=scores(0.5, 2.0))
    write("ensemble", 4e-3, [2.8, 3.0], greedy=scores(0.1, 0.5))  # lower mean (2.9 < 3.0): chosen
    printed = budget_tables.tables(tmp_path)
    assert "| relaxed-0.05 (lr 0.004) | 200 | 1 | 0.35 |" in printed
    assert "| LoRA-MLE r24 (lr 0.004), beam 3 | 200 | 1 | 0.40 |" in printed
    assert "| ensemble of 3 LoRA-MLE r8 (lr 0.004), greedy | 200 | 1 | 0.10 |" in printed
    assert printed.index("| relaxed-0.05 |") < printed.index("| relaxed-0.05 (lr 0.004) |")
    crossover = printed.split("Crossover: ")[1].split("Each system")[0].strip().splitlines()[-2:]
    assert crossover == ["| short | relaxed-0.05 | 200 | 200 | 200 | not within 200 steps |",
                         "| short | relaxed-0.05-lr0.004 | not within 200 steps | 200 | 200 | 200 |"]  # same rates
    tuned = printed.split("Each system at its own learning rate")[1]
    assert "| short | relaxed-0.05 | 200 | 0 | 0.002: 2.900, 0.004: 2.950 | 0.002 | 0 |" in tuned
    assert "| short | mle | 200 | 0 | 0.002: 3.000, 0.004: 2.500 | 0.004 | 0 |" in tuned
    assert "| short | ensemble | 200 | 0 | 0.002: 3.000, 0.004: 2.900 | 0.004 | 0 |" in tuned
    assert "| LoRA-MLE r24, beam 3 | 200 | 1 | 0.40 |" in tuned and "(lr " not in tuned  # named as the system
    assert tuned.split("Crossover: ")[1].splitlines()[-1] == (
        "| short | relaxed-0.05 | not within 200 steps | 200 | 200 | 200 |")  # 2e-3 held to the one LoRA's 4e-3
    # a second seed, run at one rate: the rate is chosen on the seed that ran both (seed 1's high loss at 2e-3 does
    # not move it), and every seed at the chosen rate is measured
    write("relaxed-0.05", 2e-3, 3.5, seed=1, greedy=scores(0.1, 1.5))
    write("mle", 4e-3, 2.6, seed=1, **mle | {"beam": scores(0.2, 1.0)})
    tuned = budget_tables.tables(tmp_path).split("Each system at its own learning rate")[1]
    assert "| short | relaxed-0.05 | 200 | 0 | 0.002: 2.900, 0.004: 2.950 | 0.002 | 0, 1 |" in tuned
    assert "| short | mle | 200 | 0 | 0.002: 3.000, 0.004: 2.500 | 0.004 | 0, 1 |" in tuned
    assert "| relaxed-0.05 | 200 | 2 | 0.20 |" in tuned and "| LoRA-MLE r24, beam 3 | 200 | 2 | 0.30 |" in tuned
    write("bias", 2e-3, 2.0, seed=0, greedy=scores(0.1, 1.0))
    write("bias", 4e-3, 1.5, seed=1, greedy=scores(0.1, 1.0))  # no seed ran both rates: each rate's own seeds
    tuned = budget_tables.tables(tmp_path).split("Each system at its own learning rate")[1]
    assert "| short | bias | 200 | each its own | 0.002: 2.000, 0.004: 1.500 | 0.004 | 1 |" in tuned
    (tmp_path / "short" / "200-steps" / "mle-s0" / "results.json").write_text(json.dumps(
        {k: v for k, v in json.loads((tmp_path / "short" / "200-steps" / "mle-s0" / "results.json").read_text())
         .items() if k != "best_eval_loss"}))  # a run scored before the study kept its validation loss
    with pytest.raises(SystemExit, match=r"short mle 200 steps seed 0 at learning rate 0.002 has no best_eval_loss "
                       r".* best/best.json"):
        budget_tables.tables(tmp_path)


def test_the_crossover_holds_a_setting_to_the_baseline_on_the_seeds_both_ran():
    def scores(oracle, modes):
        return {"oracle": oracle, "mean": 0.1, "distinct": 2.0, "modes_covered": modes, "oracle_nll": 2.0,
                "best_step": 10, "train_seconds": 1.0, "partial": False}

    staged = {200: {0: scores(0.2, 1.2)}, 600: {1: scores(0.3, 2.0)}}  # one seed at each budget
    beam = {200: {0: scores(0.25, 1.0), 1: scores(0.1, 0.5)}, 600: {0: scores(0.1, 1.0)}}
    points = budget_tables.paired(staged, beam)
    assert list(points) == [200] and points[200][1]["oracle"] == 0.25  # seed 0 only; 600: no common seed
    assert budget_tables.crossover(points) == "not within 200 steps"  # the mean over both seeds (0.175) it would beat
    assert budget_tables.beats(staged[200][0], budget_tables.mean(list(beam[200].values())))


@pytest.mark.parametrize("argv", [["--budgets", "0"], ["--seeds", "-1"]])
def test_bad_budgets_and_seeds_are_refused(argv, monkeypatch, tmp_path):
    monkeypatch.setattr("sys.argv", ["budget_study", "--out", str(tmp_path), *argv])
    with pytest.raises(SystemExit, match="budgets and evaluations are positive counts"):
        study.main()


def test_the_spoken_translation_recipe_has_every_budget_and_seed_and_reads_as_the_recipe_reads_it(tmp_path):
    from loramcl.recipes.ensemble import ensembles
    from loramcl.recipes.files import read_recipe, run_names
    from loramcl.recipes.spoken_translation.reproduce import Experiment

    from benchmarks.studies.spoken_budgets import write_recipe

    folder = tmp_path / "recipe"
    command = write_recipe(folder, tmp_path / "out", budgets=[60, 200], seeds=[0, 1])
    assert command == ["loramcl", "spoken-translation", "--recipes", str(folder), "--threads", "1"]
    runs = run_names(folder, ("common.yaml", "experiment.yaml"))
    assert len(runs) == 2 * 2 * 6  # budgets x seeds x (MCL twice, the one LoRA, two members, the ensemble)
    values = {run: read_recipe(folder, ["common.yaml", f"{run}.yaml"]) for run in runs}
    assert ensembles(values)["ensemble-200-s1"] == ["mle-r8-200-s2", "mle-r8-200-s3"]  # checked as the runner does
    assert values["mcl-200-s1"]["training"] | {"learning_rate": None} == values["mcl-60-s0"]["training"] | {
        "steps": 200, "seed": 1, "eval_every": 40, "save_every": 40, "learning_rate": None}
    assert values["mcl-60-s0"]["training"]["keep_best"] and values["mle-60-s0"]["mcl"]["r"] == 16
    mcl, default = MCLConfig.from_dict(values["mcl-60-s0"]["mcl"]), replace(COMMAND_MCL, num_hypotheses=2)
    assert (mcl.loss, mcl.relaxed_epsilon, mcl.tie_break) == (  # `loramcl train`'s loss; the recipe's own beside it
        default.loss, default.relaxed_epsilon, default.tie_break)
    assert values["mcl-annealed-60-s0"]["mcl"]["loss"] == "annealed"
    experiment = Experiment.read(folder / "experiment.yaml")
    assert experiment.out == str(tmp_path / "out")
    assert experiment.decoded_runs(runs) == [f"{run}-{budget}-s{seed}@best" for budget in (60, 200) for seed in (0, 1)
                                             for run in ("mcl", "mcl-annealed", "mle", "ensemble")]  # from the best
    assert "ensemble-600-s0@best" not in experiment.table_runs(runs)
    assert experiment.table_runs(runs)[:2] == ["mcl-60-s0", "mcl-60-s0@best"]


SPOKEN_TRAIN = [("Open the file", "Ouvrir le fichier"), ("Save the document", "Enregistrer le document"),
                ("Close the window", "Fermer la fenêtre"), ("Delete this message", "Supprimer ce message"),
                ("Print the page", "Imprimer la page"), ("Show hidden files", "Afficher les fichiers cachés"),
                ("Connection failed", "La connexion a échoué"), ("Unable to read the file", "Impossible de lire le "
                "fichier"), ("New folder", "Nouveau dossier"), ("Search the web", "Rechercher sur le web")]


def write_spoken_outputs(root, candidates: dict[str, list[list[str]]], runs: dict[str, tuple]):
    """A spoken-translation recipe's outputs as `loramcl spoken-translation` leaves them: data, run folders (run.json,
    best/best.json), each system's predictions and their settings, each run's NLL of the test references at its best
    adapters (its oracle NLL 1.5, 1.6, ... in the order of ``runs``). ``candidates``: {system name: per test message
    its 2 candidates}; ``runs``: {run: (loss or None for LoRA-MLE, seconds, best step, members)}."""
    def jsonl(path, rows):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")

    jsonl(root / "data" / "train.jsonl", [{"id": f"train-{i}", "source": en, "fr": [fr]}
                                          for i, (en, fr) in enumerate(SPOKEN_TRAIN)])
    jsonl(root / "data" / "validation.jsonl", [])
    jsonl(root / "data" / "test.jsonl", [{"id": f"test-{i}", "source": en, "fr": [fr], "references": [en, fr],
                                          "reference_modes": ["en", "fr"]}
                                         for i, (en, fr) in enumerate(SPOKEN_TRAIN[:2])])
    for run, (loss, seconds, step, members) in runs.items():
        (root / run / "best").mkdir(parents=True)
        mcl = {"r": 8, "loss": loss, "epsilon": 0.05, "temperature_decay": 0.97} if loss else {"r": 16}
        record = {"settings": {"mcl": mcl, "training": {"learning_rate": 1e-3}}, "seconds": seconds,
                  "trainable_parameters": 100}
        (root / run / "run.json").write_text(json.dumps(record | ({"members": members} if members else {})))
        (root / run / "best" / "best.json").write_text(json.dumps({"step": step, "eval_loss": step / 100}))
    for name, cands in candidates.items():
        strategy = name.rsplit("-", 2)[1]
        strategy = {"dbs0.8": "diverse_beam", "temperature1": "sample"}.get(strategy, strategy)
        jsonl(root / "predictions" / f"{name}.jsonl", [{"id": f"test-{i}", "candidates": c}
                                                       for i, c in enumerate(cands)])
        (root / "predictions" / f"{name}.settings.json").write_text(json.dumps({"settings": {
            "strategy": strategy, "trained": "stamp"} | ({"best": "stamp"} if "@best" in name else {})}))
    for i, (run, (loss, *_)) in enumerate(runs.items()):  # [references, K]: the oracle is the first column
        jsonl(root / "nll" / f"{run}@best.jsonl", [{"id": f"test-{n}", "nll": [[1.5 + i / 10] + [9.0] * bool(loss)] * 2}
                                                  for n in range(2)])


def test_the_spoken_translation_recipes_runs_are_scored_recorded_and_tabled_as_the_studys(tmp_path):
    from benchmarks.studies import spoken_budgets

    out, records = tmp_path / "study", tmp_path / "records"
    both, one = [["Open the file", "Ouvrir le fichier"], ["Save the document", "Save the document"]], [
        ["Open the file", "Open a file"], ["Save the document", "Save document"]]
    write_spoken_outputs(out / "spoken-translation", {
        "mcl-60-s0@best-greedy-b2": both, "mcl-60-s0@best-temperature1-b2": one,  # MCL: its greedy hypotheses only
        "mcl-annealed-60-s0@best-greedy-b2": one, "mle-60-s0@best-beam-b2": one, "mle-60-s0@best-dbs0.8-b2": one,
        "mle-60-s0@best-temperature1-b2": both, "mle-60-s0-beam-b2": both,  # the last adapters: not the study's
        "ensemble-60-s0@best-greedy-b2": one}, {
        "mcl-60-s0": ("relaxed", 30.0, 48, None), "mcl-annealed-60-s0": ("annealed", 31.0, 60, None),
        "mle-60-s0": (None, 20.0, 36, None), "mle-r8-60-s0": (None, 10.0, 24, None),
        "mle-r8-60-s1": (None, 12.0, 60, None), "ensemble-60-s0": (None, 22.0, 0, {"mle-r8-60-s0": 10.0,
                                                                                "mle-r8-60-s1": 12.0})})
    written = spoken_budgets.score(out, records)
    assert sorted(f.name for f in written) == sorted(2 * ["annealed-0.97-lr0.001-s0", "ensemble-lr0.001-s0",
                                                          "mle-lr0.001-s0", "relaxed-0.05-lr0.001-s0"])
    mcl = json.loads((records / "spoken-translation" / "60-steps" / "relaxed-0.05-lr0.001-s0" / "results.json")
                     .read_text())
    # every answer a reference: chrF 100; both modes (and two answers) on one message of the two
    assert mcl["test"] == {"greedy": {"oracle": 100.0, "mean": 100.0, "distinct": 1.5, "modes_covered": 1.5}}
    assert (mcl["best_step"], mcl["train_seconds"], mcl["oracle_nll"]) == (48, 30.0, 1.5)
    folder = out / "spoken-translation" / "60-steps"
    ensemble = json.loads((folder / "ensemble-lr0.001-s0" / "results.json").read_text())
    assert (ensemble["members"], ensemble["best_step"], ensemble["train_seconds"]) == (
        ["mle-r8-60-s0", "mle-r8-60-s1"], [24, 60], 22.0)  # each member's best
    mle = json.loads((folder / "mle-lr0.001-s0" / "results.json").read_text())
    assert set(mle["test"]) == {"beam", "diverse_beam", "sample"} and mle["test"]["sample"]["modes_covered"] == 1.5
    for folder in (out, records):  # the study's table reads them where the study's runs are read
        shown = budget_tables.tables(folder)
        assert "spoken-translation (K = 2)" in shown
        assert "| relaxed-0.05 (lr 0.001) | 60 | 1 | 100.0 |" in shown and "| annealed-0.97 (lr 0.001) | 60 |" in shown
        assert "| LoRA-MLE r16 (lr 0.001), beam 2 | 60 | 1 | 100.0 |" in shown
        # as good on best of 2, more modes: MCL beats beam search and the ensemble, not the samples (both modes too)
        assert "| spoken-translation | relaxed-0.05-lr0.001 | 60 | 60 | not within 60 steps | 60 |" in shown
    # the verdicts: English, the transcript, is a mode here; the records read on the recipe's data
    from benchmarks.studies.verdict_agreement import run_verdicts

    verdicts = run_verdicts(records, tmp_path / "no-data", out / "spoken-translation" / "data")
    assert [(v["task"], v["setting"], v["budget"]) for v in verdicts] == [
        ("spoken-translation", "annealed-0.97-lr0.001", 60), ("spoken-translation", "relaxed-0.05-lr0.001", 60)]
    assert verdicts == run_verdicts(out)  # the study's folder: its data where the recipe wrote it
    mcl = verdicts[1]
    assert (mcl["split"], mcl["majority"], mcl["purity"]) == (False, ["en", "fr"], [1.0, 0.5])  # h1: fr, then en
    assert mcl["output_verdict"] == "write the same" and mcl["copy_rate"] is None  # one message of 2; no text prompt
    with pytest.raises(SystemExit, match="no test.jsonl for the spoken-translation runs .* give --spoken_data"):
        run_verdicts(records, tmp_path / "no-data")
    (out / "spoken-translation" / "data" / "test.jsonl").write_text("")
    with pytest.raises(SystemExit, match="not the spoken-translation data the runs of"):
        spoken_budgets.score(out, records)
    with pytest.raises(SystemExit, match="not the spoken-translation data .* --stop_after data"):
        run_verdicts(records, tmp_path / "no-data", out / "spoken-translation" / "data")
