"""training.keep_best: OUT/best holds the adapters of the step with the lowest validation loss, and keeps them over
a resumed run."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import save_tiny_run_inputs
from transformers import AutoModelForCausalLM

from loramcl import DataConfig, MCLConfig, TrainConfig, load_mcl_model
from loramcl.training.best import check_run_best
from loramcl.training.fit import train
from loramcl.training.runs import settings_stamp
from loramcl.training.trainer import MCLTrainer
from loramcl.utils.files import sha256
from loramcl.utils.inputs import training_record

TARGETS = ["q_proj", "v_proj"]
# The validation loss each evaluation reports (by step): lowest at step 4, a middle evaluation, then rising again.
LOSSES = {2: 3.0, 4: 1.0, 6: 2.0, 8: 2.5}
WEIGHTS = "mcl_adapters.safetensors"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("keep_best")
    save_tiny_run_inputs(root)
    return root


@pytest.fixture
def evaluations(monkeypatch):
    """Each evaluation's eval_loss replaced by LOSSES[step]; the adapters the model held then, by step."""
    adapters = {}
    metrics = MCLTrainer._hypothesis_metrics

    def patched(self):
        step = self.state.global_step
        adapters[step] = {name: p.detach().clone() for name, p in self._mcl_model().named_parameters()
                          if p.requires_grad}
        return metrics(self) | {"eval_loss": LOSSES[step]}  # log() updates evaluate()'s metrics in place

    monkeypatch.setattr(MCLTrainer, "_hypothesis_metrics", patched)
    return adapters


def run(folders, out, k=2, resume=False):
    return train(model=str(folders / "base"), out=str(out), resume=resume,
                 mcl=MCLConfig(num_hypotheses=k, r=4, alpha=8, target_modules=TARGETS),
                 data=DataConfig(train_file=str(folders / "train.jsonl"),
                                 validation_file=str(folders / "train.jsonl"), eval_examples=4),
                 training=TrainConfig(steps=8, batch_size=4, learning_rate=1e-2, eval_every=2, save_every=2,
                                      keep_checkpoints=2, logging_steps=2, keep_best=True), threads=1)


def check_best(folders, out, adapters):
    """OUT/best loads, equals the adapters of step 4 and differs from the last ones; best.json identifies them (their
    SHA-256, as mcl_config.json records it) and the run (its settings' stamp), and checks against the run's records."""
    record = json.loads((out / "best" / "best.json").read_text())
    settings = json.loads((out / "run.json").read_text())["settings"]
    assert record == {"step": 4, "eval_loss": 1.0, "weights_sha256": sha256(out / "best" / "mcl_adapters.safetensors"),
                      "run": settings_stamp(settings)}
    assert json.loads((out / "best" / "mcl_config.json").read_text())["weights_sha256"] == record["weights_sha256"]
    assert check_run_best(out) == record
    model = load_mcl_model(AutoModelForCausalLM.from_pretrained(folders / "base"), out / "best")
    loaded = {name: p for name, p in model.named_parameters() if name in adapters[4]}
    assert loaded.keys() == adapters[4].keys() and loaded
    assert all(torch.equal(loaded[name], adapters[4][name]) for name in loaded)
    best, last = load_file(out / "best" / "mcl_adapters.safetensors"), load_file(out / "mcl_adapters.safetensors")
    assert any(not torch.equal(best[name], last[name]) for name in best)  # step 8's: the test has a subject


def test_keep_best_keeps_the_adapters_of_the_best_validation_step(folders, tmp_path, evaluations):
    out = tmp_path / "mle"
    run(folders, out, k=1)
    check_best(folders, out, evaluations)
    assert (out / "best" / "peft" / "adapter_config.json").is_file()  # a K = 1 run's PEFT adapter, as OUT/peft
    assert not (tmp_path / "mle" / "incomplete-best").exists()
    # generate / nll read the run's settings (prompt format, quantization) above OUT/best, as above OUT/peft
    assert training_record(str(out / "best"))[0] == training_record(str(out / "best" / "peft"))[0] == out / "run.json"


def test_a_resumed_run_keeps_the_best_of_the_steps_before_it(folders, tmp_path, evaluations):
    whole = tmp_path / "whole"
    run(folders, whole)
    check_best(folders, whole, evaluations)
    interrupted = tmp_path / "interrupted"  # killed after step 6's checkpoint: its best (step 4) on disk
    shutil.copytree(whole / "checkpoints", interrupted / "checkpoints")
    shutil.rmtree(interrupted / "checkpoints" / "checkpoint-8")
    shutil.copytree(whole / "best", interrupted / "best")
    evaluations.clear()
    run(folders, interrupted, resume=True)
    assert sorted(evaluations) == [8]  # only step 8 was evaluated again (2.5: worse than step 4's 1.0)
    assert json.loads((interrupted / "run.json").read_text())["resumed_from"] == "checkpoint-6"
    kept, expected = load_file(interrupted / "best" / "mcl_adapters.safetensors"), load_file(
        whole / "best" / "mcl_adapters.safetensors")
    assert kept.keys() == expected.keys() and all(torch.equal(kept[n], expected[n]) for n in expected)


def interrupted_copy(whole, out, checkpoints=True):
    """``out`` as a kill after checkpoint-6 of the run ``whole`` leaves it (its best on disk), or before its first
    checkpoint (``checkpoints`` False: the best alone)."""
    if checkpoints:
        shutil.copytree(whole / "checkpoints", out / "checkpoints")
        shutil.rmtree(out / "checkpoints" / "checkpoint-8")
    shutil.copytree(whole / "best", out / "best")
    return out


def edited(**values):
    def edit(best):
        (best / "best.json").write_text(json.dumps(json.loads((best / "best.json").read_text()) | values))
    return edit


# issue 61: each damage of OUT/best, and the line a resume refuses it with (none was refused, or named the file)
DAMAGES = {
    "best.json deleted": (lambda best: (best / "best.json").unlink(),
                          "best has no best.json, the record of the step and adapters it holds: delete the folder to "
                          r"let the run rebuild it \(from the validations still to run\), or restore it from a copy"),
    "weights deleted": (lambda best: (best / "mcl_adapters.safetensors").unlink(),
                        r"best has no mcl_adapters.safetensors: the adapters best.json describes \(step 4\) are not "
                        "whole: delete the folder"),
    "weights replaced": (lambda best: shutil.copy(best.parent.parent / "whole" / "mcl_adapters.safetensors",
                                                  best / "mcl_adapters.safetensors"),
                         r"mcl_adapters.safetensors is not the adapters best.json records \(SHA-256 [0-9a-f]{12}..., "
                         "recorded [0-9a-f]{64}\): they were replaced or damaged: delete the folder"),
    "eval_loss 0.0": (edited(eval_loss=0.0), r"best.json records eval_loss 0.0 at step 4, which the run's log \(the "
                      r"trainer_state.json of checkpoint-6, resumed from\) does not hold \(it logged eval_loss 1.0 at "
                      "that step\): delete the folder"),
    "step 999": (edited(step=999), "best.json records step 999, past the 8 steps of this run: delete the folder"),
    "truncated": (lambda best: (best / "best.json").write_text((best / "best.json").read_text()[:10]),
                  r"best.json is not valid JSON \(Expecting .*\): delete the folder"),
    "eval_loss 'low'": (edited(eval_loss="low"), r"best.json is not a best record of loramcl \(a step, a finite "
                        r"eval_loss, weights_sha256 and run\), got \{.*\}: delete the folder"),
    "another run's": (edited(run="0123456789abcdef"), r"best holds the best adapters of another run \(best.json: run "
                      r"0123456789abcdef; this run's settings stamp is [0-9a-f]{16}\): delete the folder"),
}


def test_a_damaged_best_is_refused_on_resume_and_left_as_it_is(folders, tmp_path, evaluations):
    whole = tmp_path / "whole"
    run(folders, whole)
    for number, (name, (damage, message)) in enumerate(DAMAGES.items()):
        out = interrupted_copy(whole, tmp_path / f"damaged{number}")
        damage(out / "best")
        before = {p.name: p.read_bytes() for p in (out / "best").rglob("*") if p.is_file()}
        with pytest.raises((ValueError, FileNotFoundError)) as refused:
            run(folders, out, resume=True)
        assert refused.match(message) and str(refused.value).startswith(str(out / "best")), name
        assert "\n" not in str(refused.value), name
        assert {p.name: p.read_bytes() for p in (out / "best").rglob("*") if p.is_file()} == before, name


def test_a_best_written_after_the_checkpoint_resumed_from_is_rebuilt_as_it_was(folders, tmp_path, evaluations,
                                                                                 monkeypatch):
    """A kill between step 8's validation (its best written) and its checkpoint, or before the first checkpoint: the
    resumed run validates the step again and writes the same best (the same tensors: a safetensors header's order
    varies from one write to the next)."""
    monkeypatch.setitem(LOSSES, 8, 0.5)  # the best is the last step's
    whole = tmp_path / "whole"
    run(folders, whole)
    expected, tensors = json.loads((whole / "best" / "best.json").read_text()), load_file(whole / "best" / WEIGHTS)
    assert expected["step"] == 8
    for checkpoints in (True, False):
        out = interrupted_copy(whole, tmp_path / f"killed-{checkpoints}", checkpoints)
        run(folders, out, resume=True)
        record, kept = json.loads((out / "best" / "best.json").read_text()), load_file(out / "best" / WEIGHTS)
        assert record | {"weights_sha256": None} == expected | {"weights_sha256": None}, checkpoints
        assert kept.keys() == tensors.keys() and all(torch.equal(kept[n], tensors[n]) for n in tensors), checkpoints
        assert check_run_best(out) == record


def test_a_fresh_run_refuses_another_runs_best_and_keep_best_needs_validation(folders, tmp_path, evaluations):
    whole = tmp_path / "whole"
    run(folders, whole)
    out = interrupted_copy(whole, tmp_path / "other", checkpoints=False)  # left by a run of other settings (K = 2)
    with pytest.raises(ValueError, match=r"other/best holds the best adapters of another run \(best.json: run "
                                         "[0-9a-f]{16}; this run's settings stamp is [0-9a-f]{16}\): move or delete "
                                         "the folder to start a run in this out, or choose another --out"):
        run(folders, out, k=1)
    assert (out / "best" / "best.json").read_bytes() == (whole / "best" / "best.json").read_bytes()  # kept
    with pytest.raises(ValueError, match="keep_best must be true or false, got 'yes'"):
        TrainConfig(keep_best="yes")
    with pytest.raises(ValueError, match="keep_best keeps the adapters of the lowest validation loss: give a "
                                         "validation file"):
        train(model=str(folders / "base"), out=str(tmp_path / "none"), mcl=MCLConfig(r=2, target_modules=TARGETS),
              data=DataConfig(train_file=str(folders / "train.jsonl")), training=TrainConfig(keep_best=True))
