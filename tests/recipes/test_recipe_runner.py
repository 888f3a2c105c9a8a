"""The shared recipe runner (loramcl.recipes): recipe files, stages that run once, training stages that resume, the
decoding grid at equal forward budget and the report tables."""

import json
import os
import re

import pytest

from loramcl.recipes.catalog import RECIPES, command_of, copy_recipe
from loramcl.recipes.files import merged, packaged_recipes, read_recipe, recipe_folder, recipe_ids
from loramcl.recipes.grid import DecodeConfig, System
from loramcl.recipes.report import Column, metrics_table, runs_table
from loramcl.recipes.stages import Stages
from loramcl.training.runs import file_stamp, run_stamp

DECODE = DecodeConfig(max_new_tokens=20, repetition_penalty=1.1, diversity_penalty=0.8)


def test_recipe_files_merge_section_by_section(tmp_path):
    (tmp_path / "common.yaml").write_text("model: ../m\ntraining:\n  steps: 200\n  seed: 0\ndata:\n  train_file: a\n"
                                          "  validation_file: v\n")
    (tmp_path / "run.yaml").write_text("out: o\ntraining:\n  steps: 50\nmcl:\n  r: 4\n")
    values = read_recipe(tmp_path, ["common.yaml", "run.yaml"], {"data": {"train_file": "b"}})
    # paths relative to the file that gives them, as `loramcl train --config` reads them; overrides as given
    assert values == {"model": str(tmp_path.parent / "m"), "out": str(tmp_path / "o"),
                      "training": {"steps": 50, "seed": 0},
                      "data": {"train_file": "b", "validation_file": str(tmp_path / "v")}, "mcl": {"r": 4}}
    assert merged({"a": {"b": 1}}, {"a": 2}) == {"a": 2}
    with pytest.raises(FileNotFoundError,
                       match="holds no missing.yaml: give --recipes a folder with the audio recipe files"):
        recipe_folder(str(tmp_path), "audio/tiny", ["missing.yaml"])
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="list.yaml must hold a mapping"):
        read_recipe(tmp_path, ["list.yaml"])


def test_a_stage_runs_once_per_settings(tmp_path):
    calls = []
    stages = Stages(tmp_path)
    record = tmp_path / "out" / "x.settings.json"
    assert stages.run("step", record, {"a": 1}, calls.append, "first")
    assert not stages.run("step", record, {"a": 1}, calls.append, "again")  # same settings: reused
    assert stages.run("step", record, {"a": 2}, calls.append, "changed")
    assert calls == ["first", "changed"] and set(stages.timings) == {"step"}

    def fails():
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        stages.run("step", record, {"a": 3}, fails)
    assert json.loads(record.read_text())["settings"] == {"a": 2}  # a failed stage leaves no record of success


def test_a_training_stage_is_skipped_when_finished_and_restarts_from_stale_checkpoints(tmp_path):
    out = tmp_path / "run"
    checkpoints = out / "checkpoints"
    (checkpoints / "checkpoint-10").mkdir(parents=True)
    (checkpoints / "settings.json").write_text(json.dumps({"steps": 100}))
    seen = []

    def train(out, settings):  # what finetune.fit leaves behind (argument names as the stage's own)
        seen.append(sorted(p.name for p in checkpoints.glob("checkpoint-*")) if checkpoints.exists() else [])
        seen.append((out / "best").exists())
        out.mkdir(exist_ok=True)
        (out / "run.json").write_text(json.dumps({"settings": settings, "seconds": 1.0}))

    stages = Stages(tmp_path)
    assert stages.train("train", out, {"steps": 100}, train, out=out, settings={"steps": 100})  # resumed
    assert seen == [["checkpoint-10"], False]
    assert not stages.train("train", out, {"steps": 100}, train, out, {"steps": 100})  # finished: skipped
    stamp = run_stamp(out)
    (out / "best").mkdir()  # keep_best's, of the run trained again: it goes with the stale checkpoints (issue 61)
    assert stages.train("train", out, {"steps": 200}, train, out, {"steps": 200})  # other settings: stale ones go
    assert seen[-2:] == [[], False] and run_stamp(out) != stamp


@pytest.mark.parametrize("system, single, expected", [
    (System("mle-beam-b4", "mle", "beam", 4), True, {"num_sequences": 2, "num_beams": 4}),
    (System("mle-dbs-b2", "mle", "diverse_beam", 2), True,
     {"num_sequences": 2, "num_beams": 2, "num_beam_groups": 2, "diversity_penalty": 0.8}),
    (System("mle-dbs-b4-1.0", "mle", "diverse_beam", 4, {"diversity_penalty": 1.0}), True,
     {"num_sequences": 2, "num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0}),
    (System("mle-tta-b4", "mle", "tta", 4), True, {"num_sequences": 2, "num_beams": 2}),
    (System("mle-topp", "mle", "sample", 2, {"top_p": 0.95}), True, {"num_sequences": 2, "top_p": 0.95}),
    (System("mcl-beam-b4", "mcl", "beam", 4), False, {"num_beams": 2}),  # 2 beams x 2 hypotheses = 4
    (System("mcl-greedy-b2", "mcl", "greedy", 2), False, {}),  # 1 x 2 = 2
    # beam 1 per hypothesis through beam search (diverse MCL decoding, λ = 0): the penalty on log-probabilities
    (System("mcl-beam-b2", "mcl", "beam", 2), False, {"strategy": "diverse_beam", "num_beams": 1,
                                                      "diversity_penalty": 0.0}),
    (System("mcl-dbs-b4", "mcl", "diverse_beam", 4), False, {"num_beams": 2, "diversity_penalty": 0.8}),
    (System("mcl-dbs-b2", "mcl", "diverse_beam", 2, {"diversity_penalty": 0.5}), False,
     {"num_beams": 1, "diversity_penalty": 0.5}),
])
def test_systems_decode_at_equal_forward_budget(system, single, expected):
    arguments = system.decoding(2, single, DECODE)
    common = {"strategy": system.strategy, "max_new_tokens": 20, "repetition_penalty": 1.1, "seed": 0}
    assert arguments == common | expected


def test_decoding_compile_reaches_the_systems_it_serves():
    """decoding.compile: true compiles greedy, beam, sampling and tta systems; diverse beam search (beam 1 per
    hypothesis at B = K included) and its own steps decode eagerly, as its refusal of compile says."""
    decode = DecodeConfig(max_new_tokens=20, repetition_penalty=1.1, compile=True)
    assert System("mcl-beam-b4", "mcl", "beam", 4).decoding(2, False, decode)["compile"] is True
    assert System("mle-tta-b4", "mle", "tta", 4).decoding(2, True, decode)["compile"] is True
    assert "compile" not in System("mcl-beam-b2", "mcl", "beam", 2).decoding(2, False, decode)
    assert "compile" not in System("mcl-dbs-b4", "mcl", "diverse_beam", 4).decoding(2, False, decode)
    assert "compile" not in System("mcl-beam-b4", "mcl", "beam", 4).decoding(2, False, DECODE)
    with pytest.raises(ValueError, match="compile must be true or false"):
        DecodeConfig(compile="yes")


@pytest.mark.parametrize("system, single, message", [
    (System("mle-greedy", "mle", "greedy", 2), True, "a single model .* decodes with"),
    (System("mcl-tta", "mcl", "tta", 2), False, "an MCL model decodes with"),
    (System("mcl-dbs-b3", "mcl", "diverse_beam", 3), False, "cannot be split among K=2"),
    (System("mcl-greedy-b4", "mcl", "greedy", 4), False, "its forward budget is K = 2, not 4"),
    (System("mcl-beam-b3", "mcl", "beam", 3), False, "cannot be split among K=2"),
])
def test_impossible_systems_are_refused(system, single, message):
    with pytest.raises(ValueError, match=message):
        system.decoding(2, single, DECODE)
    with pytest.raises(ValueError, match="unknown strategy"):
        System("x", "mle", "nucleus", 2)


def test_a_system_of_run_at_best_decodes_that_runs_best_adapters():
    """Issue 64: '<run>@best' (experiment.yaml's decoded) gives systems of run '<run>' with ``best``, named with the
    '@best', kept apart from the run's last adapters in a quick run, recorded as before when not best."""
    from dataclasses import replace

    from loramcl.recipes.experiment import Experiment
    from loramcl.recipes.grid import equal_budget_systems, one_per_strategy

    best = System("mle@best-beam-b2", "mle@best", "beam", 2)
    assert (best.run, best.best, best.entry) == ("mle", True, "mle@best")
    assert replace(best, name="y").best and best == System("mle@best-beam-b2", "mle", "beam", 2, best=True)
    assert best.to_dict()["best"] is True and "best" not in System("mle-beam-b2", "mle", "beam", 2).to_dict()
    systems = equal_budget_systems({"mle": 1, "mle@best": 1}, 2, [2, 4])
    assert [s.name for s in one_per_strategy(systems)] == ["mle-beam-b2", "mle-diversebeam-b2", "mle@best-beam-b2",
                                                           "mle@best-diversebeam-b2"]
    experiment = Experiment(decoded=["mle", "mle@best"], budgets=[2])
    assert experiment.decoded_runs(["mle", "mcl"]) == ["mle", "mle@best"]
    with pytest.raises(ValueError, match=r"decoded: no run file for \['mlx'\] \(runs: \['mcl', 'mle'\]\)"):
        Experiment(decoded=["mlx@best"], budgets=[2]).decoded_runs(["mle", "mcl"])


def test_report_tables():
    record = {"settings": {"mcl": {"num_hypotheses": 2, "r": 8, "loss": "relaxed", "epsilon": 0.05},
                           "training": {"steps": 200, "batch_size": 16}}, "trainable_parameters": 1840000,
              "seconds": 1219.4}
    row = "| mcl-relaxed | 2 | 8 | relaxed ε=0.05 | 200 x 16 | 1,840,000 | 1219 |"
    assert runs_table({"mcl-relaxed": record})[2] == row
    resumed = runs_table({"mcl-relaxed": record | {"seconds": 74.0, "resumed_from": "checkpoint-400"}})[2]
    assert resumed.endswith("| 1,840,000 | 74 (resumed from checkpoint-400, counted from the resume) |")  # unknown
    whole = runs_table({"mcl-relaxed": record | {"resumed_from": "checkpoint-400", "seconds_before_resume": 1145.4}})
    assert whole[2].endswith("| 1,840,000 | 1219 (resumed from checkpoint-400) |")  # the earlier processes counted
    results = {"mcl": {"system": {"budget": 2}, "metrics": {"chrf": 40.123, "mbleu4": 0.3871}}}
    table = metrics_table(results, [Column("chrf", "oracle chrF", ".2f"), Column("mbleu4", "mBLEU-4"),
                                    Column("spider", "SPIDEr")])
    assert table[0] == "| system | budget | oracle chrF | mBLEU-4 | SPIDEr |"
    assert table[2] == "| mcl | 2 | 40.12 | 0.387 | – |"


def test_run_files_and_the_systems_at_equal_budget(tmp_path):
    from loramcl.recipes.files import run_names
    from loramcl.recipes.grid import equal_budget_systems

    for name in ("common.yaml", "experiment.yaml", "mle.yaml", "mcl.yaml", "notes.txt"):
        (tmp_path / name).write_text("{}\n")
    assert run_names(tmp_path, reserved=("common.yaml", "experiment.yaml")) == ["mcl", "mle"]
    with pytest.raises(FileNotFoundError, match="holds no run file"):
        run_names(tmp_path / "missing")
    systems = equal_budget_systems({"mle": 1, "mcl": 3}, candidates=3, budgets=[3, 6])
    assert [(s.name, s.strategy, s.budget) for s in systems] == [
        ("mle-beam-b3", "beam", 3), ("mle-diversebeam-b3", "diverse_beam", 3), ("mle-beam-b6", "beam", 6),
        ("mle-diversebeam-b6", "diverse_beam", 6), ("mcl-beam-b3", "beam", 3), ("mcl-beam-b6", "beam", 6)]
    # each system's decoding gives the same forward budget: MLE beam 6 returning 3, MCL beam 2 per hypothesis
    assert systems[2].decoding(3, True, DECODE)["num_beams"] == 6
    assert systems[5].decoding(3, False, DECODE)["num_beams"] == 2
    assert systems[4].decoding(3, False, DECODE)["num_beams"] == 1  # beam 1 per hypothesis at B = K
    diverse = equal_budget_systems({"mcl": 3}, 3, [3, 6], mcl_strategies=("beam", "greedy", "diverse_beam"))
    assert [s.name for s in diverse] == ["mcl-beam-b3", "mcl-greedy-b3", "mcl-diversebeam-b3", "mcl-beam-b6",
                                         "mcl-diversebeam-b6"]  # greedy (the paper's protocol) at B = K only
    assert diverse[4].decoding(3, False, DECODE) == {**systems[5].decoding(3, False, DECODE),
                                                     "strategy": "diverse_beam", "diversity_penalty": 0.8}
    with pytest.raises(ValueError, match="mcl_strategies must be among beam, greedy, diverse_beam"):
        equal_budget_systems({"mcl": 3}, 3, [3], mcl_strategies=("sample",))
    with pytest.raises(ValueError, match="run moe2 has K = 2 hypotheses: a system gives 3 candidates"):
        equal_budget_systems({"moe2": 2}, candidates=3, budgets=[3])
    with pytest.raises(ValueError, match="budget 4 is not a multiple of the 3 candidates"):
        equal_budget_systems({"mle": 1}, candidates=3, budgets=[4])


def test_a_run_recorded_before_an_option_existed_is_still_the_same_run(tmp_path):
    from loramcl.mcl.config import MCLConfig
    from loramcl.training.config import DataConfig, TrainConfig
    from loramcl.training.fit import run_settings
    from loramcl.training.runs import finished_run, stale_checkpoint_fields

    (tmp_path / "train.jsonl").write_text('{"prompt": "a", "target": "b"}\n')
    settings = run_settings("m", MCLConfig(num_hypotheses=2, r=4), DataConfig(train_file=str(tmp_path / "train.jsonl")),
                            TrainConfig(steps=5), "float32")
    older = json.loads(json.dumps(settings))
    del older["mcl"]["use_rslora"], older["training"]["keep_checkpoints"]  # options added since, at their defaults
    (tmp_path / "run" / "checkpoints" / "checkpoint-5").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "settings.json").write_text(json.dumps(older))
    (tmp_path / "run" / "run.json").write_text(json.dumps({"settings": older}))
    assert finished_run(tmp_path / "run", settings) and stale_checkpoint_fields(tmp_path / "run", settings) == []
    chunks = json.loads(json.dumps(settings))
    chunks["mcl"]["logits_chunk_size"] = None  # how the logits are computed, not what the adapters become
    chunks["training"]["compile"] = True  # likewise: compiled, the same losses to float rounding
    assert finished_run(tmp_path / "run", chunks) and stale_checkpoint_fields(tmp_path / "run", chunks) == []
    changed = json.loads(json.dumps(settings))
    changed["mcl"]["r"], changed["training"]["steps"] = 8, 6
    assert not finished_run(tmp_path / "run", changed)
    assert stale_checkpoint_fields(tmp_path / "run", changed) == ["mcl", "training"]


def test_a_test_set_rewritten_under_the_same_name_has_another_stamp(tmp_path):
    test = tmp_path / "test.jsonl"
    test.write_text('{"prompt": "a"}\n')
    stamp = file_stamp(test)
    assert file_stamp(test) == stamp
    test.write_text('{"prompt": "b"}\n')  # e.g. the data stage rerun with other settings
    assert file_stamp(test) != stamp


def test_packaged_recipes_are_found_by_name_or_folder(tmp_path, monkeypatch):
    """--recipes takes a folder or a packaged recipe's name within the task (`alma`) or its id (`translation/alma`);
    without it, the task's default; a name of another task or of nothing is refused, listing the task's recipes."""
    monkeypatch.chdir(tmp_path)
    packaged = packaged_recipes()
    files = ["experiment.yaml", "common.yaml"]
    assert recipe_folder(None, "translation/smollm2", files) == packaged / "translation" / "smollm2"
    assert recipe_folder("alma", "translation/smollm2", files) == packaged / "translation" / "alma"
    assert recipe_folder("translation/alma", "translation/smollm2", files) == packaged / "translation" / "alma"
    assert recipe_folder(None, "bilingual", ["common.yaml"]) == packaged / "bilingual"
    (tmp_path / "alma").mkdir()  # a folder of that name here wins, as any path given
    with pytest.raises(FileNotFoundError, match="^alma holds no experiment.yaml, common.yaml"):
        recipe_folder("alma", "translation/smollm2", files)
    with pytest.raises(FileNotFoundError, match=r"--recipes tiny: no such folder, nor a packaged translation recipe "
                                                r"\(packaged: alma, smollm2; `loramcl recipes` lists every recipe\)"):
        recipe_folder("tiny", "translation/smollm2", files)


def test_the_recipe_table_lists_every_packaged_recipe_and_its_model():
    """`loramcl recipes` shows each packaged folder with its model and scale; a paper-scale recipe's model is the
    folder its common.yaml names, and every task has a command."""
    import yaml

    from loramcl.cli import commands

    assert sorted(RECIPES) == recipe_ids()
    for recipe_id, (model, scale) in RECIPES.items():
        assert scale in ("CPU", "paper") and command_of(recipe_id) in commands()
        common = yaml.safe_load((packaged_recipes() / recipe_id / "common.yaml").read_text())
        if scale == "paper":
            assert common["model"].rsplit("/", 1)[1] in model, recipe_id


@pytest.mark.parametrize("recipe_id", sorted(RECIPES))
def test_a_copied_recipe_names_the_places_the_packaged_one_does(tmp_path, monkeypatch, capsys, recipe_id):
    """`loramcl recipes copy` rewrites each `./` path relative to the copy: read from anywhere, the copy's files give
    the values the packaged files give when read from the folder the copy was made in."""
    import yaml

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir(), elsewhere.mkdir()
    monkeypatch.chdir(project)
    name = recipe_id.split("/")[-1]
    shared = sum(other.split("/")[-1] == name for other in RECIPES) > 1  # `tiny`: audio and image captioning
    copy = copy_recipe(recipe_id if shared else name, "mine")  # a name no other task uses is enough
    assert capsys.readouterr().out.endswith(f"run it: loramcl {command_of(recipe_id)} --recipes mine\n")
    source = packaged_recipes() / recipe_id
    names = sorted(p.name for p in source.glob("*.yaml"))
    assert sorted(p.name for p in copy.iterdir()) == names
    packaged = {name: read_recipe(source, [name]) for name in names}
    relative = {name: _relative_values(yaml.safe_load((source / name).read_text()), project) for name in names}
    monkeypatch.chdir(elsewhere)
    for name in names:
        if name != "experiment.yaml":  # the run settings, as `loramcl train` and the task commands read them
            assert read_recipe(copy, [name]) == packaged[name], name
        assert _relative_values(yaml.safe_load((copy / name).read_text()), copy) == relative[name], name
        assert not re.search(r"^\s*[\w.-]+:\s+\./", (copy / name).read_text(), re.M), name  # none for the cwd


def _relative_values(values, base):
    """Every string of a recipe file's values that is a relative path, made absolute against ``base``."""
    if isinstance(values, dict):
        return {key: _relative_values(value, base) for key, value in values.items()}
    if isinstance(values, list):
        return [_relative_values(value, base) for value in values]
    if isinstance(values, str) and values.startswith(("./", "../")):
        return os.path.normpath(base / values)
    return values


def test_copy_refuses_an_unknown_recipe_and_a_folder_in_use(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"no packaged recipe 'audio_captioning/tyni' \(did you mean "
                                         r"audio_captioning/tiny\?\); the recipes are audio_captioning/audiocaps"):
        copy_recipe("audio_captioning/tyni", "mine")
    with pytest.raises(ValueError, match="recipe 'tiny' is ambiguous: give one of audio_captioning/tiny, "
                                         "image_captioning/tiny"):
        copy_recipe("tiny", "mine")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="used exists and is not empty: give a new or empty folder for the copy "
                                              "of bilingual"):
        copy_recipe("bilingual", "used")
    (tmp_path / "empty").mkdir()
    assert copy_recipe("bilingual", "empty") == tmp_path / "empty"


def _task(root, experiment, scores: bool, quick: bool = False):
    from loramcl.recipes import runner

    class Toy(runner.Task):
        experiment_type, default_recipes, scores_references = type(experiment), "none", scores
        systems = prepare_data = train = decode = report = None

    return Toy(None, experiment, Stages(root), quick, None, "cpu")


def test_the_nll_table_decides_which_runs_are_trained_and_scored(tmp_path):
    """A task that scores its references trains its decoded runs, then those of the NLL table (a quick run: the
    decoded ones only), and scores the table's runs in its order (default: every trained run); another task trains
    every run, scores none and refuses an NLL table, or a recipe that decodes no run, before any work."""
    from loramcl.recipes.experiment import Experiment
    from loramcl.recipes.runner import run_recipe

    systems = [System("a-beam-b2", "a", "beam", 2)]
    table = Experiment(nll_table=["b", "a"])
    assert _task(tmp_path, table, True).trained_runs(["a", "b", "c"], systems) == ["a", "b"]
    assert _task(tmp_path, table, True, quick=True).trained_runs(["a", "b", "c"], systems) == ["a"]
    assert _task(tmp_path, table, True).scored_runs(["a", "b"], systems) == ["b", "a"]
    assert _task(tmp_path, table, True, quick=True).scored_runs(["a"], systems) == ["a"]
    assert _task(tmp_path, Experiment(), True).trained_runs(["a", "b"], systems) == ["a", "b"]
    assert _task(tmp_path, Experiment(), True).scored_runs(["a", "b"], systems) == ["a", "b"]
    assert _task(tmp_path, table, False).trained_runs(["a", "b", "c"], systems) == ["a", "b", "c"]
    assert _task(tmp_path, table, False).scored_runs(["a", "b"], systems) == []
    with pytest.raises(ValueError, match=r"nll_table: no run file for \['x'\] \(runs: \['a'\]\)"):
        Experiment(nll_table=["x"]).table_runs(["a"])
    with pytest.raises(ValueError, match="nll_table must be a list of run names"):
        Experiment(nll_table="a")
    (tmp_path / "experiment.yaml").write_text("nll_table: [a]\n")
    (tmp_path / "common.yaml").write_text(f"model: {tmp_path}\n")
    (tmp_path / "a.yaml").write_text("{}\n")
    toy = type(_task(tmp_path, Experiment(), False))  # its hooks are never reached
    with pytest.raises(ValueError, match="nll_table: Toy scores no test reference"):
        run_recipe(toy, out=str(tmp_path / "out"), recipes=str(tmp_path))
    (tmp_path / "experiment.yaml").write_text("decoded: []\n")  # nothing decoded and nothing scored: refused

    class Silent(toy):
        def systems(self, values, chosen):
            return []

    with pytest.raises(ValueError, match=r"decoded: \[\] decodes no run and Silent scores no test reference"):
        run_recipe(Silent, out=str(tmp_path / "out"), recipes=str(tmp_path))


TASK_COMMANDS = ("bilingual", "translation", "audio-captioning", "image-captioning", "spoken-translation")


@pytest.mark.parametrize("name", TASK_COMMANDS)
def test_every_task_command_is_generated_with_the_shared_options_and_their_help(name, capsys):
    """Each task command has the shared options (device included) with their defaults, and `--help` shows each
    option's help as written once in recipes.command (or the task's own text)."""
    import inspect

    from loramcl.cli import commands, main
    from loramcl.recipes.command import OPTIONS

    command = commands()[name]
    parameters = inspect.signature(command).parameters
    assert {key: p.default for key, p in parameters.items() if key in OPTIONS} == {
        key: option.default for key, option in OPTIONS.items()}
    with pytest.raises(SystemExit) as stopped:
        main([name, "--help"])
    assert stopped.value.code == 0
    shown = "".join(capsys.readouterr().out.split())
    given = commands()[name].__doc__.split("Args:")[1]
    for key in parameters:  # every option, with the words of its help as the docstring gives them
        documented = given.split(f"    {key}: ")[1].split("\n    ")[0]
        assert f"--{key}" in shown and "".join(documented.split()) in shown, key
    assert "".join(OPTIONS["threads"].help.split()) in shown and "".join(OPTIONS["device"].help.split()) in shown


def test_a_generated_command_binds_its_arguments_as_a_function_does(monkeypatch):
    """Positional arguments in the command's order (bilingual's own order kept), a task's own option passed on as an
    experiment setting, an unknown argument refused as Python refuses it."""
    from loramcl.recipes.bilingual.reproduce import Bilingual, bilingual

    called = {}
    monkeypatch.setattr("loramcl.recipes.runner.run_recipe",
                        lambda task, **arguments: called.update(task=task, **arguments))
    bilingual("o", True, [2], locale_dir="/l")
    assert called == {"task": Bilingual, "out": "o", "quick": True, "budgets": [2], "recipes": None,
                      "stop_after": None, "runs": None, "threads": None, "device": "cpu", "locale_dir": "/l"}
    with pytest.raises(TypeError, match="unexpected keyword argument 'depth'"):
        bilingual(depth=3)


def test_a_task_command_with_help_for_no_option_or_a_partial_order_is_refused():
    from loramcl.recipes.command import task_command
    from loramcl.recipes.runner import Task

    class Help(Task):
        """A task."""
        options = {"outt": "a misspelt option"}

    class Order(Task):
        """A task."""
        option_order = ("out", "quick")

    with pytest.raises(TypeError, match=r"Help.options: help for no option \['outt'\]"):
        task_command(Help, "help")
    with pytest.raises(TypeError, match="Order.option_order must name each option once"):
        task_command(Order, "order")


@pytest.mark.parametrize("name", TASK_COMMANDS)
def test_a_bad_device_is_refused_before_any_work(name, tmp_path):
    from loramcl.cli import commands
    from loramcl.utils.validate import OptionError

    with pytest.raises(OptionError, match="device 'cuda:x' is not a device torch knows"):
        commands()[name](out=str(tmp_path / "out"), device="cuda:x")
    assert not (tmp_path / "out").exists()
