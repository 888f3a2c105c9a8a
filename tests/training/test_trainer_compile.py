"""MCLTrainer with ``TrainConfig(compile=True)`` (Trainer's torch_compile, issue 54): the batch checked once per batch
outside the forward, each pass of two-pass WTA one compiled graph, the losses of eager training (dynamo's
``aot_eager`` backend: no C++ compilation)."""


import pytest
import torch
import torch._dynamo
from tiny_models import build_model, token_rows
from torch._dynamo.utils import counters

from loramcl import MCLConfig, MCLTrainer, TrainConfig, get_mcl_model
from loramcl.training.fit import training_arguments


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _train(tmp_path, compiled: bool, rows):
    torch.manual_seed(0)
    mcl = get_mcl_model(build_model("llama"), MCLConfig(num_hypotheses=3, r=4, alpha=8, loss="wta",
                                                        target_modules=["q_proj", "v_proj", "down_proj"]))
    training = TrainConfig(steps=3, batch_size=4, learning_rate=1e-2, warmup_steps=0, logging_steps=1, save_every=0,
                           eval_every=0, compile=compiled)
    # aot_eager rather than inductor: traced the same, no C++ compilation (a backend alone would compile eager runs)
    args = training_arguments(training, str(tmp_path), evaluating=False, use_cpu=True, disable_tqdm=True,
                              **({"torch_compile_backend": "aot_eager"} if compiled else {}))
    assert args.torch_compile is compiled
    trainer = MCLTrainer(mcl, args=args, train_dataset=rows)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_mcl_trainer_trains_compiled_with_the_eager_losses(tmp_path):
    """Two-pass WTA, three steps: its two passes compiled (two graphs, none recompiled), the losses of eager
    training. (The relaxed and annealed losses' compiled forward: tests/mcl/test_compile.py.)"""
    rows = token_rows(12, 8, 0, prompt=2)
    eager = _train(tmp_path / "eager", False, rows)
    assert counters["stats"]["unique_graphs"] == 0
    compiled = _train(tmp_path / "compiled", True, rows)
    assert counters["stats"]["unique_graphs"] == 2  # the scoring pass and the winners' pass
    assert len(eager) == 3
    assert compiled == pytest.approx(eager, rel=1e-5)


def test_compiled_relaxed_training_equals_eager_while_the_winners_agree():
    """Relaxed WTA (one pass, its first step's exact ties drawn inside the compiled forward): step by step, the winners
    trained, the NLL [B, K] and the loss of eager and compiled training are the same, as are the adapters after 3
    steps (benchmarks/studies/compiled_training_drift.py; under inductor the first step's ties are drawn from inductor's
    own random numbers, so other winners and then other losses: docs/architecture.md, "Compiling the forward")."""
    from benchmarks.studies.compiled_training_drift import drift

    result = drift("relaxed", steps=3, k=2, backend="aot_eager", examples=12)
    assert result["steps"][0]["smallest_gap"] == 0.0  # B = 0: every example's hypotheses tie at the first step
    for row in result["steps"]:
        assert row["flipped"] == [], row
        assert row["nll_difference"] < 1e-5 and row["loss_compiled"] == pytest.approx(row["loss_eager"], rel=1e-6)
    assert result["adapters_difference"] < 1e-5


def test_mcl_trainer_refuses_bad_token_ids_once_per_batch(tmp_path):
    rows = token_rows(4, 8, 0, prompt=2)
    rows[1]["input_ids"][3] = 500
    with pytest.raises(ValueError, match=r"input_ids holds 500 \(row \d, position 3\), outside this model"):
        _train(tmp_path, True, rows)


def test_train_config_compile_must_be_a_bool():
    with pytest.raises(ValueError, match="compile must be true or false"):
        TrainConfig(compile="yes")
