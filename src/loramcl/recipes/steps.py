"""The recipe step library: the training stage of a run, the decoding of a system to JSONL and the scoring of the test
references to JSONL, for every task whose examples are built in Python from a model's processor (audio captioning,
image captioning, spoken translation). ``ProcessorTask`` composes them from what such a task gives: its processor, its
training sets, how a batch of test inputs is encoded and how the references of a test input become examples. The
text tasks run the same stages through the library commands `loramcl train`, `generate` and `nll`
(``recipes.text.TextTask``)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from loramcl.recipes import runner
from loramcl.recipes.grid import DecodeConfig, System, systems_of
from loramcl.utils.run_record import RunFile

logger = logging.getLogger(__name__)  # a stage's progress, which the command shows (docs/guide/cli.md)
TRAINING_FILES = ("train", "validation")
"""The data stage's files a run trains on (those written), whose SHA-256 its settings record."""


def run_file_settings(values: dict, training, data: Path, examples: dict) -> dict:
    """``training.runs.run_settings`` of a run file (``values``) of a task whose examples are built in Python: no
    `data:` block, but the quantization of its base, what its ``examples`` depend on beside the data, and the SHA-256
    of the data stage's files it trains on (``data``/{train,validation}.jsonl, those written)."""
    from loramcl.recipes.files import method_of
    from loramcl.training.runs import quantization_settings, run_settings

    run, (method, config) = RunFile.of(values), method_of(values)
    files = {role: data / f"{role}.jsonl" for role in TRAINING_FILES}
    return run_settings(run.model, config, None, training, run.dtype, method,
                        examples=quantization_settings(run.quantization) | examples,
                        files={role: path for role, path in files.items() if path.is_file()})


def fit_run(values: dict, training, settings: dict, examples: Callable[[], tuple]) -> dict:
    """Train one run with ``training.fit.fit`` (the files and record of `loramcl train`), resuming from its
    checkpoints: ``examples()`` gives (processor, train set, eval set or None, collator), built only when the run
    trains."""
    from loramcl.models.load import training_model_loader
    from loramcl.recipes.files import method_of
    from loramcl.training.fit import fit, resumable_checkpoint

    run, (method, config) = RunFile.of(values), method_of(values)
    processor, train_set, eval_set, collator = examples()
    # quantized (the run's decoding reads it back from its run.json), loaded where this process trains
    loader = training_model_loader(run.model, run.dtype, run.quantization)
    return fit(loader, run.out, config, training, settings, train_set, eval_set, collator=collator,
               processor=processor, last_checkpoint=resumable_checkpoint(run.out, settings, True), method=method)


def decode_to_jsonl(out: Path, model, processor, items: dict, batch_size: int, arguments: dict,
                    inputs: Callable[[list], tuple[dict, Callable | None]],
                    prediction: Callable[[object, list], dict]) -> Path:
    """K candidates per test input with ``generate_hypotheses`` (``arguments``: a ``recipes.grid.System``'s), written
    as `loramcl evaluate` reads predictions, one ``prediction(id, candidates)`` per line in the order of ``items``
    ({id: test input}). Batch b decodes with seed + b; ``inputs(batch of test inputs, tta strength or None)`` gives
    the model's inputs and, for test-time augmentation, the augmentation of those inputs."""
    from loramcl.decoding.strategies import generate_hypotheses

    arguments = dict(arguments)
    seed, strength = arguments.pop("seed", 0), arguments.pop("tta_strength", None)
    rows = list(items.items())
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for b, start in enumerate(range(0, len(rows), batch_size)):
            chunk = rows[start:start + batch_size]
            batch, augment = inputs([item for _, item in chunk], strength)
            extra = {"augment": augment} if arguments["strategy"] == "tta" else {}
            outs = generate_hypotheses(model, processor, batch, seed=seed + b, **arguments, **extra)
            for (key, _), candidates in zip(chunk, outs, strict=True):
                f.write(json.dumps(prediction(key, candidates), ensure_ascii=False) + "\n")
    logger.info(f"{len(rows)} inputs x {len(outs[0]) if rows else 0} candidates ({arguments['strategy']}): {out}")
    return out


def score_to_jsonl(out: Path, model, references: Iterable[tuple[object, list]], collator: Callable, batch_size: int,
                   device: str) -> Path:
    """The NLL of every reference of every test input under every hypothesis of ``model`` (mean per label token, as
    in training): {"id", "nll": [[K] per reference]} per test input, what `loramcl evaluate --nll` reads for the
    oracle test NLL (paper App. E.1). ``references``: (id, the training examples of its references) per test input;
    ``collator`` batches them as in training."""
    import torch
    from accelerate.utils import send_to_device

    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f, torch.no_grad():
        for key, examples in references:
            nll = [model(**send_to_device(collator(examples[i:i + batch_size]), device)).nll.float().cpu()
                   for i in range(0, len(examples), batch_size)]  # each [b, K]
            f.write(json.dumps({"id": key, "nll": torch.cat(nll).tolist()}) + "\n")
    return out


class ProcessorTask(runner.Task):
    """A task whose runs train with ``training.fit.fit`` on examples it builds from the model folder's processor, and
    whose systems decode and references score with the step functions above. A subclass gives, beside the runner's
    hooks (experiment, systems, data, report): ``training_sets``, ``collate`` (or a whole ``collator``),
    ``test_inputs``, ``inputs`` and, to score its references, ``reference_examples``."""

    def systems(self, values: dict[str, dict], budgets: list[int]) -> list[System]:
        """The decoded runs' systems at each budget as ``recipes.grid.systems_of`` lists them from the experiment's
        mcl_decodings, diversity_penalties, tta and sampling."""
        decoded = self.experiment.decoded_runs(list(values))
        return systems_of(self.experiment, {run: self.hypotheses(values[run]) for run in decoded}, budgets)

    def processor(self, model: str):
        """The processor of the model folder ``model``: it encodes the examples, decodes the candidates and is saved
        with each run."""
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(model)

    def training_config(self, values: dict):
        """A run's TrainConfig (its `training:` settings)."""
        from loramcl.training.config import TrainConfig

        return TrainConfig(**RunFile.of(values).training)

    def example_settings(self, values: dict) -> dict:
        """What a run's examples depend on beside the data files (e.g. the prompt): recorded in its settings."""
        return {}

    def training_sets(self, values: dict, training, processor) -> tuple[Sequence, Sequence | None]:
        """(training examples, validation examples or None) of a run, from the data stage's files."""
        raise NotImplementedError(f"{type(self).__name__} gives no training_sets")

    def collate(self) -> Callable[[list, int], dict]:
        """The task's batching of training examples into the model's inputs (with labels), given the padding id."""
        raise NotImplementedError(f"{type(self).__name__} gives no collate")

    def collator(self, processor) -> Callable[[list], dict]:
        """Batches a list of training examples: ``collate`` with the padding id of the processor's tokenizer."""
        from loramcl.data.prompts import pad_token_id

        pad, collate = pad_token_id(processor.tokenizer), self.collate()
        return lambda rows: collate(rows, pad)

    def test_inputs(self) -> dict:
        """{id: test input} of ``self.test``, in its order."""
        raise NotImplementedError(f"{type(self).__name__} gives no test_inputs")

    def inputs(self, processor, batch: list, strength) -> tuple[dict, Callable | None]:
        """The model's inputs for a batch of test inputs, and for test-time augmentation at ``strength`` (a
        ``tta`` system's (time, frequency); else None) the augmentation ``generate_hypotheses`` applies to them."""
        raise NotImplementedError(f"{type(self).__name__} gives no inputs")

    def reference_examples(self, processor) -> Iterable[tuple[object, list]]:
        """(id, the training examples of its references) per test input, for ``score``."""
        raise NotImplementedError(f"{type(self).__name__} scores no reference")

    def decoding_model(self, values: dict, adapters: str, processor):
        """The run's model as it decodes, on ``self.device``."""
        from loramcl.models.load import load_model

        run = RunFile.of(values)
        return load_model(run.model, adapters, run.dtype, self.device)

    def prediction(self, key, candidates: list, processor) -> dict:
        """The predictions line of one test input: {"id", "candidates", "log_probs"} (+ "hypotheses")."""
        from loramcl.decoding.predictions import prediction_record

        return prediction_record(key, candidates)

    def train(self, run: str, values: dict) -> None:
        run_file, training = RunFile.of(values), self.training_config(values)
        settings = run_file_settings(values, training, self.data, self.example_settings(values))

        def examples() -> tuple:
            processor = self.processor(run_file.model)
            return processor, *self.training_sets(values, training, processor), self.collator(processor)

        self.stages.train(f"train {run}", Path(run_file.out), settings, fit_run, values, training, settings, examples)

    def decode(self, system: System, values: dict, arguments: dict, decode: DecodeConfig) -> None:
        processor = self.processor(RunFile.of(values).model)
        model = self.decoding_model(values, str(self.decoded_folder(system)), processor)
        decode_to_jsonl(self.stages.predictions(system.name), model, processor, self.test_inputs(), decode.batch_size,
                        arguments, lambda batch, strength: self.inputs(processor, batch, strength),
                        lambda key, candidates: self.prediction(key, candidates, processor))

    def score(self, run: str, values: dict, decode: DecodeConfig, out: Path) -> None:
        from loramcl.models.load import load_model

        run_file = RunFile.of(values)
        processor = self.processor(run_file.model)
        model = load_model(run_file.model, str(self.scored_folder(run)), run_file.dtype, self.device)
        score_to_jsonl(out, model, self.reference_examples(processor), self.collator(processor), decode.batch_size,
                       self.device)
