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


def test_the_dry_run_passes_every_step(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out",
                           str(tmp_path), "--budget", "1500", "--jobs", "2"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["dry_run"] and [row["step"] for row in results["steps"]] == [s.name for s in gpu_check.STEPS]
    assert all(row["status"] == "ok" for row in results["steps"])
    numbers = {row["step"]: row["numbers"] for row in results["steps"]}
    assert numbers["paper-alma"]["tokens_per_s"] > 0 and numbers["paper-clotho"]["step_time_s"] > 0
    assert numbers["qlora"]["nf4_peft_gap"] < 0.05
    assert "| recipes-quick | ok |" in (tmp_path / "gpu_check.md").read_text()


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
