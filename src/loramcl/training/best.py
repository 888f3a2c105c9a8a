"""A run's adapter files, and ``training.keep_best``: the adapters of the validation with the lowest ``eval_loss``
(the vanilla WTA loss, so for K >= 2 the oracle NLL min_k) kept in ``OUT/best`` beside the last ones, with
``best.json``: the step, its ``eval_loss``, the SHA-256 of the weights file (``weights_sha256``, as mcl_config.json
records it) and the run (``run``: ``settings_stamp`` of its settings). The folder is written whole (staged, then
renamed into place, as checkpoints are), and a resumed run starts from the best its earlier part recorded, so it
never loses or regresses it.

``OUT/best`` is checked (``utils.run_best.check_best``, on the ground floor so that ``load_model`` makes the same
check on every read as a run's best) on resume: against best.json (the folder whole, the weights' bytes) and the run's
own records (its settings' stamp, its number of steps, the loss its log holds at that step). Any disagreement is one
line naming the folder and what to do; nothing there is deleted: a damaged best folder is the user's to delete or
restore. One exception keeps a kill harmless: a best written after the checkpoint a run resumes
from (killed between the validation and the checkpoint of one step, or before the first checkpoint), of this run's
settings, whole, and within its steps, is replaced when the run validates that step again."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from transformers import TrainerCallback

from loramcl.mcl.adapter_files import WEIGHTS_NAME
from loramcl.training.checkpoints import publish, staging_folder
from loramcl.utils.files import sha256, write_json
from loramcl.utils.inputs import BEST_FOLDER, PEFT_FOLDER
from loramcl.utils.run_best import BEST_RECORD, check_best

# What to do about a best folder that disagrees with its record or its run while training (resume); a read's is
# utils.run_best.RESTORE.
REBUILD = ("delete the folder to let the run rebuild it (from the validations still to run), or restore it from a "
           "copy")
FRESH = "move or delete the folder to start a run in this out, or choose another --out"  # a run not resumed


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


class BestAdapters(TrainerCallback):
    """Writes ``out``/best each time an evaluation's ``eval_loss`` is below every earlier one of the run (ties keep
    the earlier step). When training begins (the checkpoint resumed from, if any, loaded), the best found in ``out``
    is checked (``check_best``, against ``stamp``, the run's ``settings_stamp``) and stands; a best written after the
    checkpoint resumed from is replaced when its step is validated again. The other arguments are
    ``write_adapters``'s."""

    def __init__(self, model, out: str | Path, export_peft: bool, processor, writing: bool, gathering: bool,
                 stamp: str) -> None:
        self.model, self.export_peft, self.processor = model, export_peft, processor
        self.writing, self.gathering, self.out, self.stamp = writing, gathering, Path(out), stamp
        self.folder = self.out / BEST_FOLDER
        self.loss, self.ahead = math.inf, None  # ahead: the step of a best written after the checkpoint resumed from

    def on_train_begin(self, args, state, control, **kwargs):
        resumed = state.global_step  # 0: the run starts from its beginning (every best found is then ahead)
        record = check_best(self.out, self.stamp, state.max_steps, state.log_history, f"the trainer_state.json of "
                            f"checkpoint-{resumed}, resumed from", resumed, REBUILD if resumed else FRESH)
        if record is None:
            return
        if record.get("ahead"):  # the validations logged before it decide, until its step is validated again
            self.ahead = record["step"]
            logged = [entry["eval_loss"] for entry in state.log_history if "eval_loss" in entry]
            self.loss = min([loss for loss in logged if math.isfinite(loss)], default=math.inf)
        else:
            self.loss = record["eval_loss"]

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        loss = (metrics or {}).get("eval_loss")
        if loss is None or not math.isfinite(loss) or (loss >= self.loss and state.global_step != self.ahead):
            return
        self.loss, self.ahead = loss, None
        staged = Path(staging_folder(str(self.folder))) / BEST_FOLDER  # every process sees the same loss: all take part
        if self.writing:
            shutil.rmtree(staged.parent, ignore_errors=True)
        write_adapters(self.model, staged, self.export_peft, self.processor, self.writing, self.gathering)
        if self.writing:
            record = {"step": state.global_step, "eval_loss": loss, "weights_sha256": sha256(staged / WEIGHTS_NAME),
                      "run": self.stamp}
            write_json(staged / BEST_RECORD, record)
            publish(str(self.folder))
