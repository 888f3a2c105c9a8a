"""benchmarks/checks/gpu_budget.py, the budget study on a lent GPU machine (issue 64): the GGUF's parts put together
only whole and checked, the calls planned under 64 MiB, the study cut at its limit, only finished runs sent back, and
the on-machine path on a tiny model."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from benchmarks.checks import gpu_budget

ROOT = Path(__file__).resolve().parents[2]
MIB = gpu_budget.MIB


def test_the_split_gguf_is_put_together_whole_and_a_missing_or_damaged_part_is_named(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(bytes(range(256)) * 10_000)  # 2.44 MiB: parts of 1, 1 and 0.44 MiB
    folder = tmp_path / "parts"
    manifest = gpu_budget.split(source, folder, part_mib=1)
    assert [p["size"] for p in manifest["parts"]] == [MIB, MIB, 2_560_000 - 2 * MIB]
    assert gpu_budget.assemble(folder).read_bytes() == source.read_bytes()
    (folder / manifest["file"]).unlink()
    (folder / "part-2").unlink()
    with pytest.raises(FileNotFoundError, match=r"part-2 of the 3 parts of model.gguf missing in .*: carry them"):
        gpu_budget.assemble(folder)
    gpu_budget.split(source, folder, part_mib=2)  # a new split: its parts, the stale part-3 gone
    assert sorted(p.name for p in folder.glob("part-*")) == ["part-1", "part-2"]
    damaged = bytearray((folder / "part-1").read_bytes())
    damaged[7] ^= 1
    (folder / "part-1").write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match="part-1: 2097152 bytes whose SHA-256 is not the manifest's"):
        gpu_budget.assemble(folder)
    (folder / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="manifest.json is missing: carry it with the parts"):
        gpu_budget.assemble(folder)


def test_the_calls_carry_the_model_and_the_wheels_under_64_mib():
    """The sizes measured on 2026-11-29 (docs/benchmarks.md's two calls): a 4.1 MiB checkout, 14.9 MiB of wheels,
    the 93.8 MiB GGUF in parts of 28 MiB."""
    parts = {f".gpu/model/part-{i}": int(size * MIB) for i, size in enumerate((28, 28, 28, 9.8), 1)}
    first = [".whl", ".gpu/study.tar.gz", ".gpu/model/manifest.json"]
    sizes = {".whl": int(14.9 * MIB), ".gpu/study.tar.gz": int(0.2 * MIB), ".gpu/model/manifest.json": 684} | parts
    calls = gpu_budget.plan_calls(first, list(parts), sizes, checkout=int(4.1 * MIB))
    assert calls == [[*first, ".gpu/model/part-1", ".gpu/model/part-4"],
                     [".gpu/model/manifest.json", ".gpu/model/part-2", ".gpu/model/part-3"]]
    assert all(int(4.1 * MIB) + sum(sizes[p] for p in carry) <= 62 * MIB for carry in calls)
    documented = (ROOT / "docs" / "benchmarks.md").read_text()
    assert all(json.dumps(carry) in documented for carry in calls)


def test_only_finished_runs_and_their_ensemble_members_travel_and_a_warm_machines_files_win(tmp_path):
    from benchmarks.studies.budget_study import KEPT

    study = tmp_path / "study"
    files = {"data/markov/train.jsonl": "{}", "markov/60-steps/mle-s0/results.json": "{}",
             "markov/60-steps/mle-s0/best/best.json": "{}", "markov/60-steps/mle-s0/adapters.safetensors": "w",
             "markov/60-steps/ensemble-s0/results.json": json.dumps({"members": ["mle-r8-s0"]}),
             "markov/60-steps/mle-r8-s0/run.json": "{}", "markov/60-steps/mle-r8-s1/run.json": "{}",
             "markov/60-steps/shared-s0/checkpoints/checkpoint-12/trainer_state.json": "{}",
             "markov/60-steps/shared-s0/train_log.json": "{}"}  # cut: stays on the warm machine
    for name, text in files.items():
        (study / name).parent.mkdir(parents=True, exist_ok=True)
        (study / name).write_text(text)
    packed = gpu_budget.pack(study, tmp_path / "out" / "study.tar.gz")
    assert sorted(p.relative_to(study).as_posix() for p in packed) == [
        "data/markov/train.jsonl", "markov/60-steps/ensemble-s0/results.json", "markov/60-steps/mle-r8-s0/run.json",
        "markov/60-steps/mle-s0/best/best.json", "markov/60-steps/mle-s0/results.json"]
    assert {p.name for p in packed} <= set(KEPT) | {"train.jsonl"}
    warm = tmp_path / "warm"
    (warm / "markov/60-steps/mle-s0").mkdir(parents=True)
    (warm / "markov/60-steps/mle-s0/results.json").write_text('{"newer": 1}')
    assert gpu_budget.unpack(tmp_path / "out" / "study.tar.gz", warm) == 4
    assert (warm / "markov/60-steps/mle-s0/results.json").read_text() == '{"newer": 1}'
    assert gpu_budget.unpack(tmp_path / "absent.tar.gz", warm) == 0


def test_the_study_is_stopped_at_its_limit_and_what_waits_is_not_started(tmp_path):
    code = "import sys, time; time.sleep(float(sys.argv[1])); sys.exit(int(sys.argv[2]))"
    commands = [[sys.executable, "-c", code, *args] for args in (("0", "0"), ("0", "3"), ("60", "0"), ("0", "0"))]
    logs = [tmp_path / f"{i}.log" for i in range(4)]
    status = gpu_budget.run_limited(commands, 2, 1.5, logs, env=gpu_budget.environment(ROOT), cwd=tmp_path)
    assert status[:3] == ["finished", "failed (exit 3)", "cut"]
    assert status[3] in ("finished", "not started")  # started once the first two ended, if time was left


def test_one_study_process_per_task_and_seed():
    args = ["--budgets", "200", "--settings", "mle", "shared", "--tasks", "markov", "short", "--seeds", "0", "1"]
    assert gpu_budget.job_arguments(args, 1) == [args]
    jobs = gpu_budget.job_arguments(args, 4)
    assert [job[len(args):] for job in jobs] == [["--tasks", task, "--seeds", seed] for seed in "01"
                                                 for task in ("markov", "short")]


def test_a_gguf_given_to_the_conversion_must_exist(tmp_path):
    from loramcl.models.pretrained import convert_smollm2

    with pytest.raises(FileNotFoundError, match="no such GGUF file: give the SmolLM2-135M-Instruct GGUF's path"):
        convert_smollm2(tmp_path / "out", gguf=tmp_path / "none.gguf")


def test_a_limit_too_short_to_pack_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="give more seconds than the 45 kept to pack the results"):
        gpu_budget.main(["study", "--out", str(tmp_path), "--seconds", "30"])


@pytest.mark.slow
def test_the_dry_path_runs_the_study_on_a_tiny_model_and_sends_back_its_finished_runs(tmp_path):
    """The on-machine command with --model (no parts, no wheels) and --device cpu, one run of one step."""
    from tiny_models import save_tiny_run_inputs

    from benchmarks.studies import budget_study

    root = tmp_path / "checkout"
    root.mkdir()
    for name in ("src", "benchmarks"):
        (root / name).symlink_to(ROOT / name, target_is_directory=True)
    base = save_tiny_run_inputs(tmp_path) / "base"
    budget_study.build_data("markov", root / ".gpu" / "study" / "data" / "markov", train=40, validation=8, test=3)
    out = tmp_path / "out"
    gpu_budget.main(["--root", str(root), "study", "--model", str(base), "--device", "cpu", "--out", str(out),
                     "--seconds", "300", "--", "--budgets", "1", "--tasks", "markov", "--settings", "mle",
                     "--seeds", "0", "--rank", "4", "--evaluations", "1"])
    summary = json.loads((out / "gpu_budget.json").read_text())
    assert summary["study"] == ["--budgets 1 --tasks markov --settings mle --seeds 0 --rank 4 --evaluations 1: "
                                "finished"]
    assert summary["finished_now"] == ["markov/1-steps/mle-s0"] and summary["in_progress"] == []
    assert "| LoRA-MLE r12, beam 3 | 1 | 1 |" in (out / "table.md").read_text()
    assert not list((root / ".gpu" / "study").rglob("*.safetensors"))  # --prune
    # a fresh machine: the tarball carried, the study folder gone, the finished run read back, not trained again
    (root / ".gpu" / "study.tar.gz").write_bytes((out / "study.tar.gz").read_bytes())
    shutil.rmtree(root / ".gpu" / "study")
    gpu_budget.main(["--root", str(root), "study", "--model", str(base), "--device", "cpu", "--out", str(out),
                     "--seconds", "300", "--", "--budgets", "1", "--tasks", "markov", "--settings", "mle",
                     "--seeds", "0", "--rank", "4", "--evaluations", "1"])
    summary = json.loads((out / "gpu_budget.json").read_text())
    assert summary["unpacked_files"] > 5 and summary["finished_now"] == [] and summary["finished_in_all"] == 1
