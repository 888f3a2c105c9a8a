"""MCLTrainer: what changes after a step, the two-pass WTA gradient, accumulation, resume, logs."""

import dataclasses
import json
import math
import os
import warnings

import pytest
import torch
from conftest import randomize_adapters
from tiny_models import build_model, token_rows
from transformers import TrainerCallback, TrainingArguments

from loramcl import MCLConfig, MCLTrainer, get_mcl_model, load_mcl_model
from loramcl.training.throughput import TrainingClock
from loramcl.utils.inputs import BaseWeightsMismatch


def _dataset(n=16, length=8, seed=0):
    return token_rows(n, length, seed, prompt=2)


def _model(loss="wta", num_hypotheses=3, dropout=0.0, **config):
    torch.manual_seed(0)
    mcl = get_mcl_model(build_model("llama"), MCLConfig(num_hypotheses=num_hypotheses, r=4, alpha=8, dropout=dropout,
                                                        target_modules=["q_proj", "v_proj", "down_proj"],
                                                        loss=loss, **config))
    randomize_adapters(mcl, std=0.05)
    return mcl


def _args(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, learning_rate=1e-2,
                  weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
                  disable_tqdm=True, seed=0, data_seed=0)
    values.update(overrides)
    return TrainingArguments(**values)


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _batch(rows):
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def test_one_step_changes_only_adapter_tensors(tmp_path):
    mcl = _model(loss="relaxed", epsilon=0.1)
    before = _snapshot(mcl)
    MCLTrainer(mcl, args=_args(tmp_path), train_dataset=_dataset(4)).train()
    changed = {n for n, p in mcl.named_parameters() if not torch.equal(p, before[n])}
    adapters = {n for n in before if n.endswith(("lora_A", "lora_B"))}
    assert changed == adapters


@pytest.mark.parametrize("two_pass", [True, False])
def test_vanilla_wta_updates_only_the_winners(tmp_path, two_pass):
    mcl = _model(loss="wta", num_hypotheses=4)
    data = _dataset(2)  # 2 examples, 4 hypotheses: at least 2 hypotheses win nothing
    with torch.no_grad():
        winners = set(mcl(**_batch(data)).nll.argmin(dim=1).tolist())
    before = _snapshot(mcl)
    MCLTrainer(mcl, args=_args(tmp_path, per_device_train_batch_size=2), train_dataset=data,
               two_pass_wta=two_pass).train()
    for name, layer in mcl.mcl_layers():
        for part in ("lora_A", "lora_B"):
            old, new = before[f"base_model.{name}.{part}"], getattr(layer, part)
            for k in range(4):
                assert torch.equal(old[k], new[k]) == (k not in winners), (name, part, k)


def test_two_pass_gradient_equals_the_one_pass_gradient(tmp_path):
    batch = _batch(_dataset(6))
    grads = {}
    for two_pass in (True, False):
        mcl = _model(loss="wta").train()
        trainer = MCLTrainer(mcl, args=_args(tmp_path), two_pass_wta=two_pass)
        trainer.compute_loss(mcl, dict(batch)).backward()
        grads[two_pass] = torch.cat([p.grad.flatten() for p in mcl.parameters() if p.requires_grad])
    assert grads[True].abs().sum() > 0
    torch.testing.assert_close(grads[True], grads[False], atol=1e-5, rtol=0)


def test_gradient_accumulation_averages_over_the_whole_batch(tmp_path):
    results = []
    for batch_size, accumulation in ((4, 1), (2, 2)):
        mcl = _model(loss="relaxed", epsilon=0.2)
        args = _args(tmp_path, per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation,
                     optim="sgd", learning_rate=1.0)
        MCLTrainer(mcl, args=args, train_dataset=_dataset(4)).train()
        results.append(torch.cat([p.detach().flatten() for p in mcl.parameters() if p.requires_grad]))
    torch.testing.assert_close(results[0], results[1], atol=1e-6, rtol=0)


def test_logs_win_rates_temperature_and_wta_eval(tmp_path):
    mcl = _model(loss="annealed", temperature0=1.0, temperature_decay=0.5)
    data = _dataset(8)
    trainer = MCLTrainer(mcl, args=_args(tmp_path, max_steps=2), train_dataset=data, eval_dataset=data)
    trainer.train()
    train_logs = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["temperature"] for log in train_logs] == [1.0, 0.5]  # tau at steps 0 and 1
    for log in train_logs:
        assert sum(log[f"win_rate_h{k}"] for k in range(3)) == pytest.approx(1.0)
    metrics = trainer.evaluate()
    with torch.no_grad():
        nll = mcl.eval()(**_batch(data)).nll
    assert metrics["eval_loss"] == pytest.approx(nll.min(dim=1).values.mean().item(), abs=1e-6)
    for k in range(3):
        assert metrics[f"eval_nll_h{k}"] == pytest.approx(nll[:, k].mean().item(), abs=1e-6)
        assert metrics[f"eval_win_rate_h{k}"] == pytest.approx((nll.argmin(dim=1) == k).float().mean().item())


class _AdaptersAtSave(TrainerCallback):
    """The adapters of the model at each checkpoint save, by global step."""

    def __init__(self, mcl):
        self.mcl, self.saved = mcl, {}

    def on_save(self, args, state, control, **kwargs):
        self.saved[state.global_step] = {k: v.clone() for k, v in self.mcl.adapter_state_dict().items()}


def test_resuming_from_a_checkpoint_continues_the_same_run(tmp_path):
    data = _dataset(16)
    straight = _model(loss="relaxed", epsilon=0.05)
    MCLTrainer(straight, args=_args(tmp_path / "a", max_steps=4), train_dataset=data).train()
    first = _model(loss="relaxed", epsilon=0.05)
    at_save = _AdaptersAtSave(first)
    MCLTrainer(first, args=_args(tmp_path / "b", max_steps=4, save_strategy="steps", save_steps=2),
               train_dataset=data, callbacks=[at_save]).train()
    checkpoint = tmp_path / "b" / "checkpoint-2"
    resumed = _model(loss="relaxed", epsilon=0.05)
    MCLTrainer(resumed, args=_args(tmp_path / "c", max_steps=4), train_dataset=data).train(
        resume_from_checkpoint=str(checkpoint))
    for (_, a), (_, b) in zip(straight.mcl_layers(), resumed.mcl_layers(), strict=True):
        torch.testing.assert_close(a.lora_A, b.lora_A, atol=1e-6, rtol=0)
        torch.testing.assert_close(a.lora_B, b.lora_B, atol=1e-6, rtol=0)
    # a trainer checkpoint is an MCL folder too: onto the base it was trained on (the seed _model builds it with), it
    # loads the adapters the run had when it saved step 2, neither the initial nor the final ones
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BaseWeightsMismatch)
        loaded = load_mcl_model(build_model("llama"), checkpoint)
    assert loaded.num_hypotheses == 3
    expected, final = at_save.saved[2], first.adapter_state_dict()
    got = loaded.adapter_state_dict()
    assert got.keys() == expected.keys() and any(k.endswith("lora_A") for k in got)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert not all(torch.equal(got[k], final[k]) for k in final)


@pytest.mark.parametrize("restore", [False, True])
def test_a_resumed_run_counts_the_seconds_its_checkpoint_recorded(tmp_path, restore):
    """Each checkpoint keeps the run's training seconds so far (trainer_state.json, the TrainingClock's state); a run
    resumed from it starts from them, whether or not Trainer restores callback states; a checkpoint without them
    (written before loramcl kept them) gives None: unknown, never 0."""
    data = _dataset(16)
    first = MCLTrainer(_model(), args=_args(tmp_path / "a", max_steps=4, save_strategy="steps", save_steps=2),
                       train_dataset=data)
    first.train()
    assert TrainingClock.of(first).earlier == 0.0
    state_file = tmp_path / "a" / "checkpoint-2" / "trainer_state.json"
    recorded = json.loads(state_file.read_text())["stateful_callbacks"]["TrainingClock"]["attributes"]["earlier"]
    assert recorded > 0

    def resumed(out):  # and saves checkpoints again: each keeps the seconds so far (or None: unknown)
        trainer = MCLTrainer(_model(), args=_args(tmp_path / out, max_steps=4, save_strategy="steps", save_steps=1,
                                                  restore_callback_states_from_checkpoint=restore),
                             train_dataset=data)
        trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
        saved = json.loads((tmp_path / out / "checkpoint-4" / "trainer_state.json").read_text())
        return TrainingClock.of(trainer).earlier, saved["stateful_callbacks"]["TrainingClock"]["attributes"]["earlier"]

    earlier, at_step_4 = resumed("b")
    assert earlier == recorded and at_step_4 > recorded
    state = json.loads(state_file.read_text())
    del state["stateful_callbacks"]["TrainingClock"]  # Trainer indexes the entry at every save: put back, as None
    state_file.write_text(json.dumps(state))
    assert resumed("c") == (None, None)


def test_trainer_refuses_a_plain_model_and_options_it_would_ignore(tmp_path):
    with pytest.raises(TypeError, match="MCLTrainer trains an MCLModel"):
        MCLTrainer(build_model("llama"), args=_args(tmp_path))
    with pytest.raises(ValueError, match="label_smoothing_factor is not supported"):
        MCLTrainer(_model(), args=_args(tmp_path, label_smoothing_factor=0.1))
    with pytest.raises(ValueError, match="compute_loss_func is not used"):
        MCLTrainer(_model(), args=_args(tmp_path), compute_loss_func=lambda outputs, labels, **kw: outputs.loss)


def test_a_datasets_dataset_keeps_the_base_models_inputs_and_drops_other_columns(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = _dataset(8)
    table = datasets.Dataset.from_dict({
        **{key: [r[key].tolist() for r in rows] for key in ("input_ids", "attention_mask", "labels")},
        "text": ["a caption"] * 8})
    trainer = MCLTrainer(_model(), args=_args(tmp_path), train_dataset=table)
    trainer.train()  # a string column reaching the collator, or input_ids dropped, would fail here
    assert {"input_ids", "attention_mask", "labels"} <= set(trainer._signature_columns)
    assert "text" not in trainer._signature_columns


def test_activation_checkpointing_through_training_arguments(tmp_path):
    # the argument's name before transformers 5.23 was gradient_checkpointing: users of either find it works
    fields = {field.name for field in dataclasses.fields(TrainingArguments)}
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    results = []
    for checkpointing in (False, True):
        mcl = _model(loss="relaxed", epsilon=0.1)
        args = _args(tmp_path, max_steps=2, **{name: checkpointing})
        MCLTrainer(mcl, args=args, train_dataset=_dataset(8)).train()
        assert mcl.is_activation_checkpointing == checkpointing
        results.append(torch.cat([p.detach().flatten() for p in mcl.parameters() if p.requires_grad]))
    torch.testing.assert_close(results[0], results[1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("loss", ["wta", "relaxed", "annealed"])
@pytest.mark.parametrize("broken", ["base", "one hypothesis"])
@pytest.mark.parametrize("logging_steps, save_steps", [(1, 10), (10, 1)])
def test_a_nan_loss_stops_training_before_a_checkpoint_is_written(tmp_path, logging_steps, save_steps, broken,
                                                                  loss):
    mcl = _model(loss=loss, epsilon=0.1 if loss == "relaxed" else 0.0)
    with torch.no_grad():
        if broken == "base":
            mcl.base_model.model.layers[0].mlp.down_proj.base_layer.weight[0, 0] = float("nan")
        else:  # only hypothesis 1 is broken: the annealed loss used to train the others around it, logging 0.0
            mcl.base_model.model.layers[0].mlp.down_proj.lora_B[1] = float("nan")
    args = _args(tmp_path, max_steps=3, logging_steps=logging_steps, save_strategy="steps", save_steps=save_steps)
    with pytest.raises(FloatingPointError, match="NaN or infinite"):
        MCLTrainer(mcl, args=args, train_dataset=_dataset(16)).train()
    assert not any(tmp_path.glob("checkpoint-*"))


def test_float16_adapters_are_refused_and_float32_adapters_train_a_float16_base_sanely(tmp_path):
    def trained_max_b(base_dtype, adapter_dtype):
        torch.manual_seed(0)
        mcl = get_mcl_model(build_model("llama").to(base_dtype), MCLConfig(
            num_hypotheses=3, r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], loss="annealed",
            adapter_dtype=adapter_dtype))
        MCLTrainer(mcl, args=_args(tmp_path, max_steps=20, learning_rate=1e-3), train_dataset=_dataset(32)).train()
        return max(layer.lora_B.abs().max().item() for _, layer in mcl.mcl_layers())

    # AdamW on float16 adapters: the squared gradients underflow and the updates blow up (|B| 3.8 vs 0.015)
    with pytest.raises(ValueError, match="float16 adapter tensors.*adapter_dtype='float32'"):
        trained_max_b(torch.float16, "base")
    reference = trained_max_b(torch.float32, "float32")
    assert trained_max_b(torch.float16, "float32") == pytest.approx(reference, rel=0.1)
    assert trained_max_b(torch.bfloat16, "base") == pytest.approx(reference, rel=0.1)


def test_examples_without_a_target_are_named_by_dataset_index_before_training(tmp_path):
    import datasets

    data = _dataset(12)
    for i in (5, 9):
        data[i] = {**data[i], "labels": torch.full_like(data[i]["labels"], -100)}
    data[9]["labels"][0] = 7  # a causal LM never predicts the first token: still no target
    mcl = _model(loss="relaxed", epsilon=0.1)
    before = _snapshot(mcl)
    with pytest.raises(ValueError, match=r"train_dataset examples 5, 9 have no label token"):
        MCLTrainer(mcl, args=_args(tmp_path, max_steps=3), train_dataset=data).train()
    assert all(torch.equal(p, before[n]) for n, p in mcl.named_parameters())  # not a single step was taken
    table = datasets.Dataset.from_list([{k: v.tolist() for k, v in row.items()} for row in data])
    with pytest.raises(ValueError, match=r"eval_dataset examples 5, 9 have no label token"):
        MCLTrainer(mcl, args=_args(tmp_path), eval_dataset=table).evaluate()


def _rows_of_different_lengths(n=8, seed=0):
    """The README's rows: input_ids and labels only (-100 on a 2-token prompt), 5 to 9 tokens long."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(3, 80, (5 + i % 5,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100, -100] + ids[2:]})
    return rows


def test_the_readme_trainer_trains_rows_of_different_lengths_without_a_collator(tmp_path):
    from tiny_models import word_tokenizer

    from loramcl.data.prompts import collate

    rows = _rows_of_different_lengths()
    mcl = _model(loss="relaxed", epsilon=0.1)
    trainer = MCLTrainer(mcl, args=_args(tmp_path, max_steps=2), train_dataset=rows, eval_dataset=rows)
    batch = trainer.data_collator(rows[:5])  # right-padded as `loramcl train` pads: the config's id (eos, 2 here)
    expected = collate(rows[:5], pad_token_id=2)
    assert batch.keys() == expected.keys() and all(torch.equal(batch[k], expected[k]) for k in batch)
    with torch.no_grad():  # padding is neither attended to nor predicted: each row's NLL as if alone
        padded = mcl.eval()(**batch).nll
        alone = torch.cat([mcl(**collate([row], pad_token_id=2)).nll for row in rows[:5]])
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=0)
    trainer.train()
    metrics = trainer.evaluate()
    assert trainer.state.global_step == 2 and math.isfinite(metrics["eval_loss"])
    tokenizer = word_tokenizer()  # a tokenizer given: its padding id
    trainer = MCLTrainer(mcl, args=_args(tmp_path), train_dataset=rows, processing_class=tokenizer)
    assert torch.equal(trainer.data_collator(rows[:5])["input_ids"], collate(rows[:5], tokenizer.pad_token_id)[
        "input_ids"])
    mcl.config.eos_token_id = None  # nothing says which id pads: refused, naming the fixes
    trainer = MCLTrainer(mcl, args=_args(tmp_path), train_dataset=rows)
    with pytest.raises(ValueError, match=r"input_ids of different lengths \(5 to 9 tokens\) and no padding id is "
                                         r"known: give MCLTrainer the tokenizer \(processing_class=tokenizer\)"):
        trainer.train()
    collator = MCLTrainer(mcl, args=_args(tmp_path), data_collator=collate).data_collator
    assert collator is collate  # a collator given is kept


def test_best_only_saves_are_published_whole_and_evaluations_that_save_nothing_leave_output_dir_alone(tmp_path):
    """save_strategy="best": the trainer stages each evaluated step's checkpoint before it knows whether it will be
    saved; the steps that save nothing must leave output_dir (and the files) as they were."""
    from checkpoint_train import trainer as checkpoint_trainer

    run = checkpoint_trainer(str(tmp_path), max_steps=4, eval_examples=8, eval_strategy="steps", eval_steps=1,
                             save_strategy="best", metric_for_best_model="eval_loss", greater_is_better=False)
    outputs = []
    run.add_callback(type("Watch", (TrainerCallback,), {"on_log": lambda self, args, *a, **k: outputs.append(
        args.output_dir)})())
    run.train()
    best = [log["eval_loss"] for log in run.state.log_history if "eval_loss" in log]
    saved = [step for step, loss in enumerate(best, 1) if loss < min(best[:step - 1], default=float("inf"))]
    assert sorted(os.listdir(tmp_path)) == sorted(f"checkpoint-{step}" for step in saved)
    assert run.args.output_dir == str(tmp_path) and run.state.best_model_checkpoint == str(tmp_path /
                                                                                             f"checkpoint-{saved[-1]}")
    assert outputs and all(path == str(tmp_path) or "incomplete-" in path for path in outputs)
    assert run.evaluate()["eval_nll_h0"] > 0 and run.predict(run.eval_dataset).metrics["test_win_rate_h0"] >= 0


def test_auto_annealing_reaches_its_floor_within_the_trainers_max_steps(tmp_path):
    mcl = _model(loss="annealed", temperature0=1.0, temperature_min=1e-6, temperature_decay="auto")
    trainer = MCLTrainer(mcl, args=_args(tmp_path, max_steps=10), train_dataset=_dataset(8))
    trainer.train()
    temperatures = [log["temperature"] for log in trainer.state.log_history if "loss" in log]
    rho = 1e-6 ** (1 / 9)  # tau reaches 1e-6 at step ceil(0.9 * 10) = 9
    assert temperatures[:9] == pytest.approx([rho**t for t in range(9)]) and temperatures[9] == 0.0  # then WTA
