"""A recipe file's relative paths are read relative to the file's folder (docs/guide/cli.md, "Recipe files"): a path
that does not exist says so, naming what the file wrote and the folder it was read from (issue 61: the GPU check
wrote cwd-relative paths into a recipe copy, and the error named only the path read)."""

from __future__ import annotations

import contextlib
import io
import re

import yaml

from loramcl.cli import main
from loramcl.recipes.files import packaged_recipes

RULE = "relative paths in a recipe file are read relative to the recipe file's folder, here {}"


def _error(argv) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as stop:
            assert stop.code not in (0, None)
    return err.getvalue().strip().splitlines()[-1]


def test_a_task_commands_missing_model_names_the_recipe_files_rule(tmp_path, monkeypatch):
    """The model exists relative to the current folder, not to the recipe copy that names it."""
    import shutil

    recipe = tmp_path / "recipe"
    shutil.copytree(packaged_recipes() / "audio_captioning" / "tiny", recipe)
    experiment = yaml.safe_load((recipe / "experiment.yaml").read_text())
    experiment.pop("packaged_model")
    (recipe / "experiment.yaml").write_text(yaml.safe_dump(experiment))
    common = yaml.safe_load((recipe / "common.yaml").read_text()) | {"model": "runs/model"}
    (recipe / "common.yaml").write_text(yaml.safe_dump(common))
    (tmp_path / "runs" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    line = _error(["audio-captioning", "--recipes", "recipe", "--out", "out", "--stop_after", "data"])
    assert line == (f"loramcl audio-captioning: error: model folder {recipe}/runs/model does not exist (a model is a "
                    "local transformers folder; nothing is downloaded); a recipe file gives it as `runs/model` ("
                    + RULE.format(recipe) + ")")


def test_train_configs_missing_files_name_the_recipe_files_rule(tmp_path, monkeypatch):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "run.yaml").write_text("model: models/m\nout: runs/r\ndata:\n  train_file: train.jsonl\n")
    monkeypatch.chdir(tmp_path)
    line = _error(["train", "--config", "recipes/run.yaml"])
    assert line.endswith("; a recipe file gives it as `models/m` (" + RULE.format(tmp_path / "recipes") + ")"), line
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    line = _error(["train", "--config", "recipes/run.yaml", "--model", "model"])
    assert re.fullmatch(r".*: error: training file \S+/recipes/train\.jsonl does not exist; a recipe file gives it as "
                        r"`train\.jsonl` \(" + re.escape(RULE.format(tmp_path / "recipes")) + r"\)", line), line


def test_paths_given_on_the_command_line_keep_their_message(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = _error(["train", "--model", "models/m", "--out", "runs/r", "--data.train_file", "train.jsonl"])
    assert line.endswith(f"model folder {tmp_path}/models/m does not exist (a model is a local transformers folder; "
                         "nothing is downloaded)"), line
