"""Checkpoints under MCLTrainer: a kill during a write never leaves a folder that breaks resuming, resume skips a
damaged newest checkpoint, rotation keeps the newest complete one, and no file is a pickle."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from checkpoint_train import adapters, trainer

SRC = Path(__file__).resolve().parents[2] / "src" / "loramcl"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 6-step run: its folder (checkpoint-2, -4, -6) and its final adapters."""
    out = tmp_path_factory.mktemp("reference")
    run = trainer(str(out))
    run.train()
    return out, adapters(run)


def _assert_identical(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def _resumed_from(run) -> list[str]:
    """Record the checkpoint folders ``run`` loads its adapters from."""
    loaded, load = [], run._load_from_checkpoint
    run._load_from_checkpoint = lambda path, model=None: (loaded.append(os.path.basename(path)), load(path, model))[1]
    return loaded


def _copy_checkpoints(reference_dir: Path, out: Path, steps) -> None:
    for step in steps:
        shutil.copytree(reference_dir / f"checkpoint-{step}", out / f"checkpoint-{step}")


def test_a_kill_during_a_checkpoint_write_resumes_to_the_same_adapters(tmp_path, reference):
    out, marker = tmp_path / "run", tmp_path / "paused"
    env = {**os.environ, "PAUSE_IN_SAVE_AT_STEP": "4", "PAUSE_MARKER": str(marker), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(SRC.parent), os.environ.get("PYTHONPATH", "")])}
    script = Path(__file__).resolve().parents[1] / "checkpoint_train.py"
    child = subprocess.Popen([sys.executable, str(script), str(out)], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():  # the child is inside the write of checkpoint-4
            assert child.poll() is None, child.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the child never reached the write of checkpoint-4"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert (out / "checkpoint-2").is_dir() and not (out / "checkpoint-4").exists()  # a folder that exists is whole

    resumed = trainer(str(out))  # a new process resumes with no manual step
    resumed.train(resume_from_checkpoint=True)
    _assert_identical(adapters(resumed), reference[1])
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]  # the leftover is gone


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # tensor data: the file stays readable, its checksum no longer matches
    path.write_bytes(bytes(data))


DAMAGES = {
    "no trainer state": lambda folder: (folder / "trainer_state.json").unlink(),
    "truncated adapters": lambda folder: _truncate(folder / "mcl_adapters.safetensors"),
    "truncated optimizer": lambda folder: _truncate(folder / "optimizer.pt"),
    "a flipped byte in the adapters": lambda folder: _flip_last_byte(folder / "mcl_adapters.safetensors"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_resume_skips_an_incomplete_newest_checkpoint_with_a_warning(tmp_path, reference, damage):
    _copy_checkpoints(reference[0], tmp_path, (2, 4))
    DAMAGES[damage](tmp_path / "checkpoint-4")
    run = trainer(str(tmp_path))
    loaded = _resumed_from(run)
    with pytest.warns(UserWarning, match=re.escape(str(tmp_path / "checkpoint-4"))):
        run.train(resume_from_checkpoint=True)
    assert loaded == ["checkpoint-2"]
    _assert_identical(adapters(run), reference[1])


def test_resume_from_the_path_of_an_incomplete_checkpoint_falls_back_to_an_earlier_one(tmp_path, reference):
    _copy_checkpoints(reference[0], tmp_path, (2, 4, 6))
    DAMAGES["truncated adapters"](tmp_path / "checkpoint-4")
    run = trainer(str(tmp_path / "again"))
    loaded = _resumed_from(run)
    with pytest.warns(UserWarning, match="checkpoint-4 is incomplete"):
        run.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert loaded == ["checkpoint-2"]  # the one before, not the later checkpoint-6
    _assert_identical(adapters(run), reference[1])
    with pytest.raises(FileNotFoundError, match="no-such-folder"):
        trainer(str(tmp_path)).train(resume_from_checkpoint=str(tmp_path / "no-such-folder"))


@pytest.mark.parametrize("left", ["nothing", "an incomplete checkpoint"])
def test_resume_without_a_complete_checkpoint_starts_from_the_beginning(tmp_path, reference, left):
    if left != "nothing":
        _copy_checkpoints(reference[0], tmp_path, (2,))
        DAMAGES["no trainer state"](tmp_path / "checkpoint-2")
    run = trainer(str(tmp_path))
    with pytest.warns(UserWarning) as caught:
        run.train(resume_from_checkpoint=True)
    messages = " ".join(str(w.message) for w in caught)
    assert "training starts from the beginning" in messages
    assert ("skipping the incomplete checkpoint" in messages) == (left != "nothing")
    _assert_identical(adapters(run), reference[1])


def test_resuming_a_finished_run_trains_no_further(tmp_path, reference):
    _copy_checkpoints(reference[0], tmp_path, (6,))
    run = trainer(str(tmp_path), lr_scheduler_type="constant")  # an extra step would move the adapters
    run.train(resume_from_checkpoint=True)
    assert run.state.global_step == 6 and sorted(os.listdir(tmp_path)) == ["checkpoint-6"]
    _assert_identical(adapters(run), reference[1])


def test_rotation_keeps_the_newest_complete_checkpoints_and_drops_incomplete_ones(tmp_path):
    stale = tmp_path / "checkpoint-9"  # left by a write killed before atomic checkpoints, with a later mtime
    stale.mkdir()
    (stale / "mcl_config.json").write_text("{}")
    os.utime(stale, (time.time() + 3600, time.time() + 3600))
    trainer(str(tmp_path), max_steps=4, save_steps=1, save_total_limit=2).train()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3", "checkpoint-4"]
    again = trainer(str(tmp_path), max_steps=4)
    again.train(resume_from_checkpoint=True)  # both kept checkpoints are whole
    assert again.state.global_step == 4


def test_the_best_checkpoint_is_recorded_under_its_final_name(tmp_path):
    # greater_is_better on the loss makes the earlier checkpoint-2 the "best", kept by rotation and loaded at the end
    run = trainer(str(tmp_path), max_steps=4, eval_examples=8, save_total_limit=1, eval_strategy="steps",
                  eval_steps=2, load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True)
    run.train()
    best = tmp_path / "checkpoint-2"
    assert run.state.best_model_checkpoint == str(best) and sorted(os.listdir(tmp_path)) == ["checkpoint-2"]
    assert json.loads((best / "trainer_state.json").read_text())["best_model_checkpoint"] == str(best)
    _assert_identical(adapters(run), safetensors.torch.load_file(best / "mcl_adapters.safetensors"))


def test_checkpoints_hold_the_training_arguments_as_json_not_pickle(reference):
    folder = reference[0] / "checkpoint-2"
    assert not (folder / "training_args.bin").exists()
    saved = json.loads((folder / "training_args.json").read_text())
    assert saved["learning_rate"] == 1e-2 and saved["save_steps"] == 2
    tensors = safetensors.torch.load_file(folder / "mcl_adapters.safetensors")
    assert tensors  # the adapters themselves are safetensors


def test_nothing_in_src_reads_a_pickle():
    readers = re.compile(r"torch\.load\(|pickle\.|dill\.|joblib\.load|allow_pickle\s*=\s*True|weights_only\s*=\s*False")
    found = [f"{path.relative_to(SRC)}:{n}" for path in SRC.rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1) if readers.search(line)]
    assert not found, found
