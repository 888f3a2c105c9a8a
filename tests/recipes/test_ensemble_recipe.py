"""The recipes' ensemble run kind: a run file naming member runs; the runner trains the members, assembles them into
one K-hypothesis model that the later stages read as a LoRA-MCL run (its NLL table row: the oracle over the
members), and refuses members that cannot be one model before any work. And an NLL table row, or decoded systems, of
a run's best-validation adapters ('<run>@best', training.keep_best)."""

import json

import pytest
import torch
from tiny_models import build_model, word_tokenizer

from loramcl.recipes.ensemble import ensembles, with_members
from loramcl.recipes.runner import run_recipe
from loramcl.recipes.text import TextExperiment, TextTask

MLE = "mcl:\n  num_hypotheses: 1\n  r: 4\n  alpha: 8\n  target_modules: [q_proj, v_proj]\n"


class Toy(TextTask):
    """A text task on a tiny Llama: a few word pairs; its report is the NLL table."""

    experiment_type = TextExperiment
    default_recipes = "bilingual"

    def prepare_data(self, model, values):
        self.data.mkdir(parents=True, exist_ok=True)
        rows = [{"prompt": f"w{5 + i % 7} w{20 + i % 5}", "target": f"w{40 + i % 3}"} for i in range(12)]
        for name in ("train", "validation"):
            (self.data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        test = [{"id": str(i), "prompt": f"w{5 + i} w{21 + i}", "references": [f"w{40 + i}", f"w{41 + i} w60"]}
                for i in range(3)]
        self.test.write_text("".join(json.dumps(r) + "\n" for r in test))

    def report(self, systems, runs):
        from loramcl.recipes.report import runs_nll
        from loramcl.utils.files import read_jsonl

        test = list(read_jsonl(self.test, "references").values())
        references = [r["references"] for r in test]
        groups = [["first", "second"] for _ in test]
        likelihood = runs_nll(self.root, self.scored_runs(runs, systems), [r["id"] for r in test], references, groups)
        (self.root / "report.md").write_text("toy\n")
        return {"likelihood": likelihood}


@pytest.fixture
def recipe(tmp_path):
    torch.manual_seed(0)
    build_model("llama").save_pretrained(tmp_path / "base")
    word_tokenizer().save_pretrained(tmp_path / "base")
    folder = tmp_path / "recipe"
    folder.mkdir()
    (folder / "experiment.yaml").write_text("decoded: [ensemble]\nnll_table: [m0, m1, ensemble]\nbudgets: [2]\n"
                                            "mcl_decodings: [greedy]\ndecoding:\n  max_new_tokens: 3\n")
    (folder / "common.yaml").write_text(
        f"model: {tmp_path / 'base'}\ndata:\n  train_file: x.jsonl\n  validation_file: v.jsonl\ntraining:\n"
        "  steps: 2\n  batch_size: 4\n  learning_rate: 1.0e-2\n  eval_every: 0\n  save_every: 0\n  warmup_steps: 0\n"
        "  logging_steps: 1\n")
    (folder / "m0.yaml").write_text(MLE)
    (folder / "m1.yaml").write_text(MLE + "training:\n  seed: 1\n")
    (folder / "unnamed.yaml").write_text(MLE + "training:\n  seed: 2\n")  # in no table: never trained
    (folder / "ensemble.yaml").write_text("ensemble: [m0, m1]\n")
    return tmp_path, folder


def test_the_runner_trains_the_members_and_scores_their_ensemble_as_one_model(recipe):
    tmp_path, folder = recipe
    out = tmp_path / "out"
    report = run_recipe(Toy, out=str(out), recipes=str(folder), threads=1)
    assert not (out / "unnamed").exists()
    record = json.loads((out / "ensemble" / "run.json").read_text())
    assert record["settings"]["ensemble"] == ["m0", "m1"] and record["settings"]["mcl"]["num_hypotheses"] == 2
    members = [json.loads((out / m / "run.json").read_text()) for m in ("m0", "m1")]
    assert record["trainable_parameters"] == 2 * members[0]["trainable_parameters"]
    # hypothesis k of the ensemble scores every reference as member k does alone: its row is the oracle over them
    scored = {run: [json.loads(line) for line in (out / "nll" / f"{run}.jsonl").read_text().splitlines()]
              for run in ("m0", "m1", "ensemble")}
    for i, row in enumerate(scored["ensemble"]):
        for j, per_hypothesis in enumerate(row["nll"]):
            alone = [scored[m][i]["nll"][j][0] for m in ("m0", "m1")]
            assert per_hypothesis == pytest.approx(alone, abs=1e-5)
    likelihood = report["likelihood"]
    assert list(likelihood) == ["m0", "m1", "ensemble"]
    assert likelihood["ensemble"]["oracle_nll"] <= min(likelihood[m]["oracle_nll"] for m in ("m0", "m1"))
    candidates = json.loads((out / "predictions" / "ensemble-greedy-b2.jsonl").read_text().splitlines()[0])
    assert len(candidates["candidates"]) == 2  # one candidate per member
    again = run_recipe(Toy, out=str(out), recipes=str(folder), threads=1)  # nothing trained or assembled again
    assert not {name for name in again["timing_s"] if name.startswith(("train ", "assemble "))}


def test_members_that_cannot_be_one_model_are_refused_before_any_work(recipe):
    tmp_path, folder = recipe
    values = {"a": {"mcl": {"num_hypotheses": 1, "r": 4}, "model": "m"},
              "b": {"mcl": {"num_hypotheses": 1, "r": 8}, "model": "m"}, "e": {"ensemble": ["a", "b"]}}
    with pytest.raises(ValueError, match="run e: member b's mcl: block differs from a's beyond num_hypotheses"):
        ensembles(values)
    for members, message in ((["a"], "two or more distinct run names"), (["a", "x"], r"names \['x'\], which have no"),
                             (["a", "e"], r"its members \['e'\] are ensembles")):
        with pytest.raises(ValueError, match=message):
            ensembles(values | {"e": {"ensemble": members}})
    assert with_members(["a", "e", "c"], {"e": ["b", "a"]}) == ["a", "b", "e", "c"]
    (folder / "ensemble.yaml").write_text("ensemble: [m0, m1]\n")
    (folder / "m1.yaml").write_text(MLE.replace("alpha: 8", "alpha: 16"))
    with pytest.raises(ValueError, match="member m1's mcl: block differs from m0's"):
        run_recipe(Toy, out=str(tmp_path / "out"), recipes=str(folder), threads=1)
    assert not (tmp_path / "out" / "data").exists()


def test_an_nll_table_row_scores_a_runs_best_validation_adapters(recipe, monkeypatch):
    from loramcl.training.reference_nll import nll
    from loramcl.training.trainer import MCLTrainer

    tmp_path, folder = recipe
    metrics = MCLTrainer._hypothesis_metrics  # the validation loss lowest at step 1 of 2: best != last
    monkeypatch.setattr(MCLTrainer, "_hypothesis_metrics",
                        lambda self: metrics(self) | {"eval_loss": {1: 1.0, 2: 2.0}[self.state.global_step]})
    (folder / "experiment.yaml").write_text("decoded: []\nnll_table: [m0, m0@best]\nbudgets: [2]\n")
    (folder / "m0.yaml").write_text(MLE + "training:\n  keep_best: true\n  eval_every: 1\n")
    out = tmp_path / "out"
    report = run_recipe(Toy, out=str(out), recipes=str(folder), threads=1)
    assert list(report["likelihood"]) == ["m0", "m0@best"]
    assert json.loads((out / "m0" / "best" / "best.json").read_text())["step"] == 1
    nll(model=str(tmp_path / "base"), adapters=str(out / "m0" / "best"), input=str(out / "data" / "test.jsonl"),
        out=str(tmp_path / "best.jsonl"), threads=1)
    read = {name: [json.loads(line)["nll"] for line in path.read_text().splitlines()]
            for name, path in (("best", tmp_path / "best.jsonl"), ("row", out / "nll" / "m0@best.jsonl"),
                               ("last", out / "nll" / "m0.jsonl"))}
    assert read["row"] == read["best"] != read["last"]
    (folder / "experiment.yaml").write_text("decoded: []\nnll_table: [m1@best]\nbudgets: [2]\n")
    with pytest.raises(ValueError, match=r"nll_table: m1@best scores the best-validation adapters of m1, but m1 "
                                         "keeps none: set `training: {keep_best: true}`"):
        run_recipe(Toy, out=str(out), recipes=str(folder), threads=1)


def test_an_ensembles_best_row_assembles_its_members_best_validation_adapters(recipe, monkeypatch):
    from loramcl.training.trainer import MCLTrainer

    tmp_path, folder = recipe
    metrics = MCLTrainer._hypothesis_metrics  # each member's validation loss lowest at step 1 of 2: best != last
    monkeypatch.setattr(MCLTrainer, "_hypothesis_metrics",
                        lambda self: metrics(self) | {"eval_loss": {1: 1.0, 2: 2.0}[self.state.global_step]})
    (folder / "experiment.yaml").write_text("decoded: []\nnll_table: [m0@best, m1@best, ensemble, ensemble@best]\n"
                                            "budgets: [2]\n")
    (folder / "m1.yaml").write_text(MLE + "training:\n  seed: 1\n")
    with pytest.raises(ValueError, match=r"nll_table: m0@best scores the best-validation adapters of m0, but m0 keeps"):
        run_recipe(Toy, out=str(tmp_path / "out"), recipes=str(folder), threads=1)
    (folder / "experiment.yaml").write_text("decoded: []\nnll_table: [ensemble@best]\nbudgets: [2]\n")
    (folder / "m0.yaml").write_text(MLE + "training:\n  keep_best: true\n  eval_every: 1\n")
    with pytest.raises(ValueError, match=r"ensemble@best scores the best-validation adapters of ensemble, but m1 "
                                         r"keeps none: set `training: \{keep_best: true\}` in its run file \(an "
                                         "ensemble's: in its members'\\)"):
        run_recipe(Toy, out=str(tmp_path / "out"), recipes=str(folder), threads=1)
    assert not (tmp_path / "out" / "data").exists()
    (folder / "experiment.yaml").write_text("decoded: []\nnll_table: [m0@best, m1@best, ensemble, ensemble@best]\n"
                                            "budgets: [2]\n")
    (folder / "m1.yaml").write_text(MLE + "training:\n  seed: 1\n  keep_best: true\n  eval_every: 1\n")
    out = tmp_path / "out"
    report = run_recipe(Toy, out=str(out), recipes=str(folder), threads=1)
    assert list(report["likelihood"]) == ["m0@best", "m1@best", "ensemble", "ensemble@best"]
    record = json.loads((out / "ensemble" / "best" / "best.json").read_text())
    assert record == {"members": {m: json.loads((out / m / "best" / "best.json").read_text()) for m in ("m0", "m1")}}
    assert all(record["members"][m]["step"] == 1 and record["members"][m]["eval_loss"] == 1.0 for m in ("m0", "m1"))
    scored = {run: [json.loads(line)["nll"] for line in (out / "nll" / f"{run}.jsonl").read_text().splitlines()]
              for run in ("m0@best", "m1@best", "ensemble", "ensemble@best")}
    for i, row in enumerate(scored["ensemble@best"]):  # hypothesis k: member k's best adapters alone
        for j, per_hypothesis in enumerate(row):
            assert per_hypothesis == pytest.approx([scored[m][i][j][0] for m in ("m0@best", "m1@best")], abs=1e-5)
    assert scored["ensemble@best"] != scored["ensemble"]  # the last adapters are another model
    from loramcl.recipes.ensemble import assemble  # a member resumed from a checkpoint without its earlier seconds:

    m1 = json.loads((out / "m1" / "run.json").read_text())  # the ensemble's seconds leave them out, and say so
    (out / "m1" / "run.json").write_text(json.dumps(m1 | {"resumed_from": "checkpoint-1"}))
    assemble(out, "again", json.loads((out / "ensemble" / "run.json").read_text())["settings"], ["m0", "m1"])
    assert json.loads((out / "again" / "run.json").read_text())["seconds_counted_from_resume"] == ["m1"]
    assert "seconds_counted_from_resume" not in json.loads((out / "ensemble" / "run.json").read_text())


def test_a_damaged_member_best_or_best_row_is_refused_naming_the_folder(recipe, monkeypatch):
    """Issue 61: a member's best.json cut short or edited is refused when the ensemble is assembled again, and a run's
    best holding another run's adapters is refused before its '@best' row is scored (or its scores reused)."""
    import shutil

    from loramcl.training.trainer import MCLTrainer

    tmp_path, folder = recipe
    metrics = MCLTrainer._hypothesis_metrics
    monkeypatch.setattr(MCLTrainer, "_hypothesis_metrics",
                        lambda self: metrics(self) | {"eval_loss": {1: 1.0, 2: 2.0}[self.state.global_step]})
    (folder / "experiment.yaml").write_text("decoded: []\nnll_table: [m0@best, ensemble@best]\nbudgets: [2]\n")
    (folder / "m0.yaml").write_text(MLE + "training:\n  keep_best: true\n  eval_every: 1\n")
    (folder / "m1.yaml").write_text(MLE + "training:\n  seed: 1\n  keep_best: true\n  eval_every: 1\n")
    out = tmp_path / "out"
    run_recipe(Toy, out=str(out), recipes=str(folder), threads=1)
    record = out / "m1" / "best" / "best.json"
    kept = record.read_text()
    for damage, message in ((kept[:10], r"m1/best/best.json is not valid JSON \(Expecting .*\): restore it from a "
                             "copy, or delete it and train the run again with keep_best"),
                            (json.dumps({"step": 999, "eval_loss": -5}), r"m1/best/best.json records step 999, past "
                             "the 2 steps of this run: restore it from a copy")):
        record.write_text(damage)
        (out / "ensemble" / "ensemble.json").unlink(missing_ok=True)  # assembled again
        with pytest.raises(ValueError, match=message):
            run_recipe(Toy, out=str(out), recipes=str(folder), threads=1, stop_after="train")
        assert record.read_text() == damage
        assert json.loads((out / "ensemble" / "best" / "best.json").read_text())["members"]["m1"] == json.loads(kept)
    record.write_text(kept)
    shutil.copy(out / "m1" / "best" / "mcl_adapters.safetensors", out / "m0" / "best" / "mcl_adapters.safetensors")
    with pytest.raises(ValueError, match=r"m0/best/mcl_adapters.safetensors is not the adapters best.json records "
                                         r"\(SHA-256 [0-9a-f]{12}..., recorded [0-9a-f]{64}\): they were replaced or "
                                         "damaged: restore it from a copy"):
        run_recipe(Toy, out=str(out), recipes=str(folder), threads=1)


def test_decoded_best_systems_decode_the_best_adapters_of_a_run_and_of_an_ensemble(recipe, monkeypatch):
    """Issue 64: `decoded: [<run>@best]` decodes root/<run>/best (an ensemble's: its members' best, assembled) in
    systems named '<run>@best-...', as `loramcl generate` decodes that folder, the stage's record holding the best's
    stamp; a run that keeps no best is refused before any work, a best folder gone when it is read."""
    import shutil

    from loramcl.decoding.predictions import generate
    from loramcl.recipes.grid import DecodeConfig, System
    from loramcl.training.runs import file_stamp
    from loramcl.training.trainer import MCLTrainer

    tmp_path, folder = recipe
    metrics = MCLTrainer._hypothesis_metrics  # the validation loss lowest at step 1 of 2: best != last
    monkeypatch.setattr(MCLTrainer, "_hypothesis_metrics",
                        lambda self: metrics(self) | {"eval_loss": {1: 1.0, 2: 2.0}[self.state.global_step]})
    (folder / "experiment.yaml").write_text("decoded: [m0, m0@best, ensemble@best]\nnll_table: [m0]\nbudgets: [2]\n"
                                            "decoding:\n  max_new_tokens: 3\n")
    (folder / "m0.yaml").write_text(MLE + "training:\n  keep_best: true\n  eval_every: 1\n")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"decoded: ensemble@best decodes the best-validation adapters of ensemble, "
                                         r"but m1 keeps none: set `training: \{keep_best: true\}` in its run file"):
        run_recipe(Toy, out=str(out), recipes=str(folder), threads=1, quick=True)
    assert not (out / "data").exists()  # before any work
    (folder / "m1.yaml").write_text(MLE + "training:\n  seed: 1\n  keep_best: true\n  eval_every: 1\n")
    report = run_recipe(Toy, out=str(out), recipes=str(folder), threads=1, quick=True)
    decoded = {name.removeprefix("generate ") for name in report["timing_s"] if name.startswith("generate ")}
    assert decoded == {"m0-beam-b2", "m0-diversebeam-b2", "m0@best-beam-b2", "m0@best-diversebeam-b2",
                       "ensemble@best-beam-b2", "ensemble@best-greedy-b2"}
    assert json.loads((out / "m0" / "best" / "best.json").read_text())["step"] == 1

    def lines(path):
        return [json.loads(line) for line in path.read_text().splitlines()]

    for system, adapters, single in ((System("m0@best-beam-b2", "m0@best", "beam", 2), out / "m0" / "best" / "peft",
                                      True),
                                     (System("ensemble@best-greedy-b2", "ensemble@best", "greedy", 2),
                                      out / "ensemble" / "best", False)):
        arguments = system.decoding(2, single, DecodeConfig(max_new_tokens=3))
        direct = tmp_path / f"{system.name}.jsonl"  # `loramcl generate --adapters OUT/<run>/best` with its arguments
        generate(model=str(tmp_path / "base"), input=str(out / "data" / "test.jsonl"), out=str(direct),
                 adapters=str(adapters), threads=1, **arguments)
        assert lines(out / "predictions" / f"{system.name}.jsonl") == lines(direct)
    assert lines(out / "predictions" / "m0@best-beam-b2.jsonl") != lines(out / "predictions" / "m0-beam-b2.jsonl")
    record = json.loads((out / "predictions" / "m0@best-beam-b2.settings.json").read_text())["settings"]
    assert record["best"] == file_stamp(out / "m0" / "best" / "best.json")  # a changed best is decoded again
    assert "best" not in json.loads((out / "predictions" / "m0-beam-b2.settings.json").read_text())["settings"]
    again = run_recipe(Toy, out=str(out), recipes=str(folder), threads=1, quick=True)
    assert not {name for name in again["timing_s"] if name.startswith(("train ", "assemble ", "generate "))}
    shutil.rmtree(out / "m0" / "best")
    with pytest.raises(FileNotFoundError, match=r"m0/best does not exist, and decoded's m0@best decodes it: restore "
                                                r"it from a copy, or delete .*m0 to train the run again"):
        run_recipe(Toy, out=str(out), recipes=str(folder), threads=1, quick=True)
