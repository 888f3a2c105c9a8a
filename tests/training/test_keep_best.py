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
from loramcl.training.fit import train
from loramcl.training.trainer import MCLTrainer
from loramcl.utils.inputs import training_record

TARGETS = ["q_proj", "v_proj"]
# The validation loss each evaluation reports (by step): lowest at step 4, a middle evaluation, then rising again.
LOSSES = {2: 3.0, 4: 1.0, 6: 2.0, 8: 2.5}


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
    """OUT/best loads, equals the adapters of step 4 and differs from the last ones."""
    assert json.loads((out / "best" / "best.json").read_text()) == {"step": 4, "eval_loss": 1.0}
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


def test_a_fresh_run_drops_an_earlier_runs_best_and_keep_best_needs_validation(folders, tmp_path):
    from loramcl.training.best import BestAdapters

    for resumed in (True, False):  # e.g. an earlier run killed before its first validation left its best
        (tmp_path / "best").mkdir(exist_ok=True)
        (tmp_path / "best" / "best.json").write_text(json.dumps({"step": 99, "eval_loss": 0.1}))
        kept = BestAdapters(None, tmp_path, False, None, writing=True, gathering=False, resumed=resumed)
        assert (kept.loss, (tmp_path / "best").exists()) == ((0.1, True) if resumed else (float("inf"), False))
    with pytest.raises(ValueError, match="keep_best must be true or false, got 'yes'"):
        TrainConfig(keep_best="yes")
    with pytest.raises(ValueError, match="keep_best keeps the adapters of the lowest validation loss: give a "
                                         "validation file"):
        train(model=str(folders / "base"), out=str(tmp_path / "none"), mcl=MCLConfig(r=2, target_modules=TARGETS),
              data=DataConfig(train_file=str(folders / "train.jsonl")), training=TrainConfig(keep_best=True))
