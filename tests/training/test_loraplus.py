"""LoRA+ (training.optimizer, loraplus_lr_ratio): LoRA's B matrices in param groups of their own at ratio x the
learning rate, Trainer's weight-decay split and schedule kept; off, the optimizer of today; the baselines alike."""

import pytest
import torch
from conftest import randomize_adapters
from tiny_models import build_model, token_rows
from transformers import Trainer

from loramcl import MCLConfig, MCLTrainer, MCLTrainingArguments, TrainConfig, get_mcl_model
from loramcl.baselines import MoEConfig, MultiHeadConfig, get_moe_model, get_multihead_model

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _mcl(num_hypotheses=3, **config):
    torch.manual_seed(0)
    model = get_mcl_model(build_model("llama"), MCLConfig(num_hypotheses=num_hypotheses, r=4, alpha=8,
                                                          target_modules=TARGETS, **config))
    randomize_adapters(model, std=0.05)
    return model


def _trainer(tmp_path, model, **settings):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, learning_rate=1e-3,
                  weight_decay=0.01, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
                  disable_tqdm=True, seed=0, data_seed=0)
    values.update(settings)
    return MCLTrainer(model, args=MCLTrainingArguments(**values), train_dataset=token_rows(16, 8, 0, prompt=2))


def _groups(optimizer):
    """Each param group as (its parameters' ids, its options but the parameters)."""
    return [([id(p) for p in g["params"]], {k: v for k, v in g.items() if k != "params"})
            for g in optimizer.param_groups]


def _check_partition(model, optimizer):
    """Every trainable parameter in exactly one group, nothing else in any."""
    grouped = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters() if p.requires_grad)


def _rates(model, optimizer):
    """{parameter name: (lr, weight_decay) of its group}."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: (g["lr"], g["weight_decay"]) for g in optimizer.param_groups for p in g["params"]}


@pytest.mark.parametrize("ratio", [None, 1])
def test_off_the_optimizer_is_trainers_own(tmp_path, ratio):
    """None (the default) and 1: the param groups Trainer builds, to the options and order."""
    ours = _trainer(tmp_path, _mcl(), loraplus_lr_ratio=ratio)
    ours.create_optimizer()
    plain = _trainer(tmp_path, ours.model)
    assert _groups(ours.optimizer) == _groups(Trainer.create_optimizer(plain))


def test_b_learns_at_ratio_times_the_rate_in_groups_of_its_own_decay_kept(tmp_path):
    model = _mcl()
    trainer = _trainer(tmp_path, model, loraplus_lr_ratio=16)
    optimizer = trainer.create_optimizer()
    _check_partition(model, optimizer)
    rates = _rates(model, optimizer)
    b = [name for name in rates if name.endswith(".lora_B")]
    a = [name for name in rates if name.endswith(".lora_A")]
    assert len(a) == len(b) == len(model.layer_names) > 0
    assert {rates[name] for name in a} == {(1e-3, 0.01)}  # Trainer's decay split survives: A and B decay alike
    assert {rates[name] for name in b} == {(1e-3 * 16, 0.01)}
    # each of Trainer's groups split in two (the empty no-decay group stays as it was): A's, then B's
    assert [len(g["params"]) for g in optimizer.param_groups] == [len(a), len(b), 0]


def test_the_schedule_scales_both_rates_and_an_adam_step_moves_b_sixteen_times_as_far(tmp_path):
    """Under warm-up and cosine decay the B groups stay at 16 x the others at every step; one AdamW step (the first
    moves every weight with a gradient by about the rate: m / sqrt(v) = +-1) moves B 16 times as far as A."""
    model = _mcl()
    trainer = _trainer(tmp_path, model, loraplus_lr_ratio=16, weight_decay=0.0, warmup_steps=2, max_steps=6,
                       lr_scheduler_type="cosine")
    trainer.create_optimizer_and_scheduler(num_training_steps=6)
    optimizer, scheduler = trainer.optimizer, trainer.lr_scheduler
    rates = []
    for _ in range(6):
        rates.append([g["lr"] for g in optimizer.param_groups if g["params"]])  # [A's, B's]
        optimizer.step()  # no gradients: nothing moves
        scheduler.step()
    assert rates[0] == [0.0, 0.0]  # warm-up from 0
    assert all(b == pytest.approx(16 * a) and a > 0 for a, b in rates[1:])
    assert len({a for a, _ in rates}) == 5  # warm-up 0, 5e-4, then cosine 1e-3 ... 1.5e-4 (5e-4 twice)

    model = _mcl()
    trainer = _trainer(tmp_path, model, loraplus_lr_ratio=16, weight_decay=0.0, lr_scheduler_type="constant")
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer.train()
    moved = {n: (p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters() if p.requires_grad}
    for name in (n for n in moved if n.endswith(".lora_A")):
        assert moved[name] == pytest.approx(1e-3, rel=1e-3)
        assert moved[name.replace("lora_A", "lora_B")] == pytest.approx(16e-3, rel=1e-3)


def test_the_scoring_head_keeps_its_own_group_and_rate(tmp_path):
    model = _mcl(scoring=True)
    optimizer = _trainer(tmp_path, model, loraplus_lr_ratio=4, scoring_learning_rate=5e-2).create_optimizer()
    _check_partition(model, optimizer)
    rates = _rates(model, optimizer)
    assert {rates[n] for n in rates if n.startswith("scoring_head.")} == {(5e-2, 0.0)}
    assert {rates[n] for n in rates if n.endswith(".lora_B")} == {(4e-3, 0.01)}
    assert {rates[n] for n in rates if n.endswith(".lora_A")} == {(1e-3, 0.01)}


def test_the_baselines_lora_mle_and_moe_split_b_and_multihead_refuses(tmp_path):
    """LoRA-MLE (K = 1; an ensemble's members) and LoRA-MoE train through the same trainer: their B at the ratio, the
    MoE routers at the rate; the multi-head baseline has no B to speed up and says so."""
    mle = _mcl(num_hypotheses=1)
    optimizer = _trainer(tmp_path, mle, loraplus_lr_ratio=8).create_optimizer()
    _check_partition(mle, optimizer)
    assert {lr for n, (lr, _) in _rates(mle, optimizer).items() if n.endswith(".lora_B")} == {8e-3}

    torch.manual_seed(0)
    moe = get_moe_model(build_model("llama"), MoEConfig(num_experts=2, r=4, target_modules=TARGETS))
    optimizer = _trainer(tmp_path, moe, loraplus_lr_ratio=8).create_optimizer()
    _check_partition(moe, optimizer)
    rates = _rates(moe, optimizer)
    assert {rates[n][0] for n in rates if n.endswith(".lora_B")} == {8e-3}
    assert {rates[n][0] for n in rates if n.endswith(".router")} == {1e-3}
    assert {rates[n][0] for n in rates if n.endswith(".lora_A")} == {1e-3}

    heads = get_multihead_model(build_model("llama"), MultiHeadConfig(num_hypotheses=2))
    with pytest.raises(ValueError, match="loraplus_lr_ratio 8 sets the learning rate of LoRA's B matrices, and this "
                                         "model has none .*leave loraplus_lr_ratio out"):
        _trainer(tmp_path, heads, loraplus_lr_ratio=8).create_optimizer()


@pytest.mark.parametrize("ratio, message", [
    (0.0, "loraplus_lr_ratio must be"), (float("nan"), "loraplus_lr_ratio must be"),
    (4000.0, r"loraplus_lr_ratio 4000 puts LoRA's B at learning_rate x ratio = 2, past 1")])
def test_a_bad_ratio_says_what_to_change(ratio, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(learning_rate=5e-4, loraplus_lr_ratio=ratio)


def test_the_ratio_is_a_setting_of_the_run(tmp_path):
    """run.json's settings hold it (run_settings: the training section), and only when set: a run without it is
    recorded as before; checkpoints of another ratio do not resume."""
    import json

    from loramcl.training.runs import SETTINGS_NAME, run_settings, settings_stamp, stale_checkpoint_fields

    config = MCLConfig(num_hypotheses=2)
    with_ratio = run_settings("model", config, None, TrainConfig(loraplus_lr_ratio=16), "float32")
    without = run_settings("model", config, None, TrainConfig(), "float32")
    assert with_ratio["training"]["loraplus_lr_ratio"] == 16
    assert "loraplus_lr_ratio" not in without["training"]  # off, the record is written as before the setting existed
    assert settings_stamp(without) != settings_stamp(with_ratio)
    (tmp_path / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    (tmp_path / "checkpoints" / SETTINGS_NAME).write_text(json.dumps(with_ratio))
    assert stale_checkpoint_fields(tmp_path, without) == ["training"]
