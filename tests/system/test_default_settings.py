"""The defaults a new user gets: the first `loramcl train` of docs/guide/cli.md specialises (issue 35.2)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from benchmarks.studies.default_settings import ambiguous_task
from loramcl import MCLConfig
from loramcl.cli import main


DEFAULT_RUNS = ("spoken_translation/mcl-relaxed.yaml",)  # `loramcl train`'s loss and tie rule in a recipe


def _train(base: Path, train_file: Path, out: Path, *options: str) -> tuple[list[list[float]], list[float]]:
    """docs/guide/cli.md's first `loramcl train`, 40 steps: (win_rate_h{k} of every training log, |B| of each
    hypothesis)."""
    main(["train", "--model", str(base), "--out", str(out), "--data.train_file", str(train_file),
          "--mcl.num_hypotheses", "3", "--mcl.target_modules", "[q_proj, v_proj]", "--training.steps", "40", *options])
    logs = [entry for entry in json.loads((out / "train_log.json").read_text()) if "loss" in entry]
    adapters = load_file(out / "mcl_adapters.safetensors")
    norms = [sum(tensor[k].abs().sum().item() for name, tensor in adapters.items() if name.endswith("lora_B"))
             for k in range(3)]
    return [[log[f"win_rate_h{k}"] for k in range(3)] for log in logs], norms


def test_the_first_train_command_of_the_docs_trains_every_hypothesis(tmp_path):
    """The issue's run: a tiny random model, 200 ambiguous prompts (three target languages, never indicated), K = 3.
    The paper's rule gave every tie of the first step (B = 0: all of them) to hypothesis 0, which then won every
    example of every log, and h1, h2 stayed the untrained base model. With random ties every hypothesis wins a share
    at every log and trains (benchmarks/studies/default_settings.py measures it over 10 bases, docs/guide/scores.md);
    with the command's default loss since issue 53 (relaxed WTA, epsilon auto) too."""
    assert MCLConfig().tie_break == "random" and MCLConfig().loss == "wta"
    base, train_file, _ = ambiguous_task(tmp_path, pretrain_steps=0)
    win_rates, norms = _train(base, train_file, tmp_path / "wta", "--mcl.loss", "wta")
    assert len(win_rates) == 4 and all(min(log) > 0.2 for log in win_rates), win_rates
    assert min(norms) > 0
    paper, paper_norms = _train(base, train_file, tmp_path / "paper", "--mcl.tie_break", "lowest", "--mcl.loss", "wta")
    assert paper == [[1.0, 0.0, 0.0]] * 4  # the collapse of the issue, on the same data and seed
    assert paper_norms[0] > 0 and paper_norms[1:] == [0.0, 0.0]  # h1, h2: never a gradient, still B = 0
    default, default_norms = _train(base, train_file, tmp_path / "default")
    assert len(default) == 4 and all(min(log) > 0 for log in default) and min(default_norms) > 0, default
    run = json.loads((tmp_path / "default" / "run.json").read_text())
    assert run["settings"]["mcl"]["tie_break"] == "random"
    assert (run["settings"]["mcl"]["loss"], run["settings"]["mcl"]["epsilon"]) == ("relaxed", "auto")  # issue 53


def test_the_packaged_recipes_keep_the_papers_tie_break():
    """Every MCL run of a recipe names the paper's rule, so its numbers (and its recorded settings, which decide
    whether a finished run is reused) are those of the runs made before the default changed; but the runs of
    `loramcl train`'s default loss (``DEFAULT_RUNS``), which take its tie rule too (the budget study, issue 64)."""
    import yaml

    recipes = Path(__file__).resolve().parents[2] / "src" / "loramcl" / "recipes"
    blocks = {path.relative_to(recipes).as_posix(): (yaml.safe_load(path.read_text()) or {}).get("mcl")
              for path in recipes.rglob("*.yaml")}
    blocks = {path: block for path, block in blocks.items() if block}
    assert all("tie_break" not in blocks[path] for path in DEFAULT_RUNS)  # MCLConfig's: random
    papers = {path: block for path, block in blocks.items() if path not in DEFAULT_RUNS}
    assert len(papers) >= 30 and all(block.get("tie_break") == "lowest" for block in papers.values()), [
        path for path, block in papers.items() if block.get("tie_break") != "lowest"]
