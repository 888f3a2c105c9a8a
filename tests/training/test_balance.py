"""MCLTrainer with a balancing bias (MCLConfig.balance="bias") and a staged split (split_after): the bias moves once per
optimizer step from the wins of all its micro-batches, is logged, saved in trainer_state.json and resumed bit-identical;
the staged split trains every hypothesis on every example, then the configured loss, its symmetry break applied exactly
once, across a resume too; `loramcl train --mcl.balance bias --mcl.split_after ...` runs and saves them."""

import json
import math
import shutil

import pytest
import torch
from conftest import randomize_adapters
from tiny_models import build_model, token_rows, word_tokenizer
from transformers import TrainerCallback, TrainingArguments

from loramcl import MCLConfig, MCLTrainer, get_mcl_model
from loramcl.cli import main
from loramcl.mcl.step import hard_wta_at, mcl_step
from loramcl.training import balance
from loramcl.training.balance import BalancingBias, SymmetryBreak, break_symmetry


def _model(num_hypotheses=3, dropout=0.1, randomize=False, **config):
    torch.manual_seed(0)
    mcl = get_mcl_model(build_model("llama"), MCLConfig(num_hypotheses=num_hypotheses, r=4, alpha=8, dropout=dropout,
                                                        target_modules=["q_proj", "v_proj"], **config))
    if randomize:
        randomize_adapters(mcl, std=0.05)
    return mcl


def _args(out, **overrides):
    values = dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=6, learning_rate=1e-2,
                  weight_decay=0.0, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
                  disable_tqdm=True, seed=0, data_seed=0)
    values.update(overrides)
    return TrainingArguments(**values)


def _data(n=24):
    return token_rows(n, 8, 0, prompt=2)


def _batch(rows):
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def _train(out, config, resume=None, callbacks=(), **overrides):
    mcl = _model(**config)
    trainer = MCLTrainer(mcl, args=_args(out, **overrides), train_dataset=_data(), callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _assert_identical(a: MCLTrainer, b: MCLTrainer) -> None:
    got, expected = (t.accelerator.unwrap_model(t.model).adapter_state_dict() for t in (a, b))
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[key], expected[key]) for key in expected)


BIAS = dict(loss="wta", balance="bias", balance_rate=0.05)


def test_off_the_trainer_adds_nothing_and_writes_nothing_new(tmp_path):
    trainer = _train(tmp_path, {}, max_steps=2, save_strategy="steps", save_steps=2)
    assert not any(isinstance(c, BalancingBias | SymmetryBreak) for c in trainer.callback_handler.callbacks)
    assert trainer.log_store.balance_bias is None and trainer.log_store.step_wins is None
    assert not any(key.startswith("bias_h") for log in trainer.state.log_history for key in log)
    state = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert "BalancingBias" not in state["stateful_callbacks"]


def test_the_bias_moves_once_per_optimizer_step_from_the_wins_of_all_its_micro_batches(tmp_path, monkeypatch):
    """Batches of 2, accumulated over 2: each update sees 4 wins summed over both micro-batches, and the logged bias
    after step t is the sum of rate * sign(1/K - share) over the logged shares up to t (float32, as trained)."""
    seen = []
    step = balance.bias_step
    monkeypatch.setattr(balance, "bias_step", lambda wins, rate: (seen.append(wins.clone()), step(wins, rate))[1])
    trainer = _train(tmp_path, BIAS, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    assert [int(wins.sum()) for wins in seen] == [4] * 6
    logs = [log for log in trainer.state.log_history if "loss" in log]
    expected = torch.zeros(3)
    for log, wins in zip(logs, seen, strict=True):
        shares = [log[f"win_rate_h{k}"] for k in range(3)]
        assert [round(4 * share) for share in shares] == wins.tolist()
        expected += 0.05 * torch.sign(torch.tensor([1 / 3 - share for share in shares]))
        assert [log[f"bias_h{k}"] for k in range(3)] == expected.tolist()
    assert torch.equal(trainer.log_store.balance_bias, expected) and expected.abs().sum() > 0


@pytest.mark.parametrize("loss", ["wta", "relaxed"], ids=["two-pass", "stacked"])
def test_the_balancing_bias_resumes_bit_identical_after_a_kill(tmp_path, loss):
    """A run killed after a middle checkpoint resumes, in a new trainer and model, to the same adapters and bias as the run
    that was not interrupted (compared with torch.equal); without the saved bias it would not."""
    config = {**BIAS, "loss": loss, **({"epsilon": 0.1} if loss == "relaxed" else {})}
    straight = _train(tmp_path / "a", config, save_strategy="steps", save_steps=1)
    for step in (2, 3, 4):  # the first middle checkpoint whose bias changes some winners (not 0 nor all equal)
        checkpoint = tmp_path / "a" / f"checkpoint-{step}"
        saved = json.loads((checkpoint / "trainer_state.json").read_text())["stateful_callbacks"]["BalancingBias"]
        if len(set(saved["attributes"]["saved_bias"])) > 1:
            break
    else:
        raise AssertionError("the bias never moved apart")
    resumed = _train(tmp_path / "b", config, resume=str(checkpoint))
    _assert_identical(resumed, straight)
    assert torch.equal(resumed.log_store.balance_bias, straight.log_store.balance_bias)
    # the same checkpoint without its bias (as one written before balancing was on) resumes from a zero bias
    shutil.copytree(checkpoint, tmp_path / "c" / checkpoint.name)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    del state["stateful_callbacks"]["BalancingBias"]
    (tmp_path / "c" / checkpoint.name / "trainer_state.json").write_text(json.dumps(state))
    forgetful = _train(tmp_path / "d", config, resume=str(tmp_path / "c" / checkpoint.name), save_strategy="steps",
                       save_steps=1)  # its checkpoints take the bias up again
    assert not torch.equal(forgetful.log_store.balance_bias, straight.log_store.balance_bias)
    resaved = json.loads((tmp_path / "d" / "checkpoint-6" / "trainer_state.json").read_text())["stateful_callbacks"]
    assert resaved["BalancingBias"]["attributes"]["saved_bias"] == forgetful.log_store.balance_bias.tolist()


def test_trainers_own_callback_restoring_is_refused_with_what_to_do(tmp_path):
    _train(tmp_path / "a", BIAS, max_steps=2, save_strategy="steps", save_steps=2)
    with pytest.raises(ValueError, match="restore_callback_states_from_checkpoint=True rebuilds MCLTrainer's balan"):
        _train(tmp_path / "b", BIAS, resume=str(tmp_path / "a" / "checkpoint-2"), max_steps=4,
               restore_callback_states_from_checkpoint=True)


def test_evaluation_and_the_forward_without_a_bias_ignore_it(tmp_path):
    mcl = _model(randomize=True, **BIAS)
    data = _data(8)
    trainer = MCLTrainer(mcl, args=_args(tmp_path, max_steps=1), train_dataset=data, eval_dataset=data)
    trainer.log_store.balance_bias += torch.tensor([100.0, 0.0, 0.0])  # would hand every training example to h0
    with torch.no_grad():
        nll = mcl.eval()(**_batch(data)).nll
    metrics = trainer.evaluate()
    for k in range(3):
        assert metrics[f"eval_win_rate_h{k}"] == pytest.approx((nll.argmin(dim=1) == k).float().mean().item())
    for two_pass in (True, False):  # the training step, either way, picks the winners less the bias
        outputs = mcl_step(mcl.train(), _batch(data), mcl.mcl_config, balance_bias=trainer.log_store.balance_bias,
                           two_pass=two_pass)
        assert outputs.winners.tolist() == [0] * 8


class _Adapters(TrainerCallback):
    def __init__(self, mcl):
        self.mcl, self.at = mcl, {0: {k: v.clone() for k, v in mcl.adapter_state_dict().items()}}

    def on_step_end(self, args, state, control, **kwargs):
        self.at[state.global_step] = {k: v.clone() for k, v in self.mcl.adapter_state_dict().items()}


def _changed(before, after, k):
    return {key for key in before if not torch.equal(before[key][k], after[key][k])}


def test_the_shared_phase_trains_every_hypothesis_then_two_pass_wta_only_the_winners(tmp_path):
    """K = 4 on 2 examples, loss wta, two-pass on (the default), plain SGD: the first step (split_after 0.5 of 2) is
    the shared phase, which the trainer runs stacked with q = 1/K: every hypothesis moves; the second is hard WTA
    (two-pass), where at most the 2 winners move."""
    mcl = _model(num_hypotheses=4, dropout=0.0, randomize=True, loss="wta", tie_break="lowest", split_after=0.5,
                 split_noise=0.0)
    seen = _Adapters(mcl)
    data = _data(2)
    MCLTrainer(mcl, args=_args(tmp_path, per_device_train_batch_size=2, max_steps=2, optim="sgd"), train_dataset=data,
               callbacks=[seen]).train()
    assert [hard_wta_at(step, mcl.mcl_config, 2) for step in (0, 1)] == [False, True]
    assert all(_changed(seen.at[0], seen.at[1], k) for k in range(4))
    moved = {k for k in range(4) if _changed(seen.at[1], seen.at[2], k)}
    assert 1 <= len(moved) <= 2
    with pytest.raises(ValueError, match="step 0 is in the shared phase of the staged split"):
        mcl_step(mcl.train(), _batch(data), mcl.mcl_config, step=0, total_steps=2, two_pass=True)
    mcl_step(mcl, _batch(data), mcl.mcl_config, step=1, total_steps=2, two_pass=True)  # the configured loss's step


def test_the_symmetry_break_adds_seeded_noise_relative_to_the_rms_of_lora_b():
    mcl = _model(randomize=True, split_after=0.5, split_noise=0.5)
    before = {name: layer.lora_B.detach().clone() for name, layer in mcl.mcl_layers()}
    break_symmetry(mcl, 0.5, seed=3)
    generator = torch.Generator().manual_seed(3)
    for name, layer in mcl.mcl_layers():  # in layer order, one draw of the whole [K, r, d_out] each
        b = before[name]
        expected = b + 0.5 * b.pow(2).mean().sqrt() * torch.randn(b.shape, generator=generator)
        torch.testing.assert_close(layer.lora_B.detach(), expected, rtol=0, atol=1e-7)
        assert not torch.equal(layer.lora_B, b)


@pytest.mark.parametrize("resume_at", [None, 1, 2, 3])
def test_the_symmetry_break_is_applied_exactly_once_across_a_resume(tmp_path, monkeypatch, resume_at):
    """split_after 0.5 of 4 steps: the break comes when step 2 has been taken, before checkpoint-2 is written. A run
    resumed from checkpoint-1 applies it when it gets there; one resumed from checkpoint-2 or -3 has it already."""
    applied = []
    monkeypatch.setattr(balance, "break_symmetry", lambda *args: (applied.append(args), break_symmetry(*args)))
    config = dict(loss="relaxed", epsilon=0.1, split_after=0.5, split_noise=0.5)
    straight = _train(tmp_path / "a", config, max_steps=4, save_strategy="steps", save_steps=1)
    assert len(applied) == 1
    if resume_at is not None:
        applied.clear()
        resumed = _train(tmp_path / "b", config, resume=str(tmp_path / "a" / f"checkpoint-{resume_at}"), max_steps=4)
        assert len(applied) == (1 if resume_at < 2 else 0)
        _assert_identical(resumed, straight)


def test_a_recipe_file_takes_the_options(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text("model: m\nout: o\ndata:\n  train_file: t.jsonl\nmcl:\n  balance: bias\n"
                                       "  balance_rate: 0.02\n  split_after: 0.3\n  split_noise: 0.2\n")
    with pytest.raises(SystemExit):
        main(["train", "--config", str(tmp_path / "run.yaml"), "--print_config"])
    printed = capsys.readouterr().out
    for line in ("balance: bias", "balance_rate: 0.02", "split_after: 0.3", "split_noise: 0.2"):
        assert f"  {line}\n" in printed, printed


def test_loramcl_train_takes_the_options_and_saves_them(tmp_path):
    build_model("llama").save_pretrained(tmp_path / "tiny")
    word_tokenizer().save_pretrained(tmp_path / "tiny")
    rows = [{"prompt": f"w{5 + i}", "target": f"w{40 + i % 3}"} for i in range(8)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(["train", "--model", str(tmp_path / "tiny"), "--out", str(tmp_path / "run"), "--data.train_file",
          str(tmp_path / "train.jsonl"), "--mcl.num_hypotheses", "2", "--mcl.balance", "bias", "--mcl.balance_rate",
          "0.02", "--mcl.split_after", "0.5", "--mcl.split_noise", "0.2", "--training.steps", "4",
          "--training.batch_size", "4", "--training.logging_steps", "1", "--training.warmup_steps", "0",
          "--threads", "1"])
    saved = json.loads((tmp_path / "run" / "mcl_config.json").read_text())["mcl_config"]
    assert (saved["balance"], saved["balance_rate"], saved["split_after"], saved["split_noise"]) == (
        "bias", 0.02, 0.5, 0.2)
    logs = [log for log in json.loads((tmp_path / "run" / "train_log.json").read_text()) if "loss" in log]
    biases = [[log[f"bias_h{k}"] for k in range(2)] for log in logs]
    assert len(biases) == 4 and biases[:2] == [[0.0, 0.0]] * 2  # the shared phase assigns nothing: no update
    moves = [after - before for previous, now in zip(biases[1:], biases[2:]) for before, after in zip(previous, now)]
    assert all(math.isclose(abs(move), 0.02, rel_tol=1e-6) or move == 0 for move in moves)
