"""A run's adapter files, and ``training.keep_best``: the adapters of the validation with the lowest ``eval_loss``
(the vanilla WTA loss, so for K >= 2 the oracle NLL min_k) kept in ``OUT/best`` beside the last ones, with
``best.json``: the step, its ``eval_loss``, the SHA-256 of the weights file (``weights_sha256``, as mcl_config.json
records it) and the run (``run``: ``settings_stamp`` of its settings). The folder is written whole (staged, then
renamed into place, as checkpoints are), and a resumed run starts from the best its earlier part recorded, so it
never loses or regresses it.

``OUT/best`` is checked as the adapters are (``check_best``), on resume and on every read as a run's best (the
recipes' '<run>@best' rows and ensembles, `loramcl nll --adapters OUT/best`): against best.json (the folder whole, the
weights' bytes) and the run's own records (its settings, its number of steps, the loss its log holds at that step).
Any disagreement is one line naming the folder and what to do; nothing there is deleted: a damaged best folder is the
user's to delete or restore. One exception keeps a kill harmless: a best written after the checkpoint a run resumes
from (killed between the validation and the checkpoint of one step, or before the first checkpoint), of this run's
settings, whole, and within its steps, is replaced when the run validates that step again."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from transformers import TrainerCallback

from loramcl.mcl.adapter_files import CONFIG_NAME, WEIGHTS_NAME
from loramcl.training.checkpoints import publish, staging_folder
from loramcl.utils.files import read_json, sha256
from loramcl.utils.inputs import BEST_FOLDER, PEFT_FOLDER, RUN_RECORD

BEST_RECORD = "best.json"
TRAIN_LOG = "train_log.json"  # a finished run's log_history
# What to do about a best folder that disagrees with its record or its run: while training (resume), and on a read.
REBUILD = ("delete the folder to let the run rebuild it (from the validations still to run), or restore it from a "
           "copy")
RESTORE = "restore it from a copy, or delete it and train the run again with keep_best"
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


def best_record(out: str | Path, remedy: str = RESTORE) -> dict | None:
    """best.json of ``out``/best as written (None: no best folder), unchecked but for its being a JSON object; a best
    folder without it is refused (``remedy``: what to do)."""
    folder = Path(out) / BEST_FOLDER
    if not folder.is_dir():
        return None
    path = folder / BEST_RECORD
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no {BEST_RECORD}, the record of the step and adapters it holds: "
                                f"{remedy}")
    record = read_json(path, remedy)
    if not isinstance(record, dict):
        raise ValueError(f"{path} must hold a JSON object (step, eval_loss, weights_sha256, run), got "
                         f"{json.dumps(record)[:80]}: {remedy}")
    return record


def check_best(out: str | Path, stamp: str, steps: int, log: list, log_name: str, logged_until: int | None = None,
               remedy: str = RESTORE) -> dict | None:
    """best.json of ``out``/best (None: no best folder), checked against the folder and the run, else one line naming
    the folder, what disagrees and ``remedy``.

    stamp: the run's ``settings_stamp``. steps: its number of steps. log: its log_history (``log_name`` says where it
    was read), which holds every validation up to step ``logged_until`` (None: the whole run). A best past
    ``logged_until`` (the checkpoint a run resumes from) cannot be checked against the log: it is returned with
    "ahead": True when it is this run's, else refused. A best.json written before loramcl recorded the weights' SHA-256
    and the run (step and eval_loss only) is checked against mcl_config.json's checksum and the log."""
    record = best_record(out, remedy)
    if record is None:
        return None
    folder = Path(out) / BEST_FOLDER
    step, loss, digest, run = (record.get(name) for name in ("step", "eval_loss", "weights_sha256", "run"))
    legacy = digest is None and run is None and record.keys() == {"step", "eval_loss"}
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0
            and isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss)
            and (legacy or (isinstance(digest, str) and isinstance(run, str)))):
        raise ValueError(f"{folder / BEST_RECORD} is not a best record of loramcl (a step, a finite eval_loss, "
                         f"weights_sha256 and run), got {json.dumps(record)[:160]}: {remedy}")
    weights, config = folder / WEIGHTS_NAME, folder / CONFIG_NAME
    for path in (weights, config):
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no {path.name}: the adapters {BEST_RECORD} describes (step {step}) "
                                    f"are not whole: {remedy}")
    saved = read_json(config, remedy)
    recorded = saved.get("weights_sha256") if isinstance(saved, dict) else None
    actual = sha256(weights)
    if actual != (recorded if legacy else digest) or (not legacy and recorded != digest):
        raise ValueError(f"{weights} is not the adapters {BEST_RECORD} records (SHA-256 {actual[:12]}..., recorded "
                         f"{(recorded if legacy else digest) or 'none'}): they were replaced or damaged: {remedy}")
    if not legacy and run != stamp:
        raise ValueError(f"{folder} holds the best adapters of another run ({BEST_RECORD}: run {run}; this run's "
                         f"settings stamp is {stamp}): {remedy}")
    if step > steps:
        raise ValueError(f"{folder / BEST_RECORD} records step {step}, past the {steps} steps of this run: {remedy}")
    if logged_until is not None and step > logged_until:
        if legacy:
            raise ValueError(f"{folder / BEST_RECORD} records step {step}, after step {logged_until} where this run "
                             f"starts, and no run or checksum to tell that it is this run's: {remedy}")
        return record | {"ahead": True}
    at_step = [entry["eval_loss"] for entry in log if isinstance(entry, dict) and entry.get("step") == step
               and "eval_loss" in entry]
    if loss not in at_step:
        held = f"it logged eval_loss {at_step[-1]!r} at that step" if at_step else "it logged no validation there"
        raise ValueError(f"{folder / BEST_RECORD} records eval_loss {loss!r} at step {step}, which the run's log "
                         f"({log_name}) does not hold ({held}): {remedy}")
    return record


def check_run_best(run: str | Path, remedy: str = RESTORE) -> dict | None:
    """``check_best`` of the finished run in folder ``run``: against its run.json (settings) and train_log.json."""
    from loramcl.training.runs import run_record, settings_stamp

    settings = run_record(run).get("settings")
    if not isinstance(settings, dict) or not isinstance((settings.get("training") or {}).get("steps"), int):
        raise ValueError(f"{Path(run) / RUN_RECORD} holds no settings with training.steps: it was damaged or edited: "
                         "train the run again")
    log = read_json(Path(run) / TRAIN_LOG, "it was damaged or edited: train the run again")
    return check_best(run, settings_stamp(settings), settings["training"]["steps"], log if isinstance(log, list)
                      else [], str(Path(run) / TRAIN_LOG), remedy=remedy)


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
            (staged / BEST_RECORD).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
            publish(str(self.folder))


def check_loaded_best(adapters: str | Path) -> None:
    """``check_run_best`` of the run above ``adapters`` when they are a run's best (OUT/best beside OUT/run.json, as
    `loramcl nll --adapters OUT/best` reads them). An ensemble's assembled best (best.json: its members' records) is
    the recipe runner's to check (``recipes.ensemble.check_best_adapters``)."""
    folder = Path(adapters)
    if folder.name != BEST_FOLDER or not (folder.parent / RUN_RECORD).is_file():
        return
    if "members" not in (best_record(folder.parent) or {}):
        check_run_best(folder.parent)
