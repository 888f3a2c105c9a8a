"""benchmarks/checks/gpu_check.py, the GPU check (issue 50): its dry run passes here, every loramcl command of it on the
fake accelerator (benchmarks/checks/fake_accelerator.py); each step keeps its time limit and the budget, and the summary
is written after every step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.checks import gpu_check, gpu_check_helpers

ROOT = Path(__file__).resolve().parents[2]


def _documented_dry_run() -> tuple[str, ...]:
    """docs/benchmarks.md's dry-run line, as its words."""
    from docs_blocks import extract_blocks

    lines = [command.words for block in extract_blocks(["docs/benchmarks.md"]) if block.lang == "bash"
             for command in block.commands()
             if command.words[1:4] == ("-m", "benchmarks.checks.gpu_check", "--dry-run")]
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
    """The docs' line as written (`.venv/bin/python -m benchmarks.checks.gpu_check --dry-run ... --out runs/gpu-check`),
    run from a folder standing for the checkout's root: a relative --out, the recipe copies reading their paths
    relative to themselves (issue 61: the Clotho step failed so)."""
    words = _documented_dry_run()
    out = Path(words[words.index("--out") + 1])
    assert words[0] == ".venv/bin/python" and not out.is_absolute(), words
    folder = _checkout_root(tmp_path)
    done = subprocess.run(list(words), cwd=folder, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tmp_path = folder / out
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["dry_run"] and [row["step"] for row in results["steps"]] == gpu_check.DRY_DEFAULT
    assert "paper-textcaps" in gpu_check.DRY_DEFAULT and not set(gpu_check.DRY_SLOW) & set(gpu_check.DRY_DEFAULT)
    assert all(row["status"] == "ok" for row in results["steps"])
    numbers = {row["step"]: row["numbers"] for row in results["steps"]}
    assert numbers["paper-alma"]["tokens_per_s"] > 0 and numbers["paper-clotho"]["step_time_s"] > 0
    assert numbers["paper-textcaps"]["step_time_s"] > 0
    assert numbers["qlora"]["nf4_peft_gap"] < 0.05
    assert "| paper-textcaps | ok |" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.slow  # 30 to 100 s a step here (2026-11-29): out of CI's dry run, run by hand: `pytest -m slow`
def test_the_steps_out_of_the_default_dry_run_pass(tmp_path):
    """The dry run's slow steps (gpu_check.DRY_SLOW): the main job and the loramcl commands on the fake accelerator,
    the quick recipes on it, the suite's tiny training section, and the compiled steps (issue 65) at the tiny shape,
    compiled with aot_eager: the suite's compiled rows (loramcl K = 5 and the bare base, eager and compiled; the
    training step eager and compiled) and PEFT's batch of the same rows in the step's numbers."""
    gpu_check.main(["--dry-run", "--steps", *gpu_check.DRY_SLOW, "--jobs", "2", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(row["step"], row["status"]) for row in results["steps"]] == [(s, "ok") for s in gpu_check.DRY_SLOW]
    for row in results["steps"]:
        if not row["step"].startswith("compiled-"):
            continue
        numbers = row["numbers"]
        assert all(numbers[f"{kind}_{side}_ms"] > 0 for kind in ("greedy", "beam2")
                   for side in ("bare", "bare-compiled", "loramcl", "loramcl-compiled", "peft"))
        assert numbers["train_k1_compiled_ms"] > 0 and numbers["train_k5_eager_ms"] > 0


def test_every_loramcl_command_line_of_every_step_parses(monkeypatch):
    """The steps' loramcl command lines, the GPU's and the dry run's (run by hand or in the slow test, never in CI
    for the GPU's), read by `loramcl.cli.main` as a user's would be, the commands themselves replaced by a recorder:
    a renamed option or a value of the wrong type fails here, not in the GPU machine's 15 minutes."""
    import functools

    import loramcl.cli as cli

    table, called = cli.commands(), []

    def recorder(name, function):
        @functools.wraps(function)  # the same signature: jsonargparse reads the options off it
        def record(*args, **kwargs):
            called.append(name)
        return record

    def read(line):  # the line's command alone in the table: one parser built, not one per command
        monkeypatch.setattr(cli, "commands", lambda: {line[0]: recorder(line[0], table[line[0]])})
        cli.main(line)  # a line it cannot read exits with status 2 and says why

    commands = [command for dry in (True, False) for step in gpu_check.STEPS
                for command in step.commands(gpu_check.Context(work=Path("work"), dry=dry))]
    lines = [command[command.index("--") + 1:] for command in commands
             if "--internal" in command and command[command.index("--internal") + 1] == "cli"]
    assert {line[0] for line in lines} == {"markov", "train", "generate", "nll", "evaluate", "export",
                                           "audio-captioning", "image-captioning"}
    for line in lines:
        read(line)
    assert called == [line[0] for line in lines]
    with pytest.raises(SystemExit):  # the recorder does not hide a line it cannot read
        read([*lines[0], "--nonesuch", "1"])


def test_steps_run_in_the_order_given_and_the_dry_run_skips_none(tmp_path, monkeypatch):
    """--steps in the order given (the GPU runs name last the steps that run only where time is left); the dry run's
    default budget skips no step, one step alone included (its limit was the whole budget, and the first moment
    spent passed it)."""
    ran = []
    monkeypatch.setattr(gpu_check, "run_steps", lambda ctx, steps, budget, out, jobs: ran.append(
        ([s.name for s in steps], budget)) or [])
    monkeypatch.setattr(gpu_check, "write_summary", lambda *args: None)
    (tmp_path / "gpu_check.md").write_text("")
    gpu_check.main(["--dry-run", "--steps", "suite", "environment", "--out", str(tmp_path)])
    gpu_check.main(["--dry-run", "--out", str(tmp_path)])
    assert ran[0] == (["suite", "environment"], float("inf"))
    assert ran[1][0] == gpu_check.DRY_DEFAULT


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


def test_the_full_size_llava_next_processor_builds_offline_and_matches_its_config(tmp_path):
    """paper-textcaps' stand-in (issue 65), checked on the CPU at its full geometry: the processor built offline
    (LLaVA-NeXT's image processor at 336 pixels over LLaVA-1.6's grids, the word-level tokenizer with '<image>' at
    32000) saved and read back, its image tokens for a wide synthetic image accepted by a LLaVA-NeXT of the same
    config narrowed (the count depends on the vision tower's image and patch sizes and the grids only)."""
    import torch
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    from loramcl.recipes.image_captioning.textcaps import write_synthetic_textcaps

    gpu_check_helpers.llava_next_processor().save_pretrained(tmp_path / "model")
    processor = AutoProcessor.from_pretrained(tmp_path / "model")
    assert processor.tokenizer.convert_tokens_to_ids("<image>") == gpu_check_helpers.LLAVA_IMAGE_TOKEN
    config = gpu_check_helpers.llava_next_config()
    assert (config.text_config.hidden_size, config.vision_config.image_size, config.image_token_index) == (
        4096, 336, 32000)
    config.vision_config.update(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     projection_dim=32))
    config.text_config.update(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=4))
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration(config).eval()
    data = write_synthetic_textcaps(tmp_path / "data", {"train": 2})
    from PIL import Image

    image = next(image for path in (data / "images" / "train").glob("*.jpg")
                 if (image := Image.open(path)).size == (32, 16))  # a wide one: the 336 x 672 grid
    inputs = processor(images=image, text="USER : <image> Please carefully observe the image . ASSISTANT :",
                       return_tensors="pt")
    image_tokens = int((inputs["input_ids"] == 32000).sum())
    assert image_tokens > 2 * 576  # the base crop and two of the 336 x 672 grid, unpadded
    with torch.no_grad():
        assert model(**inputs).logits.shape[1] == inputs["input_ids"].shape[1]
