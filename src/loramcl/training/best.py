"""A run's adapter files, and ``training.keep_best``: the adapters of the validation with the lowest ``eval_loss``
(the vanilla WTA loss, so for K >= 2 the oracle NLL min_k) kept in ``OUT/best`` beside the last ones, with
``best.json`` ({"step", "eval_loss"}). The folder is written whole (staged, then renamed into place, as checkpoints
are), and a resumed run starts from the best its earlier part recorded, so it never loses or regresses it."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from transformers import TrainerCallback

from loramcl.training.checkpoints import publish, staging_folder
from loramcl.utils.inputs import BEST_FOLDER, PEFT_FOLDER

BEST_RECORD = "best.json"


def write_adapters(model, folder: Path, export_peft: bool, processor, writing: bool, gathering: bool) -> None:
    """The files of a trained model in ``folder``: MCLModel.save_pretrained, a K = 1 LoRA-MCL run's PEFT adapter
    (``export_peft``), the tokenizer or processor. ``writing``: this process writes (the first); ``gathering``:
    every process takes part in gathering sharded adapters (FSDP)."""
    if writing or gathering:
        model.save_pretrained(folder)
        if export_peft:
            model.export_hypothesis(0, folder / PEFT_FOLDER)
    if writing and processor is not None:
        processor.save_pretrained(folder)


def best_record(out: str | Path) -> dict | None:
    """The step and validation loss of the adapters kept in ``out``/best (None: none kept)."""
    path = Path(out) / BEST_FOLDER / BEST_RECORD
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


class BestAdapters(TrainerCallback):
    """Writes ``out``/best each time an evaluation's ``eval_loss`` is below every earlier one of the run (ties keep
    the earlier step). ``resumed``: the run continues from a checkpoint, and the best it recorded stands; otherwise
    a best folder left in ``out`` by an earlier run is removed. The other arguments are ``write_adapters``'s."""

    def __init__(self, model, out: str | Path, export_peft: bool, processor, writing: bool, gathering: bool,
                 resumed: bool) -> None:
        self.model, self.export_peft, self.processor = model, export_peft, processor
        self.writing, self.gathering = writing, gathering
        self.folder = Path(out) / BEST_FOLDER
        record = best_record(out) if resumed else None
        if record is None and writing:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.loss = record["eval_loss"] if record is not None else math.inf

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        loss = (metrics or {}).get("eval_loss")
        if loss is None or not math.isfinite(loss) or loss >= self.loss:
            return
        self.loss = loss
        staged = Path(staging_folder(str(self.folder))) / BEST_FOLDER  # every process sees the same loss: all take part
        if self.writing:
            shutil.rmtree(staged.parent, ignore_errors=True)
        write_adapters(self.model, staged, self.export_peft, self.processor, self.writing, self.gathering)
        if self.writing:
            record = {"step": state.global_step, "eval_loss": loss}
            (staged / BEST_RECORD).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
            publish(str(self.folder))
