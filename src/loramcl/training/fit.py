"""`loramcl train`: fine-tune K LoRA hypotheses (or a baseline: LoRA-MoE, multi-head MCL) on a local dataset file in
one of TRL's formats (docs/guide/data.md);
``fit``, the training stage of `loramcl train` and of every recipe.

``train``'s signature and docstring are its CLI (jsonargparse); `--config recipe.yaml` reads the same arguments from
a file, its paths relative to it (the packaged recipes, `--config bilingual/common.yaml`, are read relative to the
current folder: docs/guide/cli.md). torch and transformers load inside the functions, after the files, their fields
and the model folder are checked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Literal

from loramcl.baselines.config import MoEConfig, MultiHeadConfig
from loramcl.mcl.config import MCLConfig, saved_values
from loramcl.training.config import DataConfig, TrainConfig
from loramcl.training.runs import (
    CHECKPOINTS,
    SETTINGS_NAME,
    quantization_settings,
    run_settings,
    run_stamp,
    settings_stamp,
    stale_checkpoint_fields,
)
from loramcl.utils.files import read_json, write_json
from loramcl.utils.inputs import (
    MCL_CONFIG,
    RUN_RECORD,
    Dtype,
    LocalPath,
    ModelPath,
    PositionLimits,
    Quantization,
    check_model_options,
    check_output,
    is_encoder_decoder,
    model_positions,
)
from loramcl.utils.run_best import STAMP
from loramcl.utils.threads import check_threads, use_threads
from loramcl.utils.validate import OptionError

# No `if TYPE_CHECKING: import torch` here: jsonargparse runs such blocks to resolve the commands' annotations, which
# would import torch before every `loramcl train` / `nll` could check its files (tests/test_cli.py).
METHODS = ("mcl", "moe", "multihead")  # LoRA-MCL (K = 1: LoRA-MLE), LoRA-MoE, multi-head MCL
# `loramcl train`'s --mcl block: MCLConfig's defaults (the paper's) but for two measured choices for a first try.
# Relaxed WTA with epsilon 'auto' (AUTO_EPSILON for K >= 2; none for another loss or K = 1): the defaults study (issue
# 53, docs/benchmarks.md "Which defaults split on a first try": three tasks, 60 steps of 16 on SmolLM2-135M, two
# seeds) left one hypothesis idle (under 1% of the wins) in 4 of 6 vanilla-WTA runs and in none of 12 relaxed ones,
# which covered as many or more of the data's modes. An annealed run's temperature decay fitted to the run's length
# (issue 52: a first try is too short for the paper's 0.999 to leave the soft regime). Kept by the study across
# budgets (issue 64, docs/benchmarks.md "Measured: 60, 200 and 600 steps"): vanilla WTA with the balancing bias at 0.1
# matched or beat it where the modes are of equal size (5 of 6 task-budget cells), but it pushes every hypothesis
# toward 1/K of the wins, and on Markov chains drawn 60/30/10 it took the rare chain's hypothesis away (2.17 chains of
# 3 against 3.00 on two seeds, beam search of one LoRA 2.00): a rare mode, which beam search leaves out, is MCL's case.
COMMAND_MCL = MCLConfig(loss="relaxed", epsilon="auto", temperature_decay="auto")
MethodConfig = MCLConfig | MoEConfig | MultiHeadConfig
logger = logging.getLogger(__name__)  # a run's progress, which `loramcl <command>` shows (docs/guide/cli.md)


def method_config(method: str, mcl: MCLConfig | None, moe: MoEConfig | None,
                  multihead: MultiHeadConfig | None) -> MethodConfig:
    """The configuration of the trained method: no other method's block may be given, and a baseline's own must be;
    LoRA-MCL's defaults to COMMAND_MCL (the `--mcl` block of the command line always holds one: a block of other
    values than those defaults, with another method, is refused)."""
    given = {"mcl": mcl if mcl is not None else COMMAND_MCL, "moe": moe, "multihead": multihead}
    if method not in given:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    others = [name for name, config in given.items()
              if name != method and config is not None and not (name == "mcl" and config == COMMAND_MCL)]
    if others:
        raise ValueError(f"--{others[0]}.* configures method '{others[0]}' but method is '{method}': set --method "
                         f"{others[0]} (method: {others[0]} in a recipe), or remove the {others[0]} block")
    if given[method] is None:
        raise ValueError(f"method '{method}' needs its configuration: --{method}.* options (a `{method}:` block in "
                         "a recipe)")
    return given[method]


def method_model(base, method: str, config: MethodConfig):
    """The trainable model of ``method`` on ``base`` (modified in place), its adapters' size checked first against
    the memory training needs (weights, gradients, AdamW state)."""
    from loramcl.mcl.adapter_size import check_adapter_size
    from loramcl.mcl.build import target_layer_names

    if method == "moe":
        from loramcl.baselines.moe import get_moe_model

        check_adapter_size(base, target_layer_names(base, config.mle_config()), config, training=True)
        return get_moe_model(base, config)
    if method == "multihead":
        from loramcl.baselines.multihead import duplicated_module, get_multihead_model
        from loramcl.mcl.adapter_size import check_heads_size

        check_heads_size(duplicated_module(base, config), config, training=True)
        return get_multihead_model(base, config)
    from loramcl.mcl.build import get_mcl_model

    check_adapter_size(base, target_layer_names(base, config), config, training=True)
    return get_mcl_model(base, config)


def train(
    model: ModelPath,
    out: LocalPath,
    data: DataConfig,
    mcl: MCLConfig = COMMAND_MCL,
    training: TrainConfig = TrainConfig(),  # noqa: B008 (frozen, so sharing it is safe)
    method: Literal["mcl", "moe", "multihead"] = "mcl",
    moe: MoEConfig | None = None,
    multihead: MultiHeadConfig | None = None,
    resume: bool = False,
    threads: int | None = None,
    dtype: Dtype = "float32",
    scores_for: LocalPath | None = None,
    quantization: Quantization | None = None,
) -> str:
    """Fine-tune LoRA hypotheses with MCLTrainer (K = 1: LoRA-MLE), or a LoRA-MoE or multi-head MCL baseline.

    --mcl (MCLConfig) sets the hypotheses; the paper's other trained baselines go through the same trainer: LoRA-MoE
    (--method moe) or multi-head MCL (--method multihead).

    Writes to `out`: the adapters and tokenizer (MCLModel.save_pretrained: load with `--adapters OUT` in `loramcl
    generate`), `peft/` for K = 1 (a standard PEFT LoRA adapter, for single-model decoders such as diverse beam
    search), `checkpoints/` (the last `training.keep_checkpoints` resumable checkpoints, every
    `training.save_every` steps), `train_log.json` (every logged loss, win rate, training NLL per hypothesis, speed and
    validation NLL, then the verdict on the hypotheses' specialisation) and `run.json` (the settings and their stamp,
    threads, trainable parameters, seconds, the verdict or why there is none), written last: a run with a run.json
    is finished.

    A causal LM reads prompt + target and learns the target tokens; an encoder-decoder (T5, BART, Marian, NLLB...)
    reads the prompt in its encoder and learns the target as its labels (docs/guide/cli.md).

    Args:
        model: local folder of a causal or sequence-to-sequence LM (transformers format).
        out: output folder.
        mcl: the hypotheses and loss of method mcl (default: K = 2 hypotheses of rank 8 with vanilla WTA on PEFT's
            default layers; an annealed loss's temperature_decay is 'auto', fitted to the run's steps).
        data: the training data (a local JSONL, JSON, Parquet, CSV, Arrow file or save_to_disk folder: prompt/
            completion, conversations, messages, text or several references per prompt) and their tokenization
            (--data.train_file, --data.validation_file, ...).
        training: optimisation, evaluation and checkpoint schedule (--training.steps, --training.learning_rate, ...).
        method: what is trained: mcl (LoRA-MCL, the --mcl block), moe (LoRA-MoE: E LoRA experts mixed by a per-token
            router, trained with plain NLL; the --moe block) or multihead (multi-head MCL: one module duplicated K
            times; the --multihead block).
        moe: LoRA-MoE's experts and router (--moe.num_experts, --moe.r, --moe.target_modules, ...); method moe.
        multihead: the duplicated module, its initialisation and the loss (--multihead.module, --multihead.init,
            --multihead.num_hypotheses, --multihead.loss, ...); method multihead.
        resume: continue from the newest checkpoint in `out` (an interrupted run resumes exactly where it stopped);
            refused if those checkpoints were trained with other settings. Without it, an `out` holding
            checkpoints is refused, so that no run is overwritten by mistake.
        threads: torch CPU threads (default: the cores that are free when the command starts).
        dtype: the frozen model's dtype: float32, bfloat16 or float16 (adapters stay float32 by default).
        scores_for: a finished LoRA-MCL run (its `out`) whose hypothesis scores p(k | c) are to be learned: its
            hypotheses are loaded and stay frozen, and only a scoring head is trained (docs/guide/scores.md); the run's
            own MCL settings are used (leave --mcl out; --training.scoring_learning_rate sets the head's rate).
        quantization: the frozen model quantized as it loads (QLoRA-MCL; docs/guide/quantization.md): nf4 or fp4
            (bitsandbytes 4-bit, double quantization, computing in --dtype), int8 (bitsandbytes LLM.int8) or
            torchao-int8 (torchao int8 weight-only). Decode the adapters on the same quantized base.
    """
    from loramcl.data.prompts import collate, pad_token_id

    # Mistakes in the files, their fields and the model folder are reported before torch loads (seconds).
    check_model_options(model, dtype)
    check_output(out, folder=True)
    check_threads(threads)
    check_max_length(data.max_length, model_positions(model))
    encoder_decoder = is_encoder_decoder(model)
    train_rows = training_rows(data.train_file, data, "training file")
    eval_rows = training_rows(data.validation_file, data, "validation file") if data.validation_file else None

    from transformers import AutoTokenizer

    from loramcl.models.load import training_model_loader

    if scores_for is not None:
        config = _scored_run_config(scores_for, method, mcl)
        settings = run_settings(model, config, data, training, dtype, method) | {
            "scores_for": str(scores_for), "scores_for_run": run_stamp(Path(scores_for))}
    else:
        config = method_config(method, mcl, moe, multihead)
        settings = run_settings(model, config, data, training, dtype, method)
    settings |= quantization_settings(quantization)
    last = resumable_checkpoint(out, settings, resume)
    use_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model)
    pad_id = pad_token_id(tokenizer)
    modes = training.mode_column if training.output_verdict else None  # the column the output verdict reads
    train_set = training_examples(train_rows, data.train_file, data, tokenizer, encoder_decoder, mode_column=modes)
    eval_set = (training_examples(eval_rows, data.validation_file, data, tokenizer, encoder_decoder,
                                  data.eval_examples, modes) if eval_rows is not None else None)
    fit(training_model_loader(model, dtype, quantization), out, config, training, settings, train_set, eval_set,
        collator=lambda rows: collate(rows, pad_id), processor=tokenizer, last_checkpoint=last, method=method,
        scores_for=scores_for)
    return str(out)


def check_max_length(max_length: int, limits: PositionLimits) -> None:
    """``data.max_length`` tokens (a causal LM: prompt and target together; an encoder-decoder: each) fit the
    model's positions."""
    known = [limit for limit in (limits.prompt, limits.target) if limit is not None]
    if known and max_length > min(known):
        raise OptionError("max_length", f"max_length {max_length} is more than the {min(known)} positions the model "
                          f"reads ({limits.source}): set --data.max_length {min(known)} or less", owner=DataConfig)


def _scored_run_config(run: str, method: str, mcl: MCLConfig | None) -> MCLConfig:
    """The MCLConfig of the finished LoRA-MCL run ``run``, with hypothesis scores on (``train(scores_for=run)``)."""
    if method != "mcl" or mcl not in (None, COMMAND_MCL):
        raise ValueError("scores_for learns the scores of a finished LoRA-MCL run with that run's own settings: "
                         "leave out --mcl.* and --method")
    record = Path(run) / MCL_CONFIG
    if not (Path(run) / RUN_RECORD).is_file() or not record.is_file():
        raise FileNotFoundError(f"scores_for: {run} is not a finished LoRA-MCL run (no {RUN_RECORD} and "
                                f"{MCL_CONFIG}): give the `out` folder of a finished `loramcl train`")
    saved = read_json(record, "it was damaged or edited: train the run again, or restore the file")
    if saved.get("method", "mcl") != "mcl" or "mcl_config" not in saved:
        raise ValueError(f"scores_for: {run} holds a {saved.get('method')!r} model; scores are learned for LoRA-MCL "
                         "hypotheses")
    config = MCLConfig.from_dict(saved_values(saved["mcl_config"]))
    if config.num_hypotheses < 2:
        raise ValueError(f"scores_for: {run} has one hypothesis; scores rank K >= 2 hypotheses")
    return replace(config, scoring=True)


def resumable_checkpoint(out: str | Path, settings: dict, resume: bool) -> str | None:
    """The checkpoint a run with ``settings`` continues from (None: start afresh), checked before any work: an `out`
    holding checkpoints is refused without ``resume`` (no run is overwritten by mistake), and so are checkpoints
    trained with other settings."""
    from transformers.trainer_utils import get_last_checkpoint

    checkpoints = Path(out) / CHECKPOINTS
    last = get_last_checkpoint(str(checkpoints)) if checkpoints.is_dir() else None
    if last is not None and not resume:
        raise ValueError(f"{out} already holds checkpoints of a training run ({Path(last).name}): pass --resume "
                         f"true to continue it, or choose another --out (or delete {checkpoints})")
    stale = stale_checkpoint_fields(out, settings)
    if last is not None and stale:
        raise ValueError(f"the checkpoints in {checkpoints} were trained with other settings ({', '.join(stale)} "
                         "differ): resume with the same settings, or choose another --out")
    return last


def fit(build_model: Callable, out: str | Path, mcl: MethodConfig, training: TrainConfig,
        settings: dict, train_set, eval_set, collator: Callable, processor=None,
        last_checkpoint: str | None = None, method: str = "mcl", scores_for: str | None = None) -> dict:
    """Train K hypotheses on tokenized datasets with MCLTrainer and write a finished run to `out`; any task's
    training stage (text pairs, audio, images) ends here, so every run has the same files and record.

    build_model: loads the frozen base model (called after seeding, so the adapters' initialisation is seeded).
    settings: everything that decides the run (JSON; ``run_settings`` for text pairs), recorded in run.json and
        beside the checkpoints. last_checkpoint: from ``resumable_checkpoint``. processor: a tokenizer or processor
        saved with the adapters. method: 'mcl' (``mcl`` an MCLConfig), 'moe' (a MoEConfig) or 'multihead' (a
        MultiHeadConfig), see ``train``. scores_for: a finished LoRA-MCL run whose frozen hypotheses get a scoring
        head trained (``load_mcl_model(..., fit_scores=True)``). Returns the run record (run.json).
    """
    import torch
    from transformers import PrinterCallback, ProgressCallback, set_seed

    from loramcl.training.best import write_adapters
    from loramcl.training.schedule import warmup_shortfall
    from loramcl.training.throughput import TrainingClock
    from loramcl.training.trainer import MCLTrainer

    if training.keep_best and eval_set is None:
        raise ValueError("keep_best keeps the adapters of the lowest validation loss: give a validation file "
                         "(--data.validation_file), or set keep_best false")
    out_dir = Path(out)
    checkpoints = out_dir / CHECKPOINTS
    set_seed(training.seed)
    if scores_for is not None:
        from loramcl.models.mcl import load_mcl_model

        mcl_model = load_mcl_model(build_model(), scores_for, fit_scores=True)
    else:
        mcl_model = method_model(build_model(), method, mcl)
    mcl_model.train()
    evaluating = eval_set is not None and training.eval_every > 0
    saving = training.save_every > 0
    args = training_arguments(training, str(checkpoints), evaluating)
    if shortfall := warmup_shortfall(args, training.steps):  # its verdict will say so too
        logger.warning(f"{shortfall}; set --training.warmup_steps below --training.steps (e.g. "
                       f"{training.steps // 10}) for the run to train at its learning rate")
    trainer = MCLTrainer(mcl_model, args=args, train_dataset=train_set, eval_dataset=eval_set,
                         data_collator=collator, scoring_learning_rate=training.scoring_learning_rate,
                         loraplus_lr_ratio=training.loraplus_lr_ratio)
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    progress = _log_lines_callback(ProgressCallback)()
    trainer.add_callback(progress)
    if hasattr(train_set, "set_epoch"):  # e.g. one caption drawn per image and epoch (data.textcaps)
        trainer.add_callback(_epoch_callback(train_set))
    if saving:
        checkpoints.mkdir(parents=True, exist_ok=True)
        write_json(checkpoints / SETTINGS_NAME, settings)
    writing = trainer.is_world_process_zero()  # the other processes hold the same adapters, or shards of them
    export_peft = method == "mcl" and mcl.num_hypotheses == 1  # a K = 1 run is a PEFT adapter too
    stamp = settings_stamp(settings)  # identifies the run in run.json and in its best's best.json
    if training.keep_best:
        from loramcl.training.best import BestAdapters

        trainer.add_callback(BestAdapters(mcl_model, out_dir, export_peft, processor, writing,
                                          trainer.is_fsdp_enabled, stamp))
    outputs = None
    if training.output_verdict and method != "moe":  # a LoRA-MoE has no hypotheses to decode one by one
        from loramcl.training.outputs import OutputVerdictCallback

        outputs = OutputVerdictCallback(trainer, training.output_verdict, processor, training.mode_column,
                                        out_dir / "outputs.jsonl", training.seed)
        trainer.add_callback(outputs)
    if last_checkpoint is not None:
        logger.info(f"resuming from the newest whole checkpoint in {checkpoints}")
    started = time.perf_counter()
    try:
        trainer.train(resume_from_checkpoint=True if last_checkpoint is not None else None)  # the newest whole one
        if eval_set is not None and not (evaluating and training.steps % training.eval_every == 0):
            trainer.evaluate()  # the final validation point
    finally:  # a failure or an interruption leaves no bar open for its message to share a line with
        progress.close_bars()
    seconds = time.perf_counter() - started

    # sharded: every process takes part in gathering the adapters; the first writes
    write_adapters(mcl_model, out_dir, export_peft, processor, writing, trainer.is_fsdp_enabled)
    if writing:
        write_json(out_dir / "train_log.json", trainer.state.log_history)
    trainable, total = mcl_model.parameter_counts()
    earlier = TrainingClock.of(trainer).earlier  # the seconds before the checkpoint resumed, as it recorded them
    run = {"settings": settings, STAMP: stamp, "resumed_from": trainer.resumed_from and Path(trainer.resumed_from).name,
           "threads": torch.get_num_threads(), "train_examples": len(train_set), "trainable_parameters": trainable,
           "total_parameters": total, "seconds": round(seconds + (earlier or 0.0), 1)}
    if trainer.resumed_from:  # of those seconds, the earlier processes' (None: the checkpoint did not record them)
        run["seconds_before_resume"] = earlier and round(earlier, 1)
    shared = mcl_model.shared_parameter_count()
    if shared:  # of the trainable ones: a LoRA-MLE of rank K*r + shared_r trains as many (equal-parameter comparisons)
        run["shared_parameters"] = shared
    if trainer.specialisation is not None:  # did the hypotheses split (its line was logged), or why no verdict
        run["specialisation"] = trainer.specialisation.to_dict()
    if outputs is not None and outputs.verdict is not None:  # do their answers differ (its line was logged)
        run["outputs"] = outputs.verdict.to_dict()
    if writing:
        write_json(out_dir / RUN_RECORD, run)
        of_them = f" ({shared:,} of them the shared adapter's)" if shared else ""
        logger.info(f"trained {trainable:,} of {total:,} parameters{of_them} in {seconds:.0f} s: {out_dir}")
    return run


def training_arguments(training: TrainConfig, output_dir: str, evaluating: bool, **overrides):
    """transformers ``TrainingArguments`` of a ``TrainConfig`` (``batch_size`` examples per optimizer step in
    ``gradient_accumulation_steps`` micro-batches, validation every ``eval_every`` steps when ``evaluating``, a
    checkpoint every ``save_every``, the CPU when no GPU is seen); ``overrides`` replace any of them
    (e.g. another evaluation batch size)."""
    import torch
    from transformers import TrainingArguments

    saving, accelerator = training.save_every > 0, training_accelerator()
    micro_batch = training.batch_size // training.gradient_accumulation_steps
    values = dict(
        output_dir=output_dir, max_steps=training.steps, per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=training.gradient_accumulation_steps,
        activation_checkpointing=training.activation_checkpointing, **precision_arguments(training, accelerator),
        torch_compile=training.compile,
        per_device_eval_batch_size=micro_batch, learning_rate=training.learning_rate,
        weight_decay=training.weight_decay, adam_beta2=training.adam_beta2, max_grad_norm=training.max_grad_norm,
        warmup_steps=training.warmup_steps, logging_steps=training.logging_steps,
        lr_scheduler_type="cosine_with_min_lr" if training.min_learning_rate else training.scheduler,
        lr_scheduler_kwargs={"min_lr": training.min_learning_rate} if training.min_learning_rate else {},
        eval_strategy="steps" if evaluating else "no", eval_steps=training.eval_every if evaluating else None,
        save_strategy="steps" if saving else "no", save_steps=training.save_every if saving else None,
        save_total_limit=training.keep_checkpoints, report_to=[], use_cpu=accelerator is None,
        seed=training.seed, data_seed=training.seed, remove_unused_columns=False, disable_tqdm=False)
    return TrainingArguments(**(values | overrides))


def training_accelerator():
    """The device Trainer trains on when one is seen (``torch.accelerator``: CUDA, ROCm, XPU, or a backend registered
    with torch), else None: the CPU. Apple's MPS is left out: training there is untested, and it stays on the CPU as
    before."""
    import torch

    if not torch.accelerator.is_available():
        return None
    device = torch.accelerator.current_accelerator()
    return None if device.type == "mps" else device


def precision_arguments(training: TrainConfig, accelerator) -> dict:
    """Trainer's bf16 autocast and TF32 settings of ``training``; TF32 is a CUDA mode, which Trainer refuses
    without a GPU (None: left as torch has it)."""
    cuda = accelerator is not None and accelerator.type == "cuda"
    return {"bf16": training.bf16, "tf32": training.tf32 if cuda else None}


def training_rows(path: str, data: DataConfig, what: str):
    """The rows of a training or validation file or folder (``loramcl.data.sources.read_dataset``), checked before
    torch loads: their format (stated in the log), and every row against it."""
    from loramcl.data.formats import check_rows, detect_format
    from loramcl.data.sources import read_dataset, row_names

    rows = read_dataset(path, data.split, what)
    where = row_names(path)
    fmt = detect_format(rows[0], data.prompt_key, data.target_key, where(0), "data.prompt_key / data.target_key")
    check_rows(rows, fmt, data.chat_template, where)
    return rows


def training_examples(rows, path: str, data: DataConfig, tokenizer, encoder_decoder: bool,
                      limit: int | None = None, mode_column: str | None = None):
    """The tokenized examples (input_ids, labels) of ``rows`` (``training_rows``), the first ``limit`` of them; and
    each one's ``mode_column`` where the rows have that field (the output verdict's modes)."""
    from loramcl.data.formats import prepare_dataset
    from loramcl.data.sources import row_names

    if limit is not None:
        rows = rows.select(range(min(limit, len(rows))))
    examples = prepare_dataset(rows, tokenizer, data.max_length, data.prompt_key, data.target_key,
                               data.chat_template, encoder_decoder, source=path, where=row_names(path))
    if limit is not None:
        examples = examples.select(range(min(limit, len(examples))))
    if mode_column is not None and mode_column in rows.column_names:
        from loramcl.training.outputs import example_modes

        modes = example_modes(rows[mode_column], examples["row"], mode_column, row_names(path))
        return examples.select_columns(["input_ids", "labels"]).add_column(mode_column, modes)
    return examples.select_columns(["input_ids", "labels"])


def log_line(step: int, logs: dict) -> str:
    """One logged step as text: `step 20: loss 1.234, win_rate_h0 0.5, ...` (numbers as numbers, 4 digits)."""
    values = [f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
              for key, value in logs.items() if key != "total_flos"]
    return f"step {step}: " + ", ".join(values)


def _log_lines_callback(progress_callback: type) -> type:
    """transformers' ProgressCallback (the tqdm bars) printing each log as a ``log_line``: its own printing quotes
    every number (transformers 5 formats floats as strings, then prints the dict)."""

    class LogLines(progress_callback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and self.training_bar is not None and logs:
                self.training_bar.write(log_line(state.global_step, logs))

        def close_bars(self) -> None:
            """Close the bars a training or evaluation that stopped midway left open (its end closes them)."""
            for name in ("prediction_bar", "training_bar"):
                if getattr(self, name, None) is not None:
                    getattr(self, name).close()
                    setattr(self, name, None)

    return LogLines


def _epoch_callback(dataset) -> object:
    """Tells ``dataset`` the epoch at each epoch's start. Trainer's data loader does not always do it: accelerate
    forwards ``set_epoch`` to the dataset only when the sampler has none, and its seedable sampler has one."""
    from transformers import TrainerCallback

    class SetEpoch(TrainerCallback):
        def on_epoch_begin(self, args, state, control, **kwargs):
            dataset.set_epoch(int((state.epoch or 0) + 1e-6))  # 1.0 after epoch 0's last step; 1.5 when resumed

    return SetEpoch()
