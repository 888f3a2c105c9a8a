"""Device placement on a machine without a GPU (issue 50): the main job, training and the commands with the model on
``fakegpu`` (benchmarks/checks/fake_accelerator.py), a second device whose tensors meet a stray CPU tensor the way a
GPU's do, so that code built only on the CPU fails here as it would on a user's GPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny_models import save_tiny_run_inputs

from benchmarks.checks.fake_accelerator import FAKE, fake_accelerator
from loramcl.cli import main
from loramcl.recipes.markov.chains import preset_mixture
from loramcl.recipes.markov.experiment import RunSettings, train_run

pytestmark = pytest.mark.system


def test_the_fake_device_fails_where_a_gpu_fails_and_computes_what_the_cpu_computes():
    x = torch.arange(6.0).reshape(2, 3)
    with fake_accelerator():
        on_device = x.to(FAKE)
        assert on_device.device == FAKE and torch.equal((on_device * 2 + 1).cpu(), x * 2 + 1)
        with pytest.raises(RuntimeError, match="same device.*fakegpu:0 and cpu"):
            on_device + torch.ones(2, 3)  # a tensor made without device=
        assert torch.equal((on_device + torch.tensor(1.0)).cpu(), x + 1)  # a 0-d CPU tensor is a scalar, as on CUDA
        with pytest.raises(RuntimeError, match="same device"):  # ... in elementwise operations only
            torch.stack([on_device.sum(), torch.tensor(2.0)])
        assert torch.equal(on_device[torch.tensor([1])].cpu(), x[[1]])  # CPU indices, as CUDA accepts
        assert torch.ones(2, device=on_device.device).device == FAKE
        assert torch.tensor([1, 2], device=FAKE).device == FAKE
        with pytest.raises(TypeError, match="numpy"):
            on_device.numpy()
        assert on_device.tolist() == x.tolist()
        assert torch.accelerator.current_accelerator().type == "fakegpu"
        with pytest.raises(RuntimeError, match="same device"):  # a layer left on the CPU
            torch.nn.Linear(3, 2)(on_device)


def test_the_markov_main_job_runs_with_the_model_on_an_accelerator(tmp_path):
    """The README's main job after training (issue 50: learned_transitions built a CPU tensor beside the CUDA model's
    and `loramcl markov` crashed on any machine with a GPU)."""
    settings = RunSettings().with_values(steps=4, eval_every=2, eval_sequences=16, batch_size=8)
    mixture = preset_mixture("fig2")
    with fake_accelerator():
        result = train_run("mcl", mixture, settings, seed=0, out=str(tmp_path / "mcl"), show_progress=False)
    cpu = train_run("mcl", mixture, settings, seed=0, out=str(tmp_path / "mcl-cpu"), show_progress=False)
    assert np.allclose(np.array(result.transitions, dtype=float), np.array(cpu.transitions, dtype=float),
                       equal_nan=True)
    assert result.final_loss == pytest.approx(cpu.final_loss, abs=1e-6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = save_tiny_run_inputs(tmp_path_factory.mktemp("fake-accelerator"))
    refs = [{"id": str(i), "prompt": f"w{5 + i} w9", "references": [f"w{40 + i}", "w41"]} for i in range(3)]
    (root / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in refs))
    return root


def test_train_generate_nll_and_evaluate_with_the_model_on_an_accelerator(tiny, tmp_path):
    run, preds = tmp_path / "run", tmp_path / "preds.jsonl"
    device = ["--device", "fakegpu", "--debug"]
    with fake_accelerator():
        main(["train", "--model", str(tiny / "base"), "--out", str(run), "--data.train_file",
              str(tiny / "train.jsonl"), "--data.max_length", "16", "--mcl.num_hypotheses", "2", "--mcl.r", "4",
              "--mcl.target_modules", "[q_proj, v_proj]", "--training.steps", "2", "--training.batch_size", "4",
              "--training.save_every", "0", "--threads", "1", "--debug"])
        for strategy in ("greedy", "beam", "sample"):
            main(["generate", "--model", str(tiny / "base"), "--adapters", str(run), "--input",
                  str(tiny / "test.jsonl"), "--out", str(preds), "--max_new_tokens", "3", "--strategy", strategy,
                  *(["--budget", "4"] if strategy == "beam" else []), *device])
        main(["nll", "--model", str(tiny / "base"), "--adapters", str(run), "--input", str(tiny / "test.jsonl"),
              "--out", str(tmp_path / "nll.jsonl"), *device])
    main(["evaluate", "--predictions", str(preds), "--references", str(tiny / "test.jsonl"), "--metrics",
          "sacrebleu,div2", "--tokenize", "false", "--nll", str(tmp_path / "nll.jsonl"), "--out", str(tmp_path / "e")])
    assert json.loads((tmp_path / "e" / "preds.json").read_text())
    assert all(len(json.loads(line)["candidates"]) == 2 for line in preds.read_text().splitlines())
