"""Does it split? MCLTrainer's specialisation verdict and its collapse warning on a forced collapse, a partial collapse
(one hypothesis at ~5% of the wins) and a healthy split (issue 52); the speed fields of its logs (issue 50)."""

import warnings

import pytest
import torch
from tiny_models import build_model
from transformers import TrainingArguments

from loramcl import MCLConfig, MCLTrainer, get_mcl_model
from loramcl.training.specialisation import CollapseWatch, records_of, verdict
from loramcl.training.throughput import Throughput, flops_per_token, gpu_fields, peak_flops

K3 = MCLConfig(num_hypotheses=3)
# The run: h1 won ~5% and ended at NLL 5.01 against 3.70 / 3.82 (the base model's: ~5.2)
PARTIAL = ([0.48, 0.05, 0.47], [3.70, 5.01, 3.82])
HEALTHY = ([0.34, 0.33, 0.33], [3.10, 3.00, 3.05])
COLLAPSED = ([1.0, 0.0, 0.0], [2.0, 5.2, 5.2])
ORACLE = {id(PARTIAL): 3.40, id(HEALTHY): 2.50, id(COLLAPSED): 2.0}


def _log(step, shares, nll, oracle, initial=None):
    log = {"loss": oracle, "step": step, **{f"win_rate_h{k}": s for k, s in enumerate(shares)},
           **{f"nll_h{k}": v for k, v in enumerate(nll)}, "split_gap": sum(nll) / len(nll) - oracle}
    return log | ({"initial_nll": initial} if initial is not None else {})


def _history(case, steps=60, every=10, start=None):
    """Logs every ``every`` steps: from ``start`` on ``case`` (before it, every hypothesis even and at the base NLL)."""
    shares, nll = case
    logs = []
    for step in range(every, steps + 1, every):
        if start is not None and step <= start:
            logs.append(_log(step, [1 / 3] * 3, [5.0] * 3, 4.9, 5.2 if step == every else None))
        else:
            logs.append(_log(step, shares, nll, ORACLE[id(case)], 5.2 if step == every else None))
    return logs


def test_verdicts_of_a_healthy_split_a_partial_and_a_full_collapse():
    healthy = verdict(records_of(_history(HEALTHY), 3), K3, 30, 0.01)
    assert healthy.kind == "split" and healthy.hypotheses == [] and healthy.steps == [30, 60]
    assert healthy.split_gap == pytest.approx(0.55) and healthy.oracle_nll == pytest.approx(2.5)
    assert "specialisation: split over steps 30-60" in healthy.line and "Try" not in healthy.line
    partial = verdict(records_of(_history(PARTIAL, start=20), 3), K3, 30, 0.01)
    assert partial.kind == "partly collapsed" and partial.hypotheses == [1] and partial.since_step == 20
    assert "h1 (since step 20)" in partial.line and "h1 5.0%" in partial.line and "Try: " in partial.line
    assert "--mcl.loss relaxed (epsilon auto: 0.05" in partial.line and "more steps" in partial.line
    collapsed = verdict(records_of(_history(COLLAPSED), 3), MCLConfig(num_hypotheses=3, tie_break="lowest"), 30, 0.01)
    assert collapsed.kind == "not split" and collapsed.hypotheses == [1, 2] and "h0 won 100.0%" in collapsed.line
    assert "--mcl.tie_break random" in collapsed.line
    same = ([0.34, 0.33, 0.33], [3.02, 3.00, 3.01])  # every hypothesis the same model: a gap of 0.01 of 2.2 gained
    ORACLE[id(same)] = 3.0
    alike = verdict(records_of(_history(same), 3), MCLConfig(num_hypotheses=3, loss="annealed",
                                                              temperature_decay=0.999), 30, 0.01, 0.94)
    assert alike.kind == "not split" and "--mcl.temperature_decay auto (tau was still 0.94" in alike.line
    single = verdict(records_of(_history(HEALTHY), 3), MCLConfig(num_hypotheses=1), 30, 0.01)
    assert single.to_dict() == {"kind": "no verdict", "reason": "one hypothesis (K = 1), nothing to split",
                                "line": "specialisation: no verdict: one hypothesis (K = 1), nothing to split."}
    # relaxed WTA (issue 53's measurements): a partial collapse asks for more epsilon, hypotheses too alike for less
    relaxed = MCLConfig(num_hypotheses=3, loss="relaxed", epsilon=0.1)
    partly = verdict(records_of(_history(PARTIAL, start=20), 3), relaxed, 30, 0.01)
    assert "a larger epsilon than 0.1" in partly.line and "smaller epsilon" not in partly.line
    too_alike = verdict(records_of(_history(same), 3), relaxed, 30, 0.01)
    assert too_alike.kind == "not split" and "a smaller epsilon than 0.1, e.g. --mcl.epsilon 0.05" in too_alike.line
    assert "--mcl.loss relaxed" not in too_alike.line and "annealed MCL" in too_alike.line


def test_the_verdict_says_why_it_abstains():
    """Issue 61: a run of 1-2 steps, or one logging less often than it ran, got no verdict and `specialisation: null`
    in run.json without a word; K = 1 likewise. Each abstention now names its reason, and a verdict's own dict keeps
    the fields it had (no "reason")."""
    assert verdict([], K3, 30, 0.01, steps=3, logging_steps=10).to_dict() == {
        "kind": "no verdict", "reason": "no training step was logged, and the verdict reads the training logs: "
        "logging_steps 10 is more than the run's 3 steps, set --training.logging_steps 3 or less for one",
        "line": "specialisation: no verdict: no training step was logged, and the verdict reads the training logs: "
                "logging_steps 10 is more than the run's 3 steps, set --training.logging_steps 3 or less for one."}
    assert verdict([], K3, 30, 0.01).reason == "no training step was logged, and the verdict reads the training logs"
    for steps in (1, 2, 3):  # one log per step: a 1-step run's only log is its untrained first step
        short = verdict(records_of(_history(COLLAPSED, steps=steps, every=1), 3), K3, 1, 0.01, steps=steps)
        assert short.kind == "no verdict" and short.line.startswith(
            f"specialisation: no verdict: the run took {steps} optimizer step") and "at least 4" in short.line
        assert short.steps is None and short.win_shares is None
    judged = verdict(records_of(_history(COLLAPSED, steps=4, every=1), 3), K3, 2, 0.01, steps=4)
    assert judged.kind == "not split" and set(judged.to_dict()) == {
        "kind", "steps", "win_shares", "nll", "split_gap", "oracle_nll", "hypotheses", "since_step", "line"}


def test_a_run_that_never_reached_its_learning_rate_is_not_told_to_change_its_method():
    """Issue 61: `--training.warmup_steps 100 --training.steps 3` trained at 2% of its rate, and the verdict advised
    annealing and more steps as if the run had trained at it: it now says the rate was never reached instead."""
    shortfall = ("the learning rate never reaches the 0.01 set: warmup_steps 100 outlasts the run's 60 steps, whose "
                 "last trains at 0.0059 (59% of it)")
    for case in (COLLAPSED, PARTIAL):
        judged = verdict(records_of(_history(case, start=20 if case is PARTIAL else None), 3), K3, 30, 0.01,
                         learning_rate_shortfall=shortfall)
        assert judged.kind in ("not split", "partly collapsed")
        assert judged.line.endswith(f" But {shortfall}: train at the rate set (--training.warmup_steps below "
                                    "--training.steps) before changing the method.")
        assert "Try:" not in judged.line and "annealed" not in judged.line and "more steps" not in judged.line
    healthy = verdict(records_of(_history(HEALTHY), 3), K3, 30, 0.01, learning_rate_shortfall=shortfall)
    assert healthy.kind == "split" and "never reaches" not in healthy.line  # a split is a split


def _watched(history, window=100):
    watch, said = CollapseWatch(window, 0.01), []
    for log in history:
        message = watch.observe(log["step"], log, "wta")
        if message:
            said.append((log["step"], message))
    return said


def test_the_collapse_warning_catches_a_partial_collapse_early_and_no_healthy_run():
    said = _watched(_history(PARTIAL, steps=200))
    assert [step for step, _ in said] == [30]  # once, after a quarter of the 100-step window, not after 100
    assert "h1 (5.0%, NLL 5.010)" in said[0][1] and "partial collapse" in said[0][1]
    # a healthy run whose first steps went to h0 (every tie to the lowest k), then evened out
    start = [_log(10, [0.96, 0.02, 0.02], [5.19, 5.2, 5.2], 5.19, 5.2)]
    assert _watched(start + _history(HEALTHY, steps=200)[1:]) == []
    full = _watched(_history(COLLAPSED, steps=200))
    assert len(full) == 1 and "h1 (0.0%" in full[0][1] and "h2 (0.0%" in full[0][1]


def _rows(n=32):
    """One prompt, two answers: half the rows end in w20..w23, half in w40..w43 (two modes for K = 2 to take)."""
    rows = []
    for i in range(n):
        ids = torch.tensor([5, 6, 7] + ([20, 21, 22, 23] if i % 2 else [40, 41, 42, 43]))
        labels = ids.clone()
        labels[:3] = -100
        rows.append({"input_ids": ids, "attention_mask": torch.ones(7, dtype=torch.long), "labels": labels})
    return rows


def _trained(tmp_path, rows, **config):
    torch.manual_seed(0)
    mcl = get_mcl_model(build_model("llama"), MCLConfig(num_hypotheses=2, r=4, alpha=8, **config,
                                                        target_modules=["q_proj", "v_proj", "down_proj"]))
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=20,
                             learning_rate=2e-2, report_to=[], use_cpu=True, save_strategy="no", logging_steps=4,
                             disable_tqdm=True, seed=0, data_seed=0)
    trainer = MCLTrainer(mcl, args=args, train_dataset=rows, collapse_window=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return trainer, [str(w.message) for w in caught if "hypothesis collapse" in str(w.message)]


def test_a_real_split_and_a_real_collapse_get_their_verdicts(tmp_path):
    split, warned = _trained(tmp_path, _rows())
    assert split.specialisation.kind == "split" and warned == []
    assert split.specialisation.win_shares == [0.5, 0.5]
    assert split.state.log_history[-1] == {"step": 20, "specialisation": split.specialisation.to_dict()}
    # one mode (one row repeated) and ties to the lowest k: h0 wins every example and h1 never trains
    collapsed, warned = _trained(tmp_path, _rows()[:1] * 32, tie_break="lowest")
    assert collapsed.specialisation.kind == "not split" and collapsed.specialisation.hypotheses == [1]
    assert len(warned) == 1 and "h1 (0.0%" in warned[0]


def test_the_trainer_judges_a_partial_collapse_from_its_own_sums(tmp_path):
    """The trainer's path (sums on the device -> logs -> warning -> verdict) on a run where h1 wins 5% of the examples
    with an NLL that stays near the base model's: 20 examples per step, h1 winning one."""
    torch.manual_seed(0)
    mcl = get_mcl_model(build_model("llama"), MCLConfig(num_hypotheses=3, r=4, target_modules=["q_proj"]))
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=60)
    trainer = MCLTrainer(mcl, args=args, collapse_window=100)
    trainer.state.max_steps = 60
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(10, 61, 10):
            trainer.log_store.wins += torch.tensor([95, 10, 95])  # 200 examples over 10 steps
            trainer.log_store.nll += torch.tensor([3.70, 5.01, 3.82]) * 200
            trainer.log_store.oracle += 3.40 * 200
            if step == 10:
                trainer.log_store.initial_nll += torch.tensor([5.2 * 20, 20])
            trainer.state.global_step = step
            trainer.log({"loss": 3.5})
        trainer._judge_specialisation()
    assert [str(w.message) for w in caught if "partial collapse" in str(w.message)]
    assert trainer.specialisation.kind == "partly collapsed" and trainer.specialisation.hypotheses == [1]
    assert trainer.state.log_history[0]["initial_nll"] == pytest.approx(5.2)
    assert trainer.state.log_history[-1]["specialisation"]["kind"] == "partly collapsed"


def test_speed_fields_count_the_batchs_tokens_and_read_gpu_memory_once_per_log(monkeypatch):
    throughput = Throughput(torch.device("cpu"), flops_per_token=10.0)
    batch = {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 1, 0],
                                                                                              [1, 1, 0, 0]]),
             "labels": torch.tensor([[-100, 5, 6, -100], [-100, 7, -100, -100]])}
    throughput.on_step_begin(None, type("State", (), {"global_step": 0})(), None)
    for _ in range(2):
        throughput.count(batch)
    assert throughput.counts.tolist() == [6, 10]  # labelled tokens, all tokens
    fields = throughput.logs(2, lambda total: total)
    assert fields["tokens_per_second"] / fields["labelled_tokens_per_second"] == pytest.approx(10 / 6)
    assert fields["step_time"] > 0 and "peak_allocated_gb" not in fields  # no GPU here: no memory fields
    assert throughput.counts.tolist() == [0, 0]
    # a GPU, its memory functions standing in: the peaks since the last log, then reset; MFU against a known peak
    calls = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 52.8e9)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 76.0e9)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: calls.append(device))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    gpu = gpu_fields(torch.device("cuda", 0), 2.0, 989.4e12)
    assert gpu == {"peak_allocated_gb": 52.8, "peak_reserved_gb": 76.0, "mfu": pytest.approx(0.5)}
    assert calls == [torch.device("cuda", 0)]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 NVL")
    assert "mfu" not in gpu_fields(torch.device("cuda", 0), 2.0, 1e12)  # no peak known: no guess
    assert peak_flops("NVIDIA H200") == peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12 and peak_flops("Tesla T4") is None
    assert flops_per_token(100, 3, two_pass=True) == 1200 and flops_per_token(100, 3, two_pass=False) == 1800
    assert flops_per_token(100, 1, two_pass=True) == 600
