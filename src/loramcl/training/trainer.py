"""MCLTrainer: transformers.Trainer for an MCLModel (docs/architecture.md, "Decisions as implemented": "Trainer"
and "Two-pass hard WTA").

Distribution (DDP, DeepSpeed, FSDP through accelerate/torchrun) is the Trainer's; this subclass computes the MCL
loss (``loramcl.mcl.step.mcl_step``), logs how often each hypothesis wins (``training.logs.LogStore``), saves the
adapters in our format, and makes checkpoints atomic: a ``checkpoint-N`` folder appears only once it is whole, and
resuming skips a damaged newest one. Its settings: ``training.arguments.MCLTrainingArguments``.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import warnings

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from loramcl.data.collate import PadExamples, check_targets, padding_id, tokenized
from loramcl.mcl.batch import batch_target_index
from loramcl.mcl.compat import check_trainer_methods
from loramcl.mcl.losses import schedule_line, step_tensor, temperature_at
from loramcl.mcl.model import MCLModel
from loramcl.mcl.step import hard_wta_at, mcl_step
from loramcl.training.arguments import SETTING_NAMES, refuse_ignored_options, trainer_copy, trainer_settings
from loramcl.training.balance import assignment_callbacks
from loramcl.training.checkpoints import StagedCheckpoints, checkpoint_step, checkpoint_to_resume, same_on_every_rank
from loramcl.training.distributed import AdaptersOnlyStateDict, refuse_data_parallel, refuse_fsdp1
from loramcl.training.logs import LogStore
from loramcl.training.schedule import warmup_shortfall
from loramcl.training.optimizer import mcl_param_groups
from loramcl.training.scoring_head import ScoringGradients
from loramcl.training.specialisation import NO_VERDICT, CollapseWatch, records_of, verdict, verdict_window
from loramcl.training.throughput import Throughput, TrainingClock, flops_per_token

TRAINING_ARGS_NAME = "training_args.json"  # TrainingArguments.to_dict(), tokens masked; never read back
# Private Trainer methods MCLTrainer overrides, each where no public hook or callback event computes the same (the
# comment on each says why), and those it calls (docs/architecture.md, "What we rely on in transformers and PEFT"):
# checked to exist when a trainer is built, and by a test to be complete.
PRIVATE_TRAINER_OVERRIDES = ("_set_signature_columns_if_needed", "_save", "_load_from_checkpoint", "_load_best_model")
PRIVATE_TRAINER_CALLS = ()
logger = logging.getLogger(__name__)  # `loramcl train` shows it (docs/guide/cli.md)


class MCLTrainer(Trainer):
    """Train an ``MCLModel`` exactly as a ``Trainer`` trains any model.

    Its own settings (two-pass WTA, the scoring pass's blocks, the collapse warning, LoRA+, the scores' rate) are
    the documented fields of ``MCLTrainingArguments`` (``loramcl.training.arguments``): plain ``TrainingArguments``
    give their defaults, and the keywords ``MCLTrainer(..., two_pass_wta=False)`` override them. Each training step
    is ``loramcl.mcl.step.mcl_step`` (docs/architecture.md, "One training step").

    Logged while training (``training.logs.LogStore`` says what each means): ``loss``, ``win_rate_h{k}``, for K >= 2
    ``nll_h{k}`` and ``split_gap``, ``temperature`` (annealed loss) and the speed (``training.throughput``). When
    training ends, a verdict on the specialisation (``specialisation.verdict``) is logged and kept as
    ``trainer.specialisation``; a verdict given is appended to ``state.log_history`` as ``{"specialisation": ...}``.
    Evaluation reports ``eval_loss`` as the vanilla WTA loss (mean over examples of min_k NLL, eq. 2) whatever the
    training loss, plus ``eval_nll_h{k}``, ``eval_win_rate_h{k}`` and with scores ``eval_mixture_nll``; a
    ``compute_metrics`` function receives the per-example NLLs [N, K] as its predictions.

    Checkpoints are atomic (``training.checkpoints``): ``checkpoint-N`` is staged and renamed into place once every
    rank has written its part; ``train(resume_from_checkpoint=True)`` resumes from the newest whole one in
    ``output_dir``, skipping a damaged one with a warning; ``save_total_limit`` never deletes the one just written.
    The arguments are saved as ``training_args.json`` (not Trainer's pickled ``training_args.bin``). The trainer works
    on a copy of ``args`` (``trainer.args``; ``training.arguments.trainer_copy``). Rows of different lengths are
    right-padded and rows of text tokenized as ``SFTTrainer`` prepares them (``loramcl.data.collate``); packing is
    refused. Under FSDP2 every process gathers the adapters at each save and the first writes them
    (``training.distributed``). FSDP 1 and ``nn.DataParallel`` are refused.
    """

    def __init__(self, model: MCLModel | None = None, *args, **kwargs) -> None:
        if not isinstance(model, MCLModel):
            raise TypeError(f"MCLTrainer trains an MCLModel (from get_mcl_model), got {type(model).__name__}")
        keywords = {name: kwargs.pop(name) for name in SETTING_NAMES if name in kwargs}  # the older form
        given = inspect.signature(Trainer.__init__).bind_partial(self, model, *args, **kwargs).arguments
        del given["self"]
        self.settings = trainer_settings(given.get("args"), keywords)  # checked there
        _refuse_float16_adapters(model)
        check_trainer_methods(type(self), PRIVATE_TRAINER_OVERRIDES + PRIVATE_TRAINER_CALLS)
        self._collapse = CollapseWatch(self.settings.collapse_window, self.settings.collapse_share)
        self._resume_step: int | None = None  # the global step of the checkpoint train() resumes from
        given["args"] = trainer_copy(given.get("args"))
        refuse_data_parallel(given["args"])
        refuse_fsdp1((getattr(given["args"], "fsdp_plugin_args", None) or {}).get("fsdp_version"))
        refuse_ignored_options(given["args"], given.get("compute_loss_func"))
        for name in ("train_dataset", "eval_dataset"):  # rows of text are tokenized here, as SFTTrainer does
            given[name] = tokenized(given.get(name), given.get("processing_class"), given["args"], model, name)
        self._checkpoints = StagedCheckpoints(self._wait_for_pushes)
        self._adapters_only = AdaptersOnlyStateDict(self)
        super().__init__(**given)
        refuse_fsdp1(getattr(getattr(self.accelerator.state, "fsdp_plugin", None), "fsdp_version", None))  # launcher
        self.log_store = LogStore(model.num_hypotheses, self.args.device)  # the values log() emits
        self._scoring_gradients = ScoringGradients(self.accelerator, self.args.max_grad_norm, model.scoring_head,
                                                   self.log_store.record_grad_norm)
        for callback in (self._checkpoints, self._scoring_gradients, self._adapters_only, *assignment_callbacks(self)):
            self.add_callback(callback)
        if given.get("data_collator") is None:  # Trainer's default cannot pad labels: rows of any length work
            self.data_collator = PadExamples(padding_id(self.processing_class, model))
        self.specialisation = None  # the verdict at the end of train()
        flops = flops_per_token(model.parameter_counts()[1], model.num_hypotheses,
                                self.settings.two_pass_wta and model.mcl_config.loss == "wta")
        self._throughput = Throughput(self.args.device, flops, self.args.world_size)
        self.add_callback(self._throughput)
        self.add_callback(TrainingClock())  # the run's seconds, kept in every checkpoint
        self._step_tensor = torch.zeros((), dtype=torch.long)  # the optimizer step a compiled forward reads

    # ---- loss -------------------------------------------------------------------------------------------

    def _mcl_model(self) -> MCLModel:
        return self.accelerator.unwrap_model(self.model)

    def _sum_over_ranks(self, total: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(total, reduction="sum")

    def compute_loss(self, model: nn.Module, inputs: dict, return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None):
        mcl = self._mcl_model()
        index = batch_target_index(mcl, inputs, self.args.torch_compile)  # the batch's host reads, once
        if not model.training:
            return self._evaluation_loss(model, inputs, return_outputs, index)
        config, step = mcl.mcl_config, self.state.global_step
        total_steps = self.state.max_steps or (self.args.max_steps if self.args.max_steps > 0 else None)
        two_pass = self.settings.two_pass_wta and hard_wta_at(step, config, total_steps)  # not in a shared phase
        per_block = self.settings.scoring_examples_per_block  # "auto" compiled: the whole batch (no host reads)
        per_block = None if per_block == "auto" and self.args.torch_compile else per_block
        if self.args.torch_compile:  # a tensor: a changing int would be a constant of the graph, one graph per step
            self._step_tensor = step_tensor(self._step_tensor, step, mcl.adapter_device())
        outputs = mcl_step(model, inputs, config, step=self._step_tensor if self.args.torch_compile else step,
                           total_steps=total_steps, two_pass=two_pass, examples_per_block=per_block,
                           target_index=index, balance_bias=self.log_store.balance_bias)
        if config.loss == "annealed" and mcl.num_hypotheses > 1:
            self.log_store.temperature = temperature_at(step, config, total_steps)
        self.log_store.record_step(outputs, first=step == 0)
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def _evaluation_loss(self, model: nn.Module, inputs: dict, return_outputs: bool, index: torch.Tensor | None):
        """The vanilla WTA loss (eq. 2) whatever the training loss; the per-example NLL recorded for the metrics the
        evaluation logs, and the predictions ``compute_metrics`` receives ({"nll": [B, K]})."""
        with torch.no_grad():
            outputs = model(**inputs, target_index=index)
        nll, mixture = outputs.nll.detach(), outputs.mixture_nll  # [B, K], [B] or None
        gather = self.accelerator.gather_for_metrics
        self.log_store.record_evaluation(gather(nll), None if mixture is None else gather(mixture))
        loss = nll.min(dim=1).values.mean()
        return (loss, {"nll": nll}) if return_outputs else loss

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        self._throughput.count(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._scoring_gradients.after_backward(model)  # before Trainer clips the gradients
        return loss

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None,
              ignore_keys_for_eval: list[str] | None = None):
        self._check_targets(self.train_dataset, "train_dataset")
        if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            resume_from_checkpoint = same_on_every_rank(checkpoint_to_resume(  # a whole one, or None
                resume_from_checkpoint, self.args.output_dir, say=self.is_world_process_zero()), self.accelerator)
        self.resumed_from = resume_from_checkpoint  # the checkpoint actually resumed (None: from the beginning)
        self._resume_step = None if resume_from_checkpoint is None else checkpoint_step(resume_from_checkpoint)
        self._checkpoints.put_in_order(self.callback_handler.callbacks)
        try:
            output = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                   ignore_keys_for_eval=ignore_keys_for_eval)
            self._judge_specialisation()
            return output
        finally:
            self._checkpoints.unstage(self.args)
            self._scoring_gradients.restore()
            self._adapters_only.remove()

    def set_initial_training_values(self, args: TrainingArguments, dataloader) -> tuple:
        values = super().set_initial_training_values(args, dataloader)
        num_train_epochs, num_update_steps_per_epoch, *rest, max_steps = values
        if self._resume_step is not None and self._resume_step >= max_steps:
            # The checkpoint ends the run. Trainer would still take one more optimizer step before it checks
            # max_steps (and write a checkpoint-{max_steps + 1}): no epoch is left to run instead.
            num_train_epochs = min(num_train_epochs, self._resume_step // num_update_steps_per_epoch)
        schedule = schedule_line(self._mcl_model().mcl_config, max_steps)
        if schedule is not None and self.is_world_process_zero():
            logger.info(schedule)
        return (num_train_epochs, num_update_steps_per_epoch, *rest, max_steps)

    def _judge_specialisation(self) -> None:
        """The verdict on the hypotheses' specialisation from the run's training logs (the resumed checkpoint's too):
        logged, kept as ``self.specialisation``, and a verdict given appended to the log history."""
        mcl, step = self._mcl_model(), self.state.global_step
        found = verdict(records_of(self.state.log_history, mcl.num_hypotheses), mcl.mcl_config,
                        verdict_window(self._collapse.window, step), self._collapse.share, self.log_store.temperature,
                        step, self.args.logging_steps, warmup_shortfall(self.args, self.state.max_steps))
        self.specialisation = found
        if found.kind != NO_VERDICT:  # an abstention leaves Trainer's log as it was (its last entry: the train loss)
            self.state.log_history.append({"step": step, "specialisation": found.to_dict()})
        if self.is_world_process_zero():
            (logger.info if found.kind in ("split", NO_VERDICT) else logger.warning)(found.line)

    def _check_targets(self, dataset, name: str) -> None:
        """Every example needs a target token (``check_targets``), checked on the whole dataset (a dict: each)."""
        checked = self.__dict__.setdefault("_datasets_with_targets", set())  # ids: each dataset is read once
        if isinstance(dataset, dict):
            for key, value in dataset.items():
                self._check_targets(value, f"{name}[{key!r}]")
        elif dataset is not None and id(dataset) not in checked:
            check_targets(dataset, name, not getattr(self._mcl_model().config, "is_encoder_decoder", False))
            checked.add(id(dataset))

    # ---- evaluation -------------------------------------------------------------------------------------

    def evaluate(self, eval_dataset=None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"):
        if isinstance(eval_dataset, str):  # one of the named eval datasets (Trainer evaluates each in turn)
            self._check_targets(self.eval_dataset[eval_dataset], f"eval_dataset[{eval_dataset!r}]")
        else:
            self._check_targets(eval_dataset if eval_dataset is not None else self.eval_dataset, "eval_dataset")
        self.log_store.start_evaluation(metric_key_prefix)
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)  # log() adds the hypotheses' metrics

    def predict(self, test_dataset, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test"):
        self.log_store.start_evaluation(metric_key_prefix)
        output = super().predict(test_dataset, ignore_keys, metric_key_prefix)  # logs nothing
        output.metrics.update(self._hypothesis_metrics())
        return output

    def _hypothesis_metrics(self) -> dict[str, float]:
        """The hypotheses' metrics of the evaluation recorded since it began (``LogStore.evaluation_metrics``)."""
        return self.log_store.evaluation_metrics()

    # ---- logging ----------------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log: every rank gets here at the same step (Trainer gathers the loss too)
            self.log_store.check_finite(self.state.global_step, self._sum_over_ranks)
            logs.update(self.log_store.drain(self._sum_over_ranks))  # win_rate_h{k}, nll_h{k}, split_gap, ...
            message = self._collapse.observe(self.state.global_step, logs, self._mcl_model().mcl_config.loss)
            if message is not None and self.is_world_process_zero():  # once (CollapseWatch)
                warnings.warn(message, stacklevel=1)
            if self._mcl_model().mcl_config.loss == "annealed":
                logs["temperature"] = self.log_store.temperature or 0.0  # of the latest step; 0 once hard WTA
            logs.update(self._throughput.logs(self.state.global_step, self._sum_over_ranks))
        elif f"{self.log_store.eval_prefix}_loss" in logs:  # evaluate() logs its metrics: in place, it returns them
            logs.update(self._hypothesis_metrics())
        super().log(logs, start_time)

    def create_optimizer(self, model=None):
        """Trainer's optimizer in our groups (``training.optimizer``): LoRA+'s B, the scoring head at its own rate."""
        return mcl_param_groups(super().create_optimizer(model), self._mcl_model(), self.settings)

    # ---- inputs, files ----------------------------------------------------------------------------------

    def _set_signature_columns_if_needed(self) -> None:
        # Trainer reads MCLModel.forward's (**inputs); no setting names the columns to keep (False keeps them all).
        if self._signature_columns is None:  # the base model's inputs, not MCLModel.forward's **inputs
            base = self._mcl_model().base_model
            self._signature_columns = list(inspect.signature(base.forward).parameters)
            self._signature_columns += list({"label", "label_ids", *self.label_names})

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer's, except under FSDP: there Trainer would gather the whole model (the frozen base too) for its state
        dict, or with ``SHARDED_STATE_DICT`` write none of our files; the adapters alone are gathered instead, by every
        process (``MCLModel.save_pretrained``), and the first writes them."""
        if not self.is_fsdp_enabled:
            return super().save_model(output_dir, _internal_call)
        self._save(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # save_model gathers the state dict (DeepSpeed) and hands it here: the one place to write our files.
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not (self.args.should_save or self.is_fsdp_enabled):  # under FSDP every rank gathers the adapters
            return
        # under FSDP every rank is here: all stop together, none left waiting in the gathering
        self.log_store.check_finite(self.state.global_step, self._sum_over_ranks if self.is_fsdp_enabled else None)
        self._mcl_model().save_pretrained(output_dir, state_dict=state_dict)
        if not self.args.should_save:
            return
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        _write_arguments(self.args, output_dir, self._checkpoints.run_dir)

    # ---- checkpoints: written whole or not at all (StagedCheckpoints), resumed from the newest whole one -------

    def _wait_for_pushes(self) -> None:
        pushing = getattr(self, "push_in_progress", None)  # set by Trainer when push_to_hub is on
        if pushing is not None:
            pushing.wait_until_done()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        # Trainer loads only its own weight files; ours are mcl_adapters.safetensors, checked as load_adapters does.
        mcl = self.accelerator.unwrap_model(model if model is not None else self.model)
        mcl.load_adapters(resume_from_checkpoint, is_trainable=True)  # training goes on: Trainer sets the modes

    def _load_best_model(self) -> None:
        # As _load_from_checkpoint, for load_best_model_at_end (before the on_train_end callbacks see the model).
        self._mcl_model().load_adapters(self.state.best_model_checkpoint, is_trainable=True)


def _write_arguments(args: TrainingArguments, output_dir: str, run_dir: str | None) -> None:
    """``training_args.json``: ``args.to_dict()`` (tokens masked), its ``output_dir`` the run's (``run_dir`` while a
    checkpoint is staged), not the staging folder."""
    arguments = args.to_dict()
    arguments["output_dir"] = run_dir or arguments["output_dir"]
    with open(os.path.join(output_dir, TRAINING_ARGS_NAME), "w", encoding="utf-8") as f:
        f.write(json.dumps(arguments, indent=2))


def _refuse_float16_adapters(model: MCLModel) -> None:
    """float16 adapter tensors train silently wrong: Adam's second moment (the squared gradient) underflows in
    float16 for gradients below about 2.4e-4 and its epsilon (1e-8) rounds to 0, so the normalised update is no
    longer bounded by the learning rate (measured: |lora_B| 3.8 after 40 steps against 0.015 in float32)."""
    half = sorted({name.rsplit(".", 1)[0] for name, p in model.named_parameters()
                   if p.requires_grad and p.dtype == torch.float16})
    if half:
        raise ValueError(
            f"{len(half)} adapted layers have float16 adapter tensors (e.g. {half[0]}): Adam's moments underflow in "
            "float16 and the updates blow up without any error. Keep MCLConfig(adapter_dtype='float32') (the "
            "default: the base model stays float16, only the small adapters are float32) or use bfloat16.")
