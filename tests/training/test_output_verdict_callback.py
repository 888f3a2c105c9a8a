"""The output verdict while training (issue 64): OutputVerdictCallback on a tiny Llama, and `loramcl train
--training.output_verdict`."""

import json
import sys

import pytest
import torch
from conftest import randomize_adapters
from tiny_models import build_batch, build_model, save_tiny_run_inputs, word_tokenizer
from transformers import TrainingArguments

from loramcl import MCLConfig, MCLTrainer, get_mcl_model
from loramcl.analysis.outputs import mode_classifier
from loramcl.cli import main
from loramcl.training.outputs import OutputVerdictCallback


def _rows(prompts=6, modes=("a", "b")):
    """Two references per prompt (one per mode), each an example: prompt w{5+i} w20, target w40 w{60+m} </s>."""
    tokenizer = word_tokenizer()
    rows = []
    for i in range(prompts):
        for m, mode in enumerate(modes):
            prompt = tokenizer(f"w{5 + i} w20")["input_ids"]
            target = tokenizer(f"w40 w{60 + 10 * m}")["input_ids"] + [tokenizer.eos_token_id]
            rows.append({"input_ids": torch.tensor(prompt + target), "labels": torch.tensor([-100] * 2 + target),
                         "attention_mask": torch.ones(len(prompt + target), dtype=torch.long), "mode": mode,
                         "id": f"p{i}"})  # metadata: no input of another modality
    return rows


def _trainer(tmp_path, model="llama", rows=None, steps=2, learning_rate=1e-2, eval_dataset=None, **args):
    torch.manual_seed(0)
    targets = ["q", "v"] if model == "t5" else ["q_proj", "v_proj"]
    mcl = get_mcl_model(build_model(model), MCLConfig(num_hypotheses=2, r=4, alpha=8, target_modules=targets))
    arguments = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=steps,
                                  learning_rate=learning_rate, report_to=[], use_cpu=True, save_strategy="no",
                                  logging_steps=1, disable_tqdm=True, seed=0, remove_unused_columns=False, **args)
    trainer = MCLTrainer(mcl, args=arguments, train_dataset=rows if rows is not None else _rows(),
                         eval_dataset=eval_dataset)
    callback = OutputVerdictCallback(trainer, prompts=4, tokenizer=word_tokenizer(), min_examples=0)
    trainer.add_callback(callback)
    return trainer, callback


def test_identical_hypotheses_write_the_same(tmp_path):
    """Fresh adapters (B = 0) that do not move (learning rate 0): every hypothesis is the base model."""
    trainer, callback = _trainer(tmp_path, learning_rate=0.0)
    trainer.train()
    found = callback.verdict
    assert found.kind == "write the same" and found.same_rate == 1.0 and found.distinct == 1.0
    assert "Try:" in found.line and "--mcl.shared_r" in found.line
    assert trainer.state.log_history[-1] == {"step": 2, "outputs": found.to_dict()}
    logged = next(log for log in trainer.state.log_history if "outputs_distinct" in log)
    assert logged["outputs_same_rate"] == 1.0 and logged["outputs_best_of_k"] >= logged["outputs_mean_over_k"]
    lines = [json.loads(line) for line in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and lines[0]["step"] == 2 and len(lines[0]["answers"]) == 2
    assert lines[0]["references"] == ["w40 w60", "w40 w70"] and lines[0]["modes"] == ["a", "b"]  # grouped by prompt


def test_different_adapters_differ_and_the_mode_column_gives_a_table(tmp_path, monkeypatch):
    from loramcl.training import outputs

    fitted = []  # the references and modes each mode classifier was fit on
    monkeypatch.setattr(outputs, "mode_classifier", lambda refs, modes: fitted.append((refs, modes)) or
                        mode_classifier(refs, modes))
    trainer, callback = _trainer(tmp_path, learning_rate=0.0)
    randomize_adapters(trainer.model, std=1.0)
    trainer.train()
    found = callback.verdict
    assert found.kind in ("differ", "split by mode") and found.same_rate < 0.5
    assert found.modes[:2] == ["a", "b"] and len(found.mode_table) == 2 and len(found.purity) == 2
    # an answer far from its references gets its mode from a classifier fit once on every prompt read (6), not only
    # on the 4 decoded
    assert len(fitted) == 1  # once, for every decoding
    references, modes = fitted[0]
    assert len(references) == 6 and len(callback._sample.references) == 4 and modes[0] == ["a", "b"]
    assert callback._sample.classifier.labels == ["a", "b"]


def test_decoding_changes_no_adapter_and_an_evaluation_at_the_last_step_is_decoded_once(tmp_path):
    adapters = {}
    for verdict in (False, True):
        trainer, callback = _trainer(tmp_path / str(verdict), steps=4, eval_dataset=_rows(3), eval_strategy="steps",
                                     eval_steps=2)
        if not verdict:
            trainer.remove_callback(callback)
        trainer.train()
        adapters[verdict] = trainer.model.adapter_state_dict()
    assert all(torch.equal(adapters[False][name], value) for name, value in adapters[True].items())
    steps = [log["step"] for log in trainer.state.log_history if "outputs_distinct" in log]
    assert steps == [2, 4]  # the evaluations; the end of training (step 4) reuses the last one
    assert len((tmp_path / "True" / "outputs.jsonl").read_text().splitlines()) == 2 * 3  # the validation's prompts


def test_the_answers_reach_the_loggers_that_keep_tables(tmp_path, monkeypatch):
    """As TRL's completion logging: Weights & Biases and Comet get the whole table at each decoding, MLflow the new
    rows (its log_table appends); a logger without an active run gets none. The packages are stand-ins: they record
    the calls of their public API that the callback makes."""
    import types

    calls = {"wandb": [], "comet_ml": [], "mlflow": []}
    wandb = types.SimpleNamespace(run=object(), Table=lambda columns, data: (columns, [list(r) for r in data]),
                                  log=lambda values: calls["wandb"].append(values["outputs"]))
    experiment = types.SimpleNamespace(log_table=lambda filename, tabular_data, headers: calls["comet_ml"].append(
        (filename, headers, [list(r) for r in tabular_data])))
    comet = types.SimpleNamespace(get_running_experiment=lambda: experiment)
    mlflow = types.SimpleNamespace(active_run=lambda: None,
                                   log_table=lambda data, artifact_file: calls["mlflow"].append((artifact_file, data)))
    for name, module in (("wandb", wandb), ("comet_ml", comet), ("mlflow", mlflow)):
        monkeypatch.setitem(sys.modules, name, module)
    trainer, callback = _trainer(tmp_path, steps=4, eval_dataset=_rows(3), eval_strategy="steps", eval_steps=2)
    trainer.args.report_to = ["wandb", "comet_ml", "mlflow"]  # set after Trainer built its own logging callbacks
    trainer.train()
    columns = ["step", "prompt", "reference", "h0", "h1"]
    assert [len(rows) for _, rows in calls["wandb"]] == [3, 6] and calls["wandb"][1][0] == columns
    first, second = (rows for _, rows in calls["wandb"])
    assert second[:3] == first and {row[0] for row in first} == {"2"} and {row[0] for row in second[3:]} == {"4"}
    assert sorted(row[1:3] for row in first) == [["w5 w20", "w40 w60"], ["w6 w20", "w40 w60"], ["w7 w20", "w40 w60"]]
    assert calls["comet_ml"] == [("outputs.csv", columns, rows) for _, rows in calls["wandb"]]
    assert calls["mlflow"] == []  # no active run
    mlflow.active_run = object
    callback.table, callback._last = [], None
    callback.on_train_end(trainer.args, trainer.state, trainer.control)
    callback._last = None
    callback.on_train_end(trainer.args, trainer.state, trainer.control)
    assert [file for file, _ in calls["mlflow"]] == ["outputs.json"] * 2
    assert all(list(data) == columns and len(data["h0"]) == 3 for _, data in calls["mlflow"])  # the new rows only


def test_no_verdict_before_the_minimum_of_examples(tmp_path):
    trainer, callback = _trainer(tmp_path)
    callback.min_examples = None  # the default: 100 per hypothesis
    trainer.train()
    assert callback.verdict.kind == "no verdict" and callback.verdict.line.startswith(
        "outputs: no verdict: 8 training examples seen, fewer than 200 (100 per hypothesis)")
    assert "outputs" not in trainer.state.log_history[-1]  # as the NLL verdict, an abstention adds no entry


def _audio_rows(clips=2, modes=("a", "b")):
    """Qwen2-Audio examples: per clip (its features and a prompt of audio tokens), one target per mode."""
    inputs, _ = build_batch("qwen2_audio", None, batch=clips)
    prompt = inputs["input_ids"].shape[1] - 5
    rows = []
    for b in range(clips):
        for m, mode in enumerate(modes):
            target = torch.tensor([40 + 10 * m, 41, 42, 2])
            rows.append({"input_ids": torch.cat([inputs["input_ids"][b, :prompt], target]),
                         "attention_mask": torch.ones(prompt + 4, dtype=torch.long),
                         "labels": torch.cat([torch.full((prompt,), -100), target]), "mode": mode,
                         "input_features": inputs["input_features"][b],
                         "feature_attention_mask": inputs["feature_attention_mask"][b]})
    return rows


@pytest.mark.parametrize("model", ["qwen2_audio", "t5", "whisper"])
def test_audio_and_encoder_decoder_models_are_decoded_one_prompt_at_a_time(tmp_path, model):
    """A prompt with other inputs than text (a clip's features) or an encoder-decoder's source: one prompt per
    distinct inputs, its examples' references pooled, batched by the trainer's collator and decoded alone."""
    clips = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))
    rows = _audio_rows() if model == "qwen2_audio" else [
        {"input_ids": torch.tensor([5 + i, 6, 2]), "labels": torch.tensor([40 + 10 * m, 60, 2]), "mode": mode}
        if model == "t5" else {"input_features": clips[i], "labels": torch.tensor([40 + 10 * m, 60, 2]), "mode": mode}
        for i in range(2) for m, mode in enumerate("ab")]
    trainer, callback = _trainer(tmp_path, model=model, rows=rows)
    callback.on_train_end(trainer.args, trainer.state, trainer.control)  # no training needed
    found = callback.verdict
    assert found.kind != "no verdict" and found.prompts == 2 and found.hypotheses == 2
    assert found.modes[:2] == ["a", "b"] and callback._sample.inputs is not None
    lines = [json.loads(line) for line in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["references"] == (
        ["w40 w41 w42", "w50 w41 w42"] if model == "qwen2_audio" else ["w40 w60", "w50 w60"])
    if model == "t5":
        assert lines[0]["prompt"] == "w5 w6"  # the source: copies of it are counted


def test_a_prompt_that_cannot_be_decoded_gets_no_verdict_and_a_reason(tmp_path):
    """Inputs the model's generate does not take, or a collator that needs the labels: no verdict, training goes on."""
    rows = [row | {"pixel_values": torch.zeros(3, 4, 4)} for row in _rows(2)]  # a text model given pixels
    trainer, callback = _trainer(tmp_path, rows=rows)
    callback.on_train_end(trainer.args, trainer.state, trainer.control)
    assert callback.verdict.kind == "no verdict" and callback.verdict.reason.startswith(
        "generate does not take this prompt's inputs (attention_mask, input_ids, pixel_values")
    assert not (tmp_path / "outputs.jsonl").exists()
    encoded = [{"encoder_states": torch.zeros(4, 8), "labels": row["labels"], "input_ids": row["input_ids"]}
               for row in _rows(2)]  # a recipe's collator of precomputed states: it needs the labels
    trainer, callback = _trainer(tmp_path / "encoded", rows=encoded)
    trainer.data_collator = lambda batch: {"encoder_states": torch.stack([r["encoder_states"] for r in batch]),
                                           "labels": torch.stack([r["labels"] for r in batch])}
    callback.on_train_end(trainer.args, trainer.state, trainer.control)
    assert "the trainer's data_collator cannot batch a prompt without its labels (KeyError('labels'))" in \
        callback.verdict.reason


def test_train_writes_the_verdict_beside_the_nll_verdict(tmp_path, capsys):
    root = save_tiny_run_inputs(tmp_path, 24)
    rows = [json.loads(line) | {"mode": "ab"[i % 2]} for i, line in
            enumerate((root / "train.jsonl").read_text().splitlines())]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(["train", "--model", str(root / "base"), "--out", str(root / "run"), "--data.train_file",
          str(root / "train.jsonl"), "--mcl.r", "4", "--mcl.target_modules", "[q_proj, v_proj]", "--training.steps",
          "4", "--training.batch_size", "8", "--training.logging_steps", "2", "--training.output_verdict", "3",
          "--threads", "1"])
    run = json.loads((root / "run" / "run.json").read_text())
    assert run["outputs"]["kind"] == "no verdict" and run["outputs"]["reason"].startswith("32 training examples seen")
    assert run["outputs"]["prompts"] == 3 and run["outputs"]["modes"] == ["a", "b"]
    assert "specialisation" in run and run["settings"]["training"]["output_verdict"] == 3
    assert len((root / "run" / "outputs.jsonl").read_text().splitlines()) == 3
    assert run["outputs"]["line"] in " ".join(capsys.readouterr().out.split())


def test_the_setting_changes_no_run(tmp_path):
    """Off, run.json's settings are written as before it existed; on, the run's stamp is the same (it changes no
    adapter) and checkpoints trained without it resume with it."""
    from loramcl import TrainConfig
    from loramcl.training.runs import SETTINGS_NAME, run_settings, settings_stamp, stale_checkpoint_fields

    config = MCLConfig(num_hypotheses=2)
    without = run_settings("model", config, None, TrainConfig(), "float32")
    on = run_settings("model", config, None, TrainConfig(output_verdict=16, mode_column="language"), "float32")
    assert "output_verdict" not in without["training"] and "mode_column" not in without["training"]
    assert on["training"]["output_verdict"] == 16 and settings_stamp(on) == settings_stamp(without)
    (tmp_path / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    (tmp_path / "checkpoints" / SETTINGS_NAME).write_text(json.dumps(without))
    assert stale_checkpoint_fields(tmp_path, on) == []
    with pytest.raises(ValueError, match=r"output_verdict \(prompts decoded; 0: off\) must be an integer >= 0"):
        TrainConfig(output_verdict=-1)


def test_each_example_gets_the_mode_of_its_reference(tmp_path):
    """A row of several references names one mode per reference (a list) or one for the row."""
    from loramcl import DataConfig
    from loramcl.training.fit import training_examples, training_rows
    from loramcl.training.outputs import example_modes

    rows = [{"prompt": "w5 w20", "references": ["w40", "w41 w42"], "mode": ["a", "b"]},
            {"prompt": "w6", "references": ["w43"], "mode": "c"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(train_file=str(tmp_path / "train.jsonl"))
    examples = training_examples(training_rows(data.train_file, data, "training file"), data.train_file, data,
                                 word_tokenizer(), False, mode_column="mode")
    assert examples["mode"] == ["a", "b", "c"] and examples.column_names == ["input_ids", "labels", "mode"]
    without = training_examples(training_rows(data.train_file, data, "training file"), data.train_file, data,
                                word_tokenizer(), False)
    assert without.column_names == ["input_ids", "labels"]  # off: the examples of before
    with pytest.raises(ValueError, match="row 1: mode lists 1 modes for more references"):
        example_modes([["a"]], [0, 0], "mode", lambda i: f"row {i + 1}")
