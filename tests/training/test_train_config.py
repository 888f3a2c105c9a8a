"""TrainConfig's memory and precision settings reach Trainer and the model: accumulation, activation checkpointing,
bf16 autocast, TF32."""

import pytest
import torch
from conftest import randomize_adapters
from tiny_models import build_model, token_rows

from loramcl import MCLConfig, MCLTrainer, TrainConfig, get_mcl_model
from loramcl.training.fit import precision_arguments, training_arguments


def _model(loss="wta"):
    torch.manual_seed(0)
    config = MCLConfig(num_hypotheses=3, r=4, alpha=8, loss=loss, epsilon=0.1 if loss == "relaxed" else 0.0,
                       target_modules=["q_proj", "v_proj", "down_proj"])
    mcl = get_mcl_model(build_model("llama"), config)
    randomize_adapters(mcl, std=0.05)
    return mcl


def _train(tmp_path, training: TrainConfig, loss="wta", **overrides) -> tuple[MCLTrainer, torch.Tensor]:
    mcl = _model(loss)
    args = training_arguments(training, str(tmp_path), evaluating=False, disable_tqdm=True, **overrides)
    trainer = MCLTrainer(mcl, args=args, train_dataset=token_rows(2 * training.batch_size * training.steps, 8))
    trainer.train()
    return trainer, torch.cat([p.detach().flatten() for p in mcl.parameters() if p.requires_grad])


def test_each_setting_reaches_training_arguments(tmp_path):
    training = TrainConfig(batch_size=12, gradient_accumulation_steps=3, activation_checkpointing=True, bf16=True,
                           tf32=True)
    args = training_arguments(training, str(tmp_path), evaluating=False)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 3)
    assert args.activation_checkpointing is True and args.bf16 is True
    assert args.tf32 is None  # on this CPU: Trainer refuses tf32 without a GPU
    cuda = torch.device("cuda")
    assert precision_arguments(training, cuda) == {"bf16": True, "tf32": True}
    assert precision_arguments(TrainConfig(), cuda) == {"bf16": False, "tf32": False}
    assert precision_arguments(training, torch.device("xpu")) == {"bf16": True, "tf32": None}  # TF32 is CUDA's


@pytest.mark.parametrize("loss", ["wta", "relaxed"])
def test_accumulation_gives_the_update_of_the_whole_batch(tmp_path, loss):
    """Each example's winner is its own, so 3 micro-batches of 2 make the gradient of the batch of 6 (with SGD, a
    sum of the micro-batches' means instead of their average would move the weights 3 times as far)."""
    common = dict(steps=1, learning_rate=0.5, warmup_steps=0, max_grad_norm=0.0, save_every=0, scheduler="constant")
    start = torch.cat([p.detach().flatten() for p in _model(loss).parameters() if p.requires_grad])
    _, whole = _train(tmp_path / "whole", TrainConfig(batch_size=6, **common), loss, optim="sgd")
    _, accumulated = _train(tmp_path / "acc", TrainConfig(batch_size=6, gradient_accumulation_steps=3, **common), loss,
                            optim="sgd")
    assert not torch.equal(whole, start)
    torch.testing.assert_close(accumulated, whole, atol=1e-6, rtol=1e-5)


def test_activation_checkpointing_and_bf16_autocast_reach_the_model(tmp_path):
    training = TrainConfig(steps=1, batch_size=2, activation_checkpointing=True, bf16=True, save_every=0)
    trainer, _ = _train(tmp_path, training)
    assert trainer.model.is_activation_checkpointing
    assert trainer.accelerator.mixed_precision == "bf16"
    default, _ = _train(tmp_path / "default", TrainConfig(steps=1, batch_size=2, save_every=0))
    assert not default.model.is_activation_checkpointing and default.accelerator.mixed_precision == "no"


def test_accumulation_must_divide_the_batch():
    with pytest.raises(ValueError, match="gradient_accumulation_steps 3 must divide batch_size 8 .* e.g. 9"):
        TrainConfig(batch_size=8, gradient_accumulation_steps=3)
    with pytest.raises(ValueError, match="bf16 must be true or false"):
        TrainConfig(bf16="yes")


def test_several_gpus_in_one_process_are_refused_with_the_torchrun_command(tmp_path):
    """Trainer would wrap the model in nn.DataParallel (n_gpu > 1 without torchrun): faked here on the arguments."""
    args = training_arguments(TrainConfig(steps=1, batch_size=2, save_every=0), str(tmp_path), evaluating=False)
    args._n_gpu = 2  # what TrainingArguments finds with two visible GPUs and no process group
    with pytest.raises(ValueError, match=r"2 GPUs are visible to this one process.*DataParallel.*torchrun "
                                         r"--nproc_per_node 2 -m loramcl.cli train"):
        MCLTrainer(_model(), args=args, train_dataset=token_rows(2, 8))


def test_fsdp1_is_refused_with_the_fsdp2_settings(tmp_path):
    """FSDP1 flattens a wrapped unit into one dtype (bf16 base and float32 adapters cannot share one)."""
    args = training_arguments(TrainConfig(steps=1, batch_size=2, save_every=0), str(tmp_path), evaluating=False,
                              fsdp=True, fsdp_config={"version": 1})
    with pytest.raises(ValueError, match=r"FSDP version 1 .* fsdp_config=\{'version': 2\}.*--fsdp_version 2"):
        MCLTrainer(_model(), args=args, train_dataset=token_rows(2, 8))


def test_only_the_first_process_writes_the_finished_run(tmp_path, monkeypatch):
    """Under DDP every process ends with the same adapters: the others write nothing (no two writers of one file)."""
    from tiny_models import build_model

    from loramcl.training.fit import fit

    def collate(rows):
        return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}

    config = MCLConfig(num_hypotheses=1, r=4, alpha=8, target_modules=["q_proj"])
    training = TrainConfig(steps=1, batch_size=2, save_every=0)
    monkeypatch.setattr(MCLTrainer, "is_world_process_zero", lambda self: False)
    run = fit(lambda: build_model("llama"), tmp_path / "other", config, training, {}, token_rows(2, 8), None, collate)
    assert run["train_examples"] == 2 and not [p for p in (tmp_path / "other").rglob("*") if p.is_file()]
    monkeypatch.setattr(MCLTrainer, "is_world_process_zero", lambda self: True)
    fit(lambda: build_model("llama"), tmp_path / "first", config, training, {}, token_rows(2, 8), None, collate)
    assert {"run.json", "train_log.json", "mcl_adapters.safetensors", "peft"} <= {
        p.name for p in (tmp_path / "first").iterdir()}


def test_a_wta_run_recorded_with_the_old_decay_default_is_the_same_run(tmp_path):
    """temperature_decay acts under the annealed loss only: a WTA run recorded when `loramcl train`'s default was
    0.999 is still finished (not retrained) under today's default 'auto'; an annealed run with another decay is
    another run."""
    import json

    from loramcl.training.runs import finished_run

    def settings(**fields):
        return {"model": "m", "mcl": MCLConfig(**fields).to_dict()}

    (tmp_path / "run.json").write_text(json.dumps({"settings": settings(loss="wta", temperature_decay=0.999)}))
    assert finished_run(tmp_path, settings(loss="wta", temperature_decay="auto"))
    (tmp_path / "run.json").write_text(json.dumps({"settings": settings(loss="annealed", temperature_decay=0.999)}))
    assert not finished_run(tmp_path, settings(loss="annealed", temperature_decay="auto"))
    assert finished_run(tmp_path, settings(loss="annealed", temperature_decay=0.999))


@pytest.mark.parametrize("steps,warmup,scheduler,reached", [
    (3, 100, "cosine", 0.02), (6, 6, "linear", 5 / 6), (3, 0, "cosine", 1.0), (3, 100, "constant", 1.0),
    (20, 10, "cosine", 1.0)])
def test_the_learning_rate_a_schedule_reaches_is_the_one_its_steps_train_at(tmp_path, steps, warmup, scheduler,
                                                                           reached):
    """Issue 61: `--training.warmup_steps 100 --training.steps 3` trained at 2% of its learning rate without a word.
    ``learning_rate_reached`` reads the highest rate off the schedule Trainer builds; here against the rates the
    optimizer's steps actually took (a constant schedule has no warm-up: transformers ignores warmup_steps there)."""
    from transformers import TrainerCallback

    from loramcl.training.schedule import learning_rate_reached, warmup_shortfall

    class Rates(TrainerCallback):
        def __init__(self):
            self.taken = []  # the learning rate of each optimizer step

        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            self.taken.append(optimizer.param_groups[0]["lr"])

    training = TrainConfig(steps=steps, warmup_steps=warmup, scheduler=scheduler, learning_rate=1e-2, batch_size=2)
    args = training_arguments(training, str(tmp_path), evaluating=False, disable_tqdm=True, save_strategy="no")
    assert learning_rate_reached(args, steps) == pytest.approx(reached)
    rates = Rates()
    trainer = MCLTrainer(_model(), args=args, train_dataset=token_rows(2 * steps, 8), callbacks=[rates])
    trainer.train()
    assert len(rates.taken) == steps and max(rates.taken) == pytest.approx(reached * 1e-2)
    said = warmup_shortfall(args, steps)
    assert (said is None) == (reached == 1.0)
    if (steps, warmup, scheduler) == (3, 100, "cosine"):
        assert said == ("the learning rate never reaches the 0.01 set: warmup_steps 100 outlasts the run's 3 steps, "
                        "whose last trains at 0.0002 (2% of it)")


def test_a_step_count_that_cannot_finish_is_refused_with_its_limit():
    """Issue 61: `--training.steps 1000000000000000000` was accepted and ran with an ETA of 2e13 hours."""
    from loramcl.training.config import MAX_STEPS

    assert MAX_STEPS == 10**8 and TrainConfig(steps=MAX_STEPS).steps == MAX_STEPS
    for steps in (MAX_STEPS + 1, 10**18):
        with pytest.raises(ValueError, match=rf"^steps must be at most 100000000 \(MAX_STEPS: 10\^8 optimizer steps "
                                             rf"take over 115 days .*\), got {steps}$"):
            TrainConfig(steps=steps)


def test_a_schedule_the_warm_up_check_cannot_build_gives_no_warning_rather_than_a_crash(tmp_path):
    """The check runs again when training ends (the verdict): a schedule its copy cannot build (cosine_with_min_lr
    without its min_lr, which Trainer would refuse first) must not fail a finished run."""
    from transformers import TrainingArguments

    from loramcl.training.schedule import learning_rate_reached, warmup_shortfall

    args = TrainingArguments(str(tmp_path), lr_scheduler_type="cosine_with_min_lr", warmup_steps=100, report_to=[])
    assert learning_rate_reached(args, 3) == 1.0 and warmup_shortfall(args, 3) is None
