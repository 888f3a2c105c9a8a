"""The output verdict while training (issue 64; docs/guide/scores.md, "Do the hypotheses write different things"):
a ``TrainerCallback`` that has each hypothesis decode a few prompts greedily at each evaluation and when training
ends, and judges their answers with ``analysis.outputs.output_verdict``.

As TRL's ``LogCompletionsCallback``, it holds the trainer and logs through ``trainer.log`` (so every ``report_to``
logger gets ``outputs_distinct``, ``outputs_same_rate``, ``outputs_best_of_k``, ``outputs_mean_over_k``,
``outputs_exact_best_of_k``); the answers go to the console (a few lines), to a JSONL file, and as a table (step,
prompt, reference, one column per hypothesis; every decoding so far) to the ``report_to`` loggers that keep tables:
Weights & Biases (``wandb.Table``), Comet (``log_table``) and MLflow (``log_table``), each when its run is active.
Unlike it, it decodes the whole sample on every rank, with the unwrapped model (no DDP hook, no gather): each rank
decodes the same prompts with the same adapters, no collective runs inside, and only the first process writes and
prints. Sharded weights (FSDP, DeepSpeed ZeRO-3) would need every rank in step through ``generate``: no verdict there.

The sample: up to ``SCAN_ROWS`` examples of the validation set (else of the training set) are read; their prompts
are the input_ids before each example's first label (an encoder-decoder's: its encoder inputs), its reference the
label tokens decoded; examples with the same prompt pool their references (one example per reference, as a file of
several references per prompt gives them); ``prompts`` distinct prompts are drawn with a seeded ``random.Random``, the
same at every decoding. A prompt with other inputs than text (an audio clip's ``input_features``, an image's
``pixel_values``, an encoder-decoder's source) is one prompt per distinct inputs, batched alone by the trainer's
``data_collator`` without its labels (per-token fields, as long as ``input_ids``, cut to the prompt) and decoded alone.
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from transformers import TrainerCallback

from loramcl.analysis.outputs import NO_VERDICT, OPTIONS, OutputVerdict, mode_classifier, output_verdict
from loramcl.decoding.candidates import is_encoder_decoder, text_tokenizer
from loramcl.decoding.strategies import generate_hypotheses
from loramcl.mcl.config import MCLConfig
from loramcl.mcl.nll import IGNORE_INDEX
from loramcl.training.specialisation import remedies
from loramcl.utils.validate import OptionError

SCAN_ROWS = 4096  # examples read to find the prompts (a multi-reference file lists a prompt's references together)
# examples read where they carry other inputs than text: a clip or an image is loaded and processed for each, and its
# examples (one per reference: Clotho's 5 captions) come together
SCAN_ROWS_WITH_INPUTS = 256
MAX_NEW_TOKENS = 64  # at most; each decoding stops at the longest reference of its sample
TEXT_COLUMNS = frozenset({"input_ids", "attention_mask", "labels", "position_ids", "token_type_ids", "row"})
SHOWN = 3  # prompts whose answers the console shows at each decoding
logger = logging.getLogger(__name__)


class Undecodable(Exception):
    """Why the sample's prompts cannot be decoded in this run (the verdict abstains with it; training goes on)."""


@dataclass
class Sample:
    """The prompts decoded: their token ids [N][T_i], references [N][R_i], the references' modes (or None), and
    the tokens of the longest reference (what a decoding needs at most); with modes, the classifier of an answer's
    mode (``analysis.outputs.mode_classifier``), fit on the references of every prompt read."""

    prompts: list[list[int]]
    references: list[list[str]]
    modes: list[list[str]] | None
    longest: int
    classifier: object | None = None
    inputs: list[dict] | None = None  # [N] each prompt's example without its labels, where it is more than text


class OutputVerdictCallback(TrainerCallback):
    """Decode ``prompts`` prompts with each hypothesis of ``trainer``'s model at each evaluation and when training
    ends; log the numbers, write the answers to ``path`` (JSONL: one line per prompt and decoding), and at the end
    log the verdict, kept as ``self.verdict`` (and, when one is given, appended to ``state.log_history`` as
    ``{"step", "outputs"}``). ``tokenizer`` (default the trainer's ``processing_class``) decodes the answers;
    ``mode_column``: the examples' column naming each reference's mode, when there is one; ``min_examples``: the
    training examples before a verdict (default ``MIN_EXAMPLES_PER_HYPOTHESIS`` x K)."""

    def __init__(self, trainer, prompts: int = 16, tokenizer=None, mode_column: str = "mode", path=None,
                 seed: int = 0, min_examples: int | None = None) -> None:
        self.trainer, self.count, self.mode_column, self.seed = trainer, prompts, mode_column, seed
        self.min_examples = min_examples
        self.tokenizer = tokenizer if tokenizer is not None else trainer.processing_class
        self.path = Path(path) if path is not None else Path(trainer.args.output_dir) / "outputs.jsonl"
        self.verdict: OutputVerdict | None = None
        self._sample: Sample | str | None = None  # a str: why there is none
        self._last: tuple[int, OutputVerdict] | None = None  # (step, verdict) of the latest decoding
        self.table: list[list[str]] = []  # [step, prompt, reference, h0 .. hK-1] of every decoding: the loggers' table

    def on_evaluate(self, args, state, control, **kwargs):
        self._decode(state)

    def on_train_end(self, args, state, control, **kwargs):
        found = self._decode(state)
        self.verdict = found
        if found.kind != NO_VERDICT:
            state.log_history.append({"step": state.global_step, "outputs": found.to_dict()})
        if state.is_world_process_zero:
            (logger.warning if found.kind == "write the same" else logger.info)(found.line)

    # ---- one decoding ---------------------------------------------------------------------------------

    def _decode(self, state) -> OutputVerdict:
        """The verdict on this step's answers, decoded once per step (an evaluation at the last step serves the end
        of training too); its numbers logged, its answers written."""
        if self._last is not None and self._last[0] == state.global_step:
            return self._last[1]
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        sample = self._sample = self._sample if self._sample is not None else self._draw(model)
        answers = None
        if not isinstance(sample, str):
            try:
                answers = self._answers(model, sample)
            except (OptionError, Undecodable) as error:  # e.g. prompts and references longer than the positions
                sample = str(error)
        if answers is None:
            found = OutputVerdict(NO_VERDICT, f"outputs: no verdict: {sample}.", 0, model.num_hypotheses,
                                  reason=sample)
        else:
            found = output_verdict(answers, sample.references, sample.modes, self._examples_seen(state),
                                   self.min_examples, self._remedies(model),
                                   prompts=[self._text(None, prompt) for prompt in sample.prompts],
                                   classifier=sample.classifier)
            self._report(state, sample, answers, found)
        self._last = (state.global_step, found)
        return found

    def _answers(self, model, sample: Sample) -> list[list[str]]:
        """Each hypothesis's greedy answer to each prompt [N][K], decoded in batches of left-padded prompts (the
        evaluation's batch size, each prompt made K rows)."""
        import torch

        if sample.inputs is not None:
            return [self._answers_alone(model, sample, row) for row in sample.inputs]
        pad, batch = _pad_id(self.tokenizer, model), self.trainer.args.per_device_eval_batch_size
        answers = []
        for start in range(0, len(sample.prompts), batch):
            prompts = sample.prompts[start:start + batch]
            width = max(map(len, prompts))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            decoded = generate_hypotheses(model, self.tokenizer, {"input_ids": ids, "attention_mask": mask},
                                          strategy="greedy", max_new_tokens=min(sample.longest, MAX_NEW_TOKENS),
                                          log_probs=False)
            answers += [[self._text(c.text, c.token_ids) for c in row] for row in decoded]
        return answers

    def _answers_alone(self, model, sample: Sample, row: dict) -> list[str]:
        """Each hypothesis's greedy answer to one prompt with other inputs than text: its example without labels,
        batched by the trainer's collator."""
        try:
            inputs = self.trainer.data_collator([row])
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise Undecodable(f"the trainer's data_collator cannot batch a prompt without its labels ({error!r}): "
                              "decode the saved adapters with loramcl generate and call "
                              "loramcl.analysis.output_verdict") from error
        inputs = {name: value for name, value in inputs.items()
                  if name != "labels" and not isinstance(value, str | int | float | bool | None)}
        try:
            decoded = generate_hypotheses(model, self.tokenizer, inputs, strategy="greedy",
                                          max_new_tokens=min(sample.longest, MAX_NEW_TOKENS), log_probs=False)
        except (TypeError, ValueError, RuntimeError) as error:  # e.g. inputs the model's generate does not take
            raise Undecodable(f"generate does not take this prompt's inputs ({', '.join(sorted(inputs))}: {error}): "
                              "decode the saved adapters with loramcl generate and call "
                              "loramcl.analysis.output_verdict") from error
        return [self._text(c.text, c.token_ids) for c in decoded[0]]

    def _report(self, state, sample: Sample, answers: list[list[str]], found: OutputVerdict) -> None:
        metrics = {f"outputs_{name}": getattr(found, name) for name in (
            "distinct", "same_rate", "best_of_k", "mean_over_k", "exact_best_of_k") if getattr(found, name) is not None}
        self.trainer.log(metrics)  # every rank, as Trainer's own logs: no collective inside
        if not state.is_world_process_zero:
            return
        for i in range(min(SHOWN, len(answers))):
            shown = " | ".join(f"h{k} {_short(a)!r}" for k, a in enumerate(answers[i]))
            logger.info(f"outputs at step {state.global_step}, prompt {_short(self._text(None, sample.prompts[i]))!r}:"
                        f" {shown} (reference {_short(sample.references[i][0])!r})")
        self.table += [[str(state.global_step), self._text(None, sample.prompts[i]), sample.references[i][0], *row]
                       for i, row in enumerate(answers)]
        log_table(self.trainer.args.report_to, ["step", "prompt", "reference", *(f"h{k}" for k in range(
            len(answers[0])))], self.table, new=len(answers))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            for i, row in enumerate(answers):
                record = {"step": state.global_step, "prompt": self._text(None, sample.prompts[i]), "answers": row,
                          "references": sample.references[i]}
                if sample.modes is not None:
                    record["modes"] = sample.modes[i]
                f.write(json.dumps(record, ensure_ascii=False) + "\n")

    # ---- the sample -------------------------------------------------------------------------------------

    def _draw(self, model) -> Sample | str:
        """The prompts decoded at every decoding, or why there are none."""
        if model.num_hypotheses < 2:
            return f"one hypothesis (K = {model.num_hypotheses}), nothing to compare"
        if self.trainer.is_fsdp_enabled or _zero3(self.trainer):
            return ("the model's weights are sharded (FSDP or ZeRO-3), and decoding would need every rank in step: "
                    "decode the saved adapters with loramcl generate and call loramcl.analysis.output_verdict")
        dataset = self.trainer.eval_dataset if self.trainer.eval_dataset is not None else self.trainer.train_dataset
        dataset = next(iter(dataset.values())) if isinstance(dataset, dict) else dataset
        stream = (dataset[i] for i in range(len(dataset))) if hasattr(dataset, "__len__") else iter(dataset)
        rows = list(islice(stream, 1))
        scan = SCAN_ROWS_WITH_INPUTS if rows and _other_inputs(rows[0], self.mode_column) else SCAN_ROWS
        rows += islice(stream, scan - 1)
        if not rows or "labels" not in rows[0] or ("input_ids" not in rows[0]
                                                   and not _other_inputs(rows[0], self.mode_column)):
            return "the examples have no inputs and labels to read prompts and references from"
        encoder_decoder = is_encoder_decoder(model)
        found: dict[tuple, tuple[list[str], list[str], list[int], dict]] = {}  # prompt -> refs, modes, lengths, row
        with_modes = all(self.mode_column in row for row in rows)
        for row in rows:
            ids, labels = self._ids(row.get("input_ids", [])), self._ids(row["labels"])
            mask = self._ids(row.get("attention_mask", [1] * len(ids)))
            first = 0 if encoder_decoder else next((t for t, label in enumerate(labels) if label != IGNORE_INDEX), 0)
            end = len(ids) if encoder_decoder else first
            prompt = tuple(i for i, m in zip(ids[:end], mask[:end], strict=True) if m)
            inputs = {name: row[name] for name in sorted(_other_inputs(row, self.mode_column))}
            if prompt or (encoder_decoder and inputs):  # a text row labelled from its first token has no prompt
                alone = encoder_decoder or bool(inputs)  # decoded alone, its inputs batched by the collator
                key = (prompt, _digest(inputs)) if alone else (prompt,)
                text = sorted(set(row) & TEXT_COLUMNS - {"labels", "row"})
                example = {name: _cut(row[name], end, len(ids)) for name in text} | inputs if alone else {}
                refs, modes, lengths, _ = found.setdefault(key, ([], [], [], example))
                target = [t for t in labels[first:] if t != IGNORE_INDEX]  # its end token included
                refs.append(self._text(None, target))
                modes.append(str(row[self.mode_column]) if with_modes else "")
                lengths.append(len(target))
        if not found:
            return "no example has a prompt (each is labelled from its first token): nothing to decode from"
        chosen = set(random.Random(self.seed).sample(range(len(found)), min(self.count, len(found))))
        drawn = [found[p] for i, p in enumerate(found) if i in chosen]  # in the dataset's order
        return Sample([list(p[0]) for i, p in enumerate(found) if i in chosen], [refs for refs, _, _, _ in drawn],
                      [modes for _, modes, _, _ in drawn] if with_modes else None,
                      max(max(lengths) for _, _, lengths, _ in drawn),
                      mode_classifier([refs for refs, _, _, _ in found.values()],
                                      [modes for _, modes, _, _ in found.values()]) if with_modes else None,
                      [example for _, _, _, example in drawn] if any(example for *_, example in drawn) else None)

    def _examples_seen(self, state) -> int:
        args = self.trainer.args
        return state.global_step * args.per_device_train_batch_size * args.gradient_accumulation_steps * \
            args.world_size

    def _remedies(self, model) -> str | None:
        config = model.mcl_config
        if not isinstance(config, MCLConfig):
            return None
        return remedies(config, self.trainer.log_store.temperature, "not split")[:-1] + f"; or {OPTIONS}."

    def _text(self, text: str | None, ids) -> str:
        """A candidate's text, or token ids decoded (as ids joined by spaces without a tokenizer)."""
        if text is not None:
            return text
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return text_tokenizer(self.tokenizer).decode(list(ids), skip_special_tokens=True)

    @staticmethod
    def _ids(value) -> list[int]:
        return value.tolist() if hasattr(value, "tolist") else list(value)


def log_table(report_to, columns: list[str], rows: list[list[str]], new: int, name: str = "outputs") -> None:
    """``rows`` under ``columns`` (the last ``new`` of them new) to each logger of ``report_to`` that keeps tables
    and has an active run (as TRL's ``LogCompletionsCallback``, which logs to the first two): Weights & Biases and
    Comet the whole table again, MLflow the new rows (its ``log_table`` appends to the file); the others get the
    numbers only."""
    report_to = report_to or []
    if "wandb" in report_to:
        import wandb

        if wandb.run is not None:
            wandb.log({name: wandb.Table(columns=columns, data=rows)})
    if "comet_ml" in report_to:
        import comet_ml

        experiment = comet_ml.get_running_experiment()
        if experiment is not None:
            experiment.log_table(f"{name}.csv", tabular_data=rows, headers=columns)
    if "mlflow" in report_to:
        import mlflow

        if mlflow.active_run() is not None:
            mlflow.log_table({column: [row[i] for row in rows[len(rows) - new:]] for i, column in enumerate(columns)},
                             artifact_file=f"{name}.json")


def example_modes(values: list, rows: list[int], column: str, where) -> list[str]:
    """Each example's mode: its row's ``column`` value (``values``, per row; ``rows``: each example's row), or for a
    row of several references, the entry of its own reference in the row's list (its examples come in their order).
    ``where(i)`` names row i in an error."""
    taken: Counter[int] = Counter()  # examples of each row so far
    modes = []
    for row in rows:
        value = values[row]
        if isinstance(value, list):
            if taken[row] >= len(value):
                raise ValueError(f"{where(row)}: {column} lists {len(value)} modes for more references: give one "
                                 "mode per reference, or one for the row")
            value = value[taken[row]]
        taken[row] += 1
        modes.append(str(value))
    return modes


def _other_inputs(row: dict, mode_column: str) -> set[str]:
    """The fields of an example that a model takes besides its text (an audio clip's features, an image's pixels):
    not token ids, masks, labels, the decoder's inputs (the target, teacher-forced), its mode column or metadata (a
    string or a number)."""
    return {name for name, value in row.items() if name not in TEXT_COLUMNS | {mode_column}
            and not name.startswith("decoder_") and not isinstance(value, str | int | float | bool | None)}


def _digest(inputs: dict) -> str:
    """A prompt's other inputs, as a key: the SHA-256 of their values' bytes."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name, value in sorted(inputs.items()):
        value = value if torch.is_tensor(value) else torch.as_tensor(value)
        digest.update(name.encode() + str(tuple(value.shape)).encode() + value.detach().cpu().contiguous().numpy()
                      .tobytes())
    return digest.hexdigest()


def _cut(value, end: int, length: int):
    """A per-token field (as long as ``length``, the example's input_ids) cut to its first ``end`` tokens."""
    return value[:end] if hasattr(value, "__len__") and len(value) == length else value


def _pad_id(tokenizer, model) -> int:
    tokenizer = text_tokenizer(tokenizer) if tokenizer is not None else None
    for value in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None),
                  getattr(model.base_model.generation_config, "pad_token_id", None),
                  getattr(model.base_model.generation_config, "eos_token_id", None)):
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int):
            return value
    return 0  # masked out: any id does


def _zero3(trainer) -> bool:
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and getattr(plugin, "zero_stage", None) == 3


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


__all__ = ["OutputVerdictCallback", "Sample", "example_modes"]
