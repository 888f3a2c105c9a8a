"""benchmarks/gpu_check.py, the GPU check (issue 50): its dry run passes here, every loramcl command of it on the fake
accelerator (tests/fake_accelerator.py); each step keeps its time limit and the budget, and the summary is written
after every step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


def _documented_dry_run() -> tuple[str, ...]:
    """docs/benchmarks.md's dry-run line, as its words."""
    from docs_blocks import extract_blocks

    lines = [command.words for block in extract_blocks(["docs/benchmarks.md"]) if block.lang == "bash"
             for command in block.commands() if command.words[1:3] == ("benchmarks/gpu_check.py", "--dry-run")]
    assert len(lines) == 1, lines
    return lines[0]


def _checkout_root(folder: Path) -> Path:
    """``folder`` standing for the checkout's root, where the docs' commands run: its .venv this test's Python (the
    venv it runs in, else a link to the interpreter), its benchmarks/ the checkout's; what the commands write
    (`runs/...`) stays in ``folder``."""
    venv = folder / ".venv"
    if sys.prefix != sys.base_prefix:
        venv.symlink_to(sys.prefix, target_is_directory=True)
    else:
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "python").symlink_to(sys.executable)
    (folder / "benchmarks").symlink_to(ROOT / "benchmarks", target_is_directory=True)
    return folder


def test_the_dry_run_passes_every_step(tmp_path):
    """The docs' line as written (`.venv/bin/python benchmarks/gpu_check.py --dry-run ... --out runs/gpu-check`), run
    from a folder standing for the checkout's root: a relative --out, the recipe copies reading their paths relative
    to themselves (issue 61: the Clotho step failed so)."""
    words = _documented_dry_run()
    out = Path(words[words.index("--out") + 1])
    assert words[0] == ".venv/bin/python" and not out.is_absolute(), words
    folder = _checkout_root(tmp_path)
    done = subprocess.run(list(words), cwd=folder, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tmp_path = folder / out
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["dry_run"] and [row["step"] for row in results["steps"]] == [s.name for s in gpu_check.STEPS]
    assert all(row["status"] == "ok" for row in results["steps"])
    numbers = {row["step"]: row["numbers"] for row in results["steps"]}
    assert numbers["paper-alma"]["tokens_per_s"] > 0 and numbers["paper-clotho"]["step_time_s"] > 0
    assert numbers["qlora"]["nf4_peft_gap"] < 0.05
    assert "| recipes-quick | ok |" in (tmp_path / "gpu_check.md").read_text()


def test_the_recipe_copies_name_their_paths_wherever_they_are_read(tmp_path, monkeypatch):
    """The Clotho copy made with a relative work folder: its model and data read from another folder are the
    ones the check wrote (not paths under the copy)."""
    import yaml

    from loramcl.recipes.files import experiment_values, read_recipe

    monkeypatch.chdir(tmp_path)
    work = Path("runs/gpu-check/work")
    gpu_check.main(["--dry-run", "--out", "runs/gpu-check", "--internal", "clotho-recipe", "--",
                    str(work / "qwen2-audio-model"), str(work / "clotho-recipe")])
    assert gpu_check.Context(work=work, dry=True).work == tmp_path / work  # what the steps pass the helpers
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    recipe = tmp_path / work / "clotho-recipe"
    assert read_recipe(recipe, ["common.yaml"])["model"] == str(tmp_path / work / "qwen2-audio-model")
    names = list(yaml.safe_load((recipe / "experiment.yaml").read_text()))
    experiment = experiment_values(recipe / "experiment.yaml", names, paths=("out", "root"))
    assert (experiment["out"], experiment["root"]) == (str(recipe / "out"), str(recipe / "clotho-data"))


def test_a_step_past_its_limit_is_stopped_and_the_budget_skips_the_rest(tmp_path, monkeypatch, capsys):
    sleep = [sys.executable, "-c", "import time; print('GPU_CHECK {\"started\": 1}', flush=True); time.sleep(60)"]
    steps = [gpu_check.Step("slow", 2, 2, lambda ctx: [sleep]),
             gpu_check.Step("fast", 30, 30, lambda ctx: [[sys.executable, "-c", "print('done')"]]),
             gpu_check.Step("late", 50, 50, lambda ctx: [[sys.executable, "-c", "print('never')"]])]
    ctx = gpu_check.Context(work=tmp_path / "work", dry=True)
    results = gpu_check.run_steps(ctx, steps, budget=40, out=tmp_path)
    assert [row["status"] for row in results][:2] == ["timeout", "ok"]
    assert results[0]["seconds"] < 10 and results[0]["numbers"] == {"started": 1}  # what it printed before is kept
    assert results[2]["status"].startswith("skipped (budget")
    printed = capsys.readouterr().out
    assert "[fast] done" in printed and "never" not in printed
    assert "| late | skipped (budget" in (tmp_path / "gpu_check.md").read_text()


def test_a_failing_command_ends_its_step_with_its_exit_status(tmp_path):
    steps = [gpu_check.Step("broken", 30, 30, lambda ctx: [[sys.executable, "-c", "raise SystemExit(3)"],
                                                          [sys.executable, "-c", "print('not reached')"]])]
    results = gpu_check.run_steps(gpu_check.Context(work=tmp_path, dry=True), steps, budget=100, out=tmp_path)
    assert results[0]["status"] == "failed (exit 3)"


@pytest.mark.parametrize("argv", [["--steps", "nonesuch"], ["--budget", "x"]])
def test_bad_options_are_refused(argv):
    with pytest.raises(SystemExit):
        gpu_check.parse(argv)
