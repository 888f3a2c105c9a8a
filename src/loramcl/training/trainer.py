"""MCLTrainer: transformers.Trainer for an MCLModel (docs/architecture.md, "Decisions as implemented": "Trainer"
and "Two-pass hard WTA").

Distribution (DDP, DeepSpeed, FSDP through accelerate/torchrun) is the Trainer's; this subclass computes the MCL
loss, logs how often each hypothesis wins, saves the adapters in our format, and makes checkpoints atomic: a
``checkpoint-N`` folder appears only once it is whole, and resuming skips a damaged newest one.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import math
import os
import warnings
from collections.abc import Callable

import torch
from accelerate.utils import DistributedType
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

from loramcl.mcl.batch import batch_target_index
from loramcl.mcl.compat import check_trainer_methods
from loramcl.mcl.losses import schedule_line, temperature_at
from loramcl.mcl.losses import winners as loss_winners
from loramcl.mcl.model import MCLModel
from loramcl.mcl.nll import IGNORE_INDEX, examples_without_targets
from loramcl.training.checkpoints import StagedCheckpoints, checkpoint_step, checkpoint_to_resume
from loramcl.training.distributed import AdaptersOnlyStateDict, refuse_data_parallel, refuse_fsdp1
from loramcl.training.schedule import warmup_shortfall
from loramcl.training.specialisation import NO_VERDICT, CollapseWatch, log_values, records_of, verdict, verdict_window
from loramcl.training.throughput import Throughput, flops_per_token

TRAINING_ARGS_NAME = "training_args.json"  # TrainingArguments.to_dict(), tokens masked; never read back
# Private Trainer methods MCLTrainer overrides, each where no public hook or callback event computes the same (the
# comment on each says why), and those it calls (docs/architecture.md, "What we rely on in transformers and PEFT"):
# checked to exist when a trainer is built, and by a test to be complete.
PRIVATE_TRAINER_OVERRIDES = ("_set_signature_columns_if_needed", "_save", "_load_from_checkpoint", "_load_best_model")
PRIVATE_TRAINER_CALLS = ()
logger = logging.getLogger(__name__)  # `loramcl train` shows it (docs/guide/cli.md)


def scoring_block(batch: int, num_hypotheses: int) -> int:
    """Examples per block of two-pass WTA's scoring pass: about as many rows per block (K*n) as the winners' pass
    has (B), so that the scoring pass, which keeps no activations, peaks below the winners' forward + backward."""
    return max(1, -(-batch // num_hypotheses))  # ceil(B / K)


class PadExamples:
    """The collator of an MCLTrainer given none: rows of one length are collated by transformers'
    ``default_data_collator``; rows of different lengths are right-padded, each field to its own longest row (as
    ``loramcl train`` pads): token ids with ``pad_token_id``, masks with 0 (made from the lengths where rows have
    none), labels with -100, so padding is never attended to nor predicted (any id in the vocabulary would do).
    Other fields go to ``default_data_collator``."""

    def __init__(self, pad_token_id: int | None) -> None:
        self.pad_token_id = pad_token_id
        self.padded = {"input_ids": pad_token_id, "attention_mask": 0, "labels": IGNORE_INDEX,
                       "decoder_input_ids": pad_token_id, "decoder_attention_mask": 0}

    def __call__(self, rows: list[dict]) -> dict:
        sequences = {name: [torch.as_tensor(row[name]) for row in rows] for name in self.padded if name in rows[0]}
        lengths = {name: {len(value) for value in values} for name, values in sequences.items()}
        if all(len(found) == 1 for found in lengths.values()):
            return default_data_collator(rows)
        for name in ("input_ids", "decoder_input_ids"):
            if self.pad_token_id is None and len(lengths.get(name, ())) > 1:
                raise ValueError(f"the rows of a batch have {name} of different lengths ({min(lengths[name])} to "
                                 f"{max(lengths[name])} tokens) and no padding id is known: give MCLTrainer the "
                                 "tokenizer (processing_class=tokenizer), set the model's config.pad_token_id, or "
                                 "pass a data_collator")
        if "attention_mask" not in sequences and "input_ids" in sequences:
            sequences["attention_mask"] = [torch.ones_like(ids) for ids in sequences["input_ids"]]
        batch = {name: nn.utils.rnn.pad_sequence(values, batch_first=True, padding_value=self.padded[name] or 0)
                 for name, values in sequences.items()}  # [B, longest row of that field]
        rest = [{name: value for name, value in row.items() if name not in self.padded} for row in rows]
        return {**(default_data_collator(rest) if rest[0] else {}), **batch}


def padding_id(processing_class, model: nn.Module) -> int | None:
    """The id that pads token rows: the tokenizer's padding (else end-of-sequence) id, else the model config's."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)  # a processor holds its tokenizer
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else None
    for source in (tokenizer, config, text_config):
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(source, name, None)
            value = value[0] if isinstance(value, list) and value else value
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


class MCLTrainer(Trainer):
    """Train an ``MCLModel`` exactly as a ``Trainer`` trains any model.

    two_pass_wta: with ``loss='wta'`` only the winner of each example gets a gradient, so the trainer
        scores all K hypotheses under ``torch.no_grad()``, then runs forward + backward on the winner rows
        only: the same gradient for about (K+2)/2 MLE steps of compute instead of K, and K times less
        activation memory. Set False to backpropagate through all K (the one-pass reference). With dropout,
        the two passes draw different dropout masks, so the winner is picked on another draw of the noise.

    scoring_examples_per_block: two-pass WTA's scoring pass runs the batch this many examples at a time
        (``MCLModel.forward(examples_per_block=)``), so that its peak memory, K*n rows at once, stays within that of
        the winners' forward + backward on B rows. "auto" (default): ``scoring_block(B, K)``; None: the whole
        batch at once (K*B rows). The winners and the gradient are the same either way.
    collapse_window, collapse_share: a warning (once) when a hypothesis has won less than ``collapse_share`` of the
        examples over the last ``collapse_window`` optimizer steps, or over the last quarter of them less than a
        quarter of a fair share with a training NLL 10% above the others' (``specialisation.CollapseWatch``), naming
        the remedies.
    scoring_learning_rate: the learning rate of the hypothesis-scores head (``MCLConfig(scoring=True)``); default
        the trainer's. With Adam the scoring loss's weight beta barely matters (the step is normalised), this does.

    Logged while training: ``loss``, ``win_rate_h{k}`` (share of examples won by hypothesis k since the last
    log: a hypothesis near 0 has collapsed), for K >= 2 ``nll_h{k}`` (its mean training NLL) and ``split_gap``
    (mean_k nll_h{k} minus the mean of min_k: how far the hypotheses have split), ``temperature`` for the annealed
    loss (0 once hard WTA), and the speed (``training.throughput``): ``tokens_per_second``,
    ``labelled_tokens_per_second``, ``step_time`` and on a GPU ``peak_allocated_gb``, ``peak_reserved_gb``, ``mfu``.
    When training ends, a verdict on the specialisation (``specialisation.verdict``: split, not split or partly
    collapsed, with the changes to try; 'no verdict' with its reason for K = 1, no training log or under 4 steps) is
    logged and kept as ``trainer.specialisation``; a verdict given is appended to ``state.log_history`` as
    ``{"specialisation": ...}``.
    Evaluation reports ``eval_loss`` as the vanilla WTA loss (mean over examples of min_k NLL, eq. 2)
    whatever the training loss, plus ``eval_nll_h{k}``, ``eval_win_rate_h{k}`` and, with hypothesis scores
    (``MCLConfig(scoring=True)``), ``eval_mixture_nll``. A ``compute_metrics`` function receives the per-example
    NLLs [N, K] as its predictions.

    Checkpoints are atomic: ``checkpoint-N`` is written as ``incomplete-checkpoint-N/checkpoint-N`` and renamed into
    place once every rank has written its part, so a ``checkpoint-N`` folder that exists is whole. ``train(
    resume_from_checkpoint=True)`` resumes from the newest whole checkpoint in ``output_dir``, skipping a damaged one
    with a warning (a folder left by another writer, or cut short on disk), and starts from the beginning with a
    warning when there is none; a path to a damaged ``checkpoint-N`` falls back to the newest whole one before it.
    ``save_total_limit`` rotation never deletes the checkpoint just written and drops damaged ones first. The
    training arguments are saved as ``training_args.json`` (not Trainer's pickled ``training_args.bin``). The trainer
    works on a copy of ``args`` (``trainer.args``), which it may change: while a checkpoint is written, its
    ``output_dir`` is the staging folder (``StagedCheckpoints``), and ``ddp_find_unused_parameters`` is False unless
    set, so DDP runs without the unused-parameter search; the caller's object stays as it was. Without a
    ``data_collator``, rows of different lengths are right-padded (``PadExamples``; the padding id from
    ``processing_class``, else from the model's config). A ``datasets.Dataset`` of rows in one of TRL's formats
    (prompt/completion, conversational, messages, text; multi-reference rows) is tokenized with ``processing_class``
    as ``SFTTrainer`` prepares it (``loramcl.data.prepare_dataset``: labels on the completion or the assistant turns);
    packing is refused. Under FSDP2 every process gathers the adapters at each save and the first writes them;
    checkpoints hold no frozen base (``training.distributed``). FSDP version 1 and ``nn.DataParallel`` are refused.
    """

    def __init__(self, model: MCLModel | None = None, *args, two_pass_wta: bool = True,
                 scoring_examples_per_block: int | str | None = "auto", collapse_window: int = 100,
                 collapse_share: float = 0.01, scoring_learning_rate: float | None = None, **kwargs) -> None:
        if not isinstance(model, MCLModel):
            raise TypeError(f"MCLTrainer trains an MCLModel (from get_mcl_model), got {type(model).__name__}")
        if not (scoring_examples_per_block in (None, "auto") or isinstance(scoring_examples_per_block, int)
                and not isinstance(scoring_examples_per_block, bool) and scoring_examples_per_block >= 1):
            raise ValueError(f"scoring_examples_per_block must be 'auto', None or a number of examples >= 1, got "
                             f"{scoring_examples_per_block!r}")
        self._collapse = CollapseWatch(collapse_window, collapse_share)  # checks them
        if scoring_learning_rate is not None and not (math.isfinite(scoring_learning_rate)
                                                      and scoring_learning_rate > 0):
            raise ValueError(f"scoring_learning_rate must be a finite number > 0, got {scoring_learning_rate!r}")
        _refuse_float16_adapters(model)
        check_trainer_methods(type(self), PRIVATE_TRAINER_OVERRIDES + PRIVATE_TRAINER_CALLS)
        self.two_pass_wta = two_pass_wta
        self.scoring_examples_per_block = scoring_examples_per_block
        self.scoring_learning_rate = scoring_learning_rate
        self._resume_step: int | None = None  # the global step of the checkpoint train() resumes from
        given = inspect.signature(Trainer.__init__).bind_partial(self, model, *args, **kwargs).arguments
        del given["self"]
        given["args"] = _own_arguments(given.get("args"))
        refuse_data_parallel(given["args"])
        refuse_fsdp1((getattr(given["args"], "fsdp_plugin_args", None) or {}).get("fsdp_version"))
        for name in ("train_dataset", "eval_dataset"):  # rows of text are tokenized here, as SFTTrainer does
            given[name] = _tokenized(given.get(name), given.get("processing_class"), given["args"], model, name)
        self._checkpoints = StagedCheckpoints(self._wait_for_pushes)
        self._scoring_gradients = _ScoringGradients(self)
        self._adapters_only = AdaptersOnlyStateDict(self)
        super().__init__(**given)
        refuse_fsdp1(getattr(getattr(self.accelerator.state, "fsdp_plugin", None), "fsdp_version", None))  # launcher
        for callback in (self._checkpoints, self._scoring_gradients, self._adapters_only):
            self.add_callback(callback)
        if given.get("data_collator") is None:  # Trainer's default cannot pad labels: rows of any length work
            self.data_collator = PadExamples(padding_id(self.processing_class, model))
        # compute_loss is ours: these Trainer options would otherwise be silently ignored.
        if self.args.label_smoothing_factor:
            raise ValueError("label_smoothing_factor is not supported: the MCL losses are computed on the plain "
                             "per-example NLL (paper eq. 2-5); set it to 0")
        if self.compute_loss_func is not None:
            raise ValueError("compute_loss_func is not used by MCLTrainer: the loss is MCLConfig.loss; choose it there")
        k = model.num_hypotheses
        self._train_wins = torch.zeros(k, dtype=torch.long, device=self.args.device)  # [K] since the last log
        self._train_nll = torch.zeros(k, device=self.args.device)  # [K] sum over the examples since the last log
        self._train_oracle = torch.zeros((), device=self.args.device)  # sum of min_k nll, likewise
        self._initial_nll = torch.zeros(2, device=self.args.device)  # [NLL sum, examples] of the first step
        self.specialisation = None  # the verdict at the end of train()
        two_pass = self.two_pass_wta and model.mcl_config.loss == "wta"
        self._throughput = Throughput(self.args.device, flops_per_token(model.parameter_counts()[1], k, two_pass),
                                      self.args.world_size)
        self.add_callback(self._throughput)
        self._last_temperature: float | None = None  # tau used by the latest training step (annealed loss)
        self._nonfinite_loss = torch.zeros((), dtype=torch.bool, device=self.args.device)  # checked when logging
        self._nonfinite_grad_norm = torch.zeros((), dtype=torch.bool, device=self.args.device)  # likewise
        # Evaluation's per-example NLL [B, K] and mixture NLL [B] of each batch, recorded in compute_loss and
        # turned into metrics when the evaluation logs (or predict returns): metric name prefix, records.
        self._eval_prefix = "eval"
        self._eval_nll: list[torch.Tensor] = []
        self._eval_mixture: list[torch.Tensor] = []

    # ---- loss -------------------------------------------------------------------------------------------

    def _mcl_model(self) -> MCLModel:
        return self.accelerator.unwrap_model(self.model)

    def compute_loss(self, model: nn.Module, inputs: dict, return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None):
        mcl = self._mcl_model()
        index = batch_target_index(mcl, inputs, self.args.torch_compile)  # the batch's host reads, once
        if not model.training:
            return self._evaluation_loss(model, inputs, return_outputs, index)
        mcl.training_step = self.state.global_step
        mcl.training_steps = self.state.max_steps or (self.args.max_steps if self.args.max_steps > 0 else None)
        if self.two_pass_wta and mcl.mcl_config.loss == "wta" and mcl.num_hypotheses > 1:
            per_block = self.scoring_examples_per_block
            if per_block == "auto":  # compiled: the whole batch (a block's label positions would read the host)
                per_block = None if index is None or self.args.torch_compile else scoring_block(
                    inputs["labels"].shape[0], mcl.num_hypotheses)
            with torch.no_grad():  # nll [B, K]; the scoring head, if any, learns from this pass
                scored = model(**inputs, examples_per_block=per_block, target_index=index)
            winners = loss_winners(scored.nll, mcl.mcl_config.tie_break)  # [B]; no host read between the passes
            outputs = model(**inputs, hypotheses=winners, target_index=index)  # forward + backward of the winners
            outputs.nll = scored.nll
            if scored.scoring_loss is not None:
                outputs.loss = outputs.loss + mcl.mcl_config.scoring_weight * scored.scoring_loss
                outputs.log_scores, outputs.mixture_nll = scored.log_scores, scored.mixture_nll
        else:
            outputs = model(**inputs, target_index=index)
            winners = outputs.weights.argmax(dim=1)  # [B]: the loss's winners (ties broken as the loss broke them)
        self._nonfinite_loss |= ~torch.isfinite(outputs.loss.detach())  # no host sync here
        if mcl.mcl_config.loss == "annealed" and mcl.num_hypotheses > 1:
            self._last_temperature = temperature_at(mcl.training_step, mcl.mcl_config, mcl.training_steps)
        wins = torch.bincount(winners, minlength=mcl.num_hypotheses)  # [K]
        self._train_wins += wins.to(self._train_wins.device)
        nll = outputs.nll.detach().float()  # [B, K], what the loss saw
        self._train_nll += nll.sum(dim=0).to(self._train_nll.device)
        self._train_oracle += nll.min(dim=1).values.sum().to(self._train_oracle.device)
        if self.state.global_step == 0:  # the base model's NLL (B = 0), against which the split gap is judged
            self._initial_nll[0] += nll.mean(dim=1).sum().to(self._initial_nll.device)
            self._initial_nll[1] += nll.shape[0]
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def _evaluation_loss(self, model: nn.Module, inputs: dict, return_outputs: bool, index: torch.Tensor | None):
        """The vanilla WTA loss (eq. 2) whatever the training loss; the per-example NLL recorded for the metrics the
        evaluation logs, and the predictions ``compute_metrics`` receives ({"nll": [B, K]})."""
        with torch.no_grad():
            outputs = model(**inputs, target_index=index)
        nll = outputs.nll.detach()  # [B, K]
        self._eval_nll.append(self.accelerator.gather_for_metrics(nll).float().cpu())
        if outputs.mixture_nll is not None:
            self._eval_mixture.append(self.accelerator.gather_for_metrics(outputs.mixture_nll).float().cpu())
        loss = nll.min(dim=1).values.mean()
        return (loss, {"nll": nll}) if return_outputs else loss

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        self._throughput.count(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients and self.args.max_grad_norm > 0:  # the gradients Trainer clips next
            self._scoring_gradients.before_clipping(model)
        return loss

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None,
              ignore_keys_for_eval: list[str] | None = None):
        self._check_targets(self.train_dataset, "train_dataset")
        if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            resume_from_checkpoint = self._same_on_every_rank(checkpoint_to_resume(  # a whole one, or None
                resume_from_checkpoint, self.args.output_dir, say=self.is_world_process_zero()))
        self.resumed_from = resume_from_checkpoint  # the checkpoint actually resumed (None: from the beginning)
        self._resume_step = None if resume_from_checkpoint is None else checkpoint_step(resume_from_checkpoint)
        callbacks = self.callback_handler.callbacks  # staging last, publishing first, whatever was added since
        for callback in (self._checkpoints, self._checkpoints.publisher):
            if callback in callbacks:
                callbacks.remove(callback)
        callbacks.insert(0, self._checkpoints.publisher)
        callbacks.append(self._checkpoints)
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
        """The verdict on the hypotheses' specialisation over the run's last steps, from its training logs (those of
        the checkpoint it resumed from too): logged, kept as ``self.specialisation``, and a verdict given appended to
        the log history."""
        mcl, step = self._mcl_model(), self.state.global_step
        found = verdict(records_of(self.state.log_history, mcl.num_hypotheses), mcl.mcl_config,
                        verdict_window(self._collapse.window, step), self._collapse.share, self._last_temperature,
                        step, self.args.logging_steps, warmup_shortfall(self.args, self.state.max_steps))
        self.specialisation = found
        if found.kind != NO_VERDICT:  # an abstention leaves Trainer's log as it was (its last entry: the train loss)
            self.state.log_history.append({"step": step, "specialisation": found.to_dict()})
        if self.is_world_process_zero():
            (logger.info if found.kind in ("split", NO_VERDICT) else logger.warning)(found.line)

    def _check_targets(self, dataset, name: str) -> None:
        """Every example needs a target token (its mean NLL is 0/0 otherwise): checked on the whole dataset before
        training, so that the error names dataset indices instead of a position in some later batch."""
        checked = self.__dict__.setdefault("_datasets_with_targets", set())  # ids: each dataset is read once
        if dataset is None or id(dataset) in checked:
            return
        empty = examples_without_targets(dataset, not getattr(self._mcl_model().config, "is_encoder_decoder", False))
        if empty:
            shown = ", ".join(map(str, empty[:10])) + (f" ... ({len(empty)} in all)" if len(empty) > 10 else "")
            raise ValueError(f"{name} examples {shown} have no label token (every label is {IGNORE_INDEX} after the "
                             "causal shift), so their NLL is undefined: keep at least one target token per example "
                             "(e.g. truncate the prompt, not the target), or drop them")
        checked.add(id(dataset))

    # ---- evaluation -------------------------------------------------------------------------------------

    def evaluate(self, eval_dataset=None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"):
        if isinstance(eval_dataset, dict) or (eval_dataset is None and isinstance(self.eval_dataset, dict)):
            for key, dataset in (eval_dataset or self.eval_dataset).items():
                self._check_targets(dataset, f"eval_dataset[{key!r}]")
        elif isinstance(eval_dataset, str):  # one of the named eval datasets (Trainer evaluates each in turn)
            self._check_targets(self.eval_dataset[eval_dataset], f"eval_dataset[{eval_dataset!r}]")
        else:
            self._check_targets(eval_dataset if eval_dataset is not None else self.eval_dataset, "eval_dataset")
        self._eval_prefix, self._eval_nll, self._eval_mixture = metric_key_prefix, [], []
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)  # log() adds the hypotheses' metrics

    def predict(self, test_dataset, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test"):
        self._eval_prefix, self._eval_nll, self._eval_mixture = metric_key_prefix, [], []
        output = super().predict(test_dataset, ignore_keys, metric_key_prefix)  # logs nothing
        output.metrics.update(self._hypothesis_metrics())
        return output

    def _hypothesis_metrics(self) -> dict[str, float]:
        """``{prefix}_nll_h{k}``, ``{prefix}_win_rate_h{k}`` and ``{prefix}_mixture_nll`` of the evaluation recorded
        since it began; the records are dropped."""
        metrics, prefix = {}, self._eval_prefix
        if self._eval_nll:
            nll = torch.cat(self._eval_nll)  # [N, K]
            wins = torch.bincount(nll.argmin(dim=1), minlength=nll.shape[1]).float() / nll.shape[0]
            for k in range(nll.shape[1]):
                metrics[f"{prefix}_nll_h{k}"] = nll[:, k].mean().item()
                metrics[f"{prefix}_win_rate_h{k}"] = wins[k].item()
        if self._eval_mixture:
            metrics[f"{prefix}_mixture_nll"] = torch.cat(self._eval_mixture).mean().item()
        self._eval_nll, self._eval_mixture = [], []
        return metrics

    # ---- logging ----------------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log: every rank gets here at the same step (Trainer gathers the loss too)
            if self.accelerator.reduce(self._nonfinite_loss.int(), reduction="sum"):
                self._raise_nonfinite()
            if self.accelerator.reduce(self._nonfinite_grad_norm.int(), reduction="sum"):
                self._raise_nonfinite_grad_norm()
            totals = (self._train_wins, self._train_nll, self._train_oracle, self._initial_nll)
            sums = [self.accelerator.reduce(total.clone(), reduction="sum") for total in totals]
            logs.update(log_values(*sums))  # win_rate_h{k}, nll_h{k}, split_gap; initial_nll in the first log
            for total in totals:
                total.zero_()
            self._watch_for_collapse(logs)
            if self._mcl_model().mcl_config.loss == "annealed":
                logs["temperature"] = self._last_temperature or 0.0  # of the latest step; 0 once hard WTA
            logs.update(self._throughput.logs(self.state.global_step,
                                              lambda total: self.accelerator.reduce(total, reduction="sum")))
        elif f"{self._eval_prefix}_loss" in logs:  # evaluate() logs its metrics: in place, it returns the same dict
            logs.update(self._hypothesis_metrics())
        super().log(logs, start_time)

    def create_optimizer(self, model=None):
        """Trainer's optimizer, with the scoring head (if any) in its own parameter group at
        ``scoring_learning_rate`` (the same schedule applies): a probe on detached features may learn faster than the
        hypotheses without disturbing them."""
        optimizer = super().create_optimizer(model)
        head = self._mcl_model().scoring_head
        if head is not None and self.scoring_learning_rate is not None:
            head_parameters = set(head.parameters())
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if p not in head_parameters]
            # with the hypotheses frozen (fitting the scores of a finished run) only the head's group is left
            optimizer.param_groups[:] = [group for group in optimizer.param_groups if group["params"]]
            optimizer.add_param_group({"params": list(head_parameters), "lr": self.scoring_learning_rate,
                                       "weight_decay": 0.0})
        return optimizer

    def _record_grad_norm(self, norm) -> None:
        """Record a gradient norm that is not finite: clipping by it zeroes the step (or makes it NaN), so training
        would go on without learning (checked when logging and saving)."""
        if norm is not None:
            finite = torch.isfinite(torch.as_tensor(norm)).to(self._nonfinite_grad_norm.device)
            self._nonfinite_grad_norm |= ~finite  # no host sync here

    def _watch_for_collapse(self, logs: dict) -> None:
        """Warn once (``CollapseWatch``) when a hypothesis has stopped winning (no gradient under WTA: for good)."""
        message = self._collapse.observe(self.state.global_step, logs, self._mcl_model().mcl_config.loss)
        if message is not None and self.is_world_process_zero():
            warnings.warn(message, stacklevel=2)

    # ---- inputs, files ----------------------------------------------------------------------------------

    def _set_signature_columns_if_needed(self) -> None:
        # Trainer reads MCLModel.forward's (**inputs); no setting names the columns to keep (False keeps them all).
        if self._signature_columns is None:  # the base model's inputs, not MCLModel.forward's **inputs
            base = self._mcl_model().base_model
            self._signature_columns = list(inspect.signature(base.forward).parameters)
            self._signature_columns += list({"label", "label_ids", *self.label_names})

    def _raise_nonfinite(self) -> None:
        raise FloatingPointError(
            f"the training loss became NaN or infinite before step {self.state.global_step}; stopping before any "
            "checkpoint is written with broken adapters. Lower the learning rate, train in bf16 or fp32 rather than "
            "fp16, or check the inputs of the base model.")

    def _raise_nonfinite_grad_norm(self) -> None:
        raise FloatingPointError(
            f"the gradient norm became infinite or NaN before step {self.state.global_step}: clipping by it zeroes "
            "the update, so the adapters stop learning; stopping before any checkpoint is written. Lower the "
            "adapters' scaling alpha / r (the paper's: 1 to 4) or the learning rate, or check the inputs of the base "
            "model.")

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
        nonfinite = torch.stack([self._nonfinite_loss, self._nonfinite_grad_norm])  # this rank's own flags
        if self.is_fsdp_enabled:  # every rank is here: all stop together, none left waiting in the gathering
            nonfinite = self.accelerator.reduce(nonfinite.int(), reduction="sum")
        if nonfinite[0]:
            self._raise_nonfinite()
        if nonfinite[1]:
            self._raise_nonfinite_grad_norm()
        self._mcl_model().save_pretrained(output_dir, state_dict=state_dict)
        if not self.args.should_save:
            return
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        arguments = self.args.to_dict()  # tokens masked
        arguments["output_dir"] = self._checkpoints.run_dir or arguments["output_dir"]  # not the staging folder
        with open(os.path.join(output_dir, TRAINING_ARGS_NAME), "w", encoding="utf-8") as f:
            f.write(json.dumps(arguments, indent=2))

    # ---- checkpoints: written whole or not at all (StagedCheckpoints), resumed from the newest whole one -------

    def _wait_for_pushes(self) -> None:
        pushing = getattr(self, "push_in_progress", None)  # set by Trainer when push_to_hub is on
        if pushing is not None:
            pushing.wait_until_done()

    def _same_on_every_rank(self, checkpoint: str | None) -> str | None:
        """``checkpoint``, once every rank has chosen the same step to resume from (they resume the same or none)."""
        step = -1 if checkpoint is None else checkpoint_step(checkpoint)
        steps = self.accelerator.gather(torch.tensor([step], device=self.args.device))  # [world size]
        if (steps != step).any():
            raise RuntimeError(f"the ranks found different checkpoints to resume from (global steps {steps.tolist()}, "
                               "-1 = none): every rank must see the same files")
        return checkpoint

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        # Trainer loads only its own weight files; ours are mcl_adapters.safetensors, checked as load_adapters does.
        mcl = self.accelerator.unwrap_model(model if model is not None else self.model)
        mcl.load_adapters(resume_from_checkpoint, is_trainable=True)  # training goes on: Trainer sets the modes

    def _load_best_model(self) -> None:
        # As _load_from_checkpoint, for load_best_model_at_end (before the on_train_end callbacks see the model).
        self._mcl_model().load_adapters(self.state.best_model_checkpoint, is_trainable=True)


def _own_arguments(args: TrainingArguments | None) -> TrainingArguments:
    """The trainer's copy of the caller's arguments (Trainer's default when None), with ``ddp_find_unused_parameters``
    False unless set: every adapter tensor takes part in every MCL forward (all routings index the stacked tensors), so
    DDP need not search the graph for unused ones, which Trainer assumes it must for a model that is not a
    ``PreTrainedModel``."""
    args = TrainingArguments(output_dir="tmp_trainer") if args is None else copy.copy(args)
    if args.ddp_find_unused_parameters is None:
        args.ddp_find_unused_parameters = False
    return args


def _tokenized(dataset, processing_class, args: TrainingArguments, model: MCLModel, name: str):
    """``dataset`` as MCLTrainer trains on it: a ``datasets.Dataset`` of rows in one of TRL's formats (no
    ``input_ids``) prepared by ``loramcl.data.prepare_dataset`` with the tokenizer (``args.max_length`` where the
    arguments have one, as SFTConfig's); any other dataset as given. Packing (SFTConfig's) is refused."""
    from loramcl.data.formats import check_packing, prepare_dataset

    check_packing(getattr(args, "packing", False))
    if isinstance(dataset, dict):
        return {key: _tokenized(value, processing_class, args, model, f"{name}[{key!r}]")
                for key, value in dataset.items()}
    columns = getattr(dataset, "column_names", None)
    if not isinstance(columns, list) or "input_ids" in columns:
        return dataset
    if processing_class is None:
        raise ValueError(f"{name} holds rows of text (fields {', '.join(columns[:6])}) and MCLTrainer has no "
                         "tokenizer to prepare them: pass processing_class=tokenizer, or tokenized rows")
    tokenizer = getattr(processing_class, "tokenizer", processing_class)  # a processor holds its tokenizer
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    return prepare_dataset(dataset, tokenizer, getattr(args, "max_length", None), encoder_decoder=encoder_decoder,
                           source=name).select_columns(["input_ids", "labels"])


def _norm(parameters: list[nn.Parameter]) -> torch.Tensor:
    """The 2-norm of the gradients of ``parameters`` (of this rank's shards, where sharded: enough to tell a norm that
    is not finite, which the ranks then share)."""
    return torch.nn.utils.get_total_norm([p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                                          for p in parameters])


class _ScoringGradients(TrainerCallback):
    """Gradient clipping, the hypotheses and the scoring head each by their own norm: the head's gradients must not
    shrink the hypotheses' step (with them separate, the hypotheses train bit-identically with and without scores).
    Trainer clips every gradient by one norm after the step's last backward, then calls ``on_pre_optimizer_step``. So
    the trainer's ``training_step``, after that backward, clips the head's gradients by their norm and holds them back
    (``before_clipping``) while Trainer clips the hypotheses' (the norm it logs); ``on_pre_optimizer_step`` gives them
    back. Under DeepSpeed or FSDP (whose clipping spans the whole model), with gradients on device meshes (DTensor) or
    with fp16's loss scaler (which must unscale every gradient at once), Trainer clips them all together. Every norm
    that is not finite is recorded (``MCLTrainer._record_grad_norm``); fp16's scaler skips such a step itself, and
    DeepSpeed keeps its gradients out of reach."""

    def __init__(self, trainer: MCLTrainer) -> None:
        self.trainer = trainer
        self.held: list[tuple[nn.Parameter, torch.Tensor]] = []  # the head's clipped gradients, until the step

    def before_clipping(self, model: nn.Module) -> None:
        trainer = self.trainer
        distributed = trainer.accelerator.distributed_type
        if distributed == DistributedType.DEEPSPEED or trainer.accelerator.scaler is not None:
            return
        parameters = [p for p in model.parameters() if p.grad is not None]
        head = trainer._mcl_model().scoring_head
        if head is None or distributed == DistributedType.FSDP or any(isinstance(p.grad, DTensor) for p in parameters):
            trainer._record_grad_norm(_norm(parameters))
            return
        head_parameters = set(head.parameters())
        head_gradients = [p for p in parameters if p in head_parameters]
        trainer._record_grad_norm(trainer.accelerator.clip_grad_norm_(head_gradients, trainer.args.max_grad_norm))
        trainer._record_grad_norm(_norm([p for p in parameters if p not in head_parameters]))
        self.held = [(p, p.grad) for p in head_gradients]
        for p in head_gradients:
            p.grad = None

    def restore(self) -> None:
        for parameter, gradient in self.held:
            parameter.grad = gradient
        self.held = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.restore()


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
