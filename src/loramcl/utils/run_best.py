"""The check of a run's best adapters (``OUT/best``, written by ``training.keep_best``), on the ground floor so that
every reader can make it: ``load_model`` (so `loramcl generate`, `loramcl nll`, `loramcl export` and the recipes'
decoding and scoring), the resume of a run (``training.best.BestAdapters``) and the recipe runner's '<run>@best' rows
and ensembles. Imports nothing heavy.

``OUT/best/best.json`` records the step, its ``eval_loss``, the SHA-256 of the weights file (``weights_sha256``, as
mcl_config.json records it) and the run (``run``: the ``settings_stamp`` of its settings, ``training.runs``, which
`loramcl train` also records in run.json as ``settings_stamp``). The folder is checked against it (the files whole,
the weights' bytes) and against the run's own records (its stamp, its number of steps, the loss its log holds at that
step); any disagreement is one line naming the folder and what to do, and nothing is deleted."""

from __future__ import annotations

import json
import math
from pathlib import Path

from loramcl.utils.files import read_json, sha256
from loramcl.utils.inputs import BEST_FOLDER, MCL_CONFIG, MCL_WEIGHTS, PEFT_FOLDER, RUN_RECORD

BEST_RECORD = "best.json"
TRAIN_LOG = "train_log.json"  # a finished run's log_history
STAMP = "settings_stamp"  # in run.json: the run's settings stamp, which best.json's "run" must equal
# What to do about a best folder that disagrees with its record or its run when it is read
RESTORE = "restore it from a copy, or delete it and train the run again with keep_best"


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


def check_best(out: str | Path, stamp: str | None, steps: int, log: list, log_name: str,
               logged_until: int | None = None, remedy: str = RESTORE) -> dict | None:
    """best.json of ``out``/best (None: no best folder), checked against the folder and the run, else one line naming
    the folder, what disagrees and ``remedy``.

    stamp: the run's ``settings_stamp`` (None: a run.json written before loramcl recorded it, whose best is not
    compared with it). steps: its number of steps. log: its log_history (``log_name`` says where it was read), which
    holds every validation up to step ``logged_until`` (None: the whole run). A best past ``logged_until`` (the
    checkpoint a run resumes from) cannot be checked against the log: it is returned with "ahead": True when it is this
    run's, else refused. A best.json written before loramcl recorded the weights' SHA-256 and the run (step and
    eval_loss only) is checked against mcl_config.json's checksum and the log."""
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
    weights, config = folder / MCL_WEIGHTS, folder / MCL_CONFIG
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
    if not legacy and stamp is not None and run != stamp:
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
    """``check_best`` of the finished run in folder ``run``: against its run.json (settings stamp, steps) and
    train_log.json."""
    path = Path(run) / RUN_RECORD
    record = read_json(path, "it was damaged or edited: train the run again")
    settings = record.get("settings") if isinstance(record, dict) else None
    if not isinstance(settings, dict) or not isinstance((settings.get("training") or {}).get("steps"), int):
        raise ValueError(f"{path} holds no settings with training.steps: it was damaged or edited: train the run again")
    stamp = record.get(STAMP)
    if not (stamp is None or isinstance(stamp, str)):
        raise ValueError(f"{path}: {STAMP} must be the run's settings stamp (a string), got {json.dumps(stamp)[:80]}: "
                         "it was damaged or edited: train the run again")
    log = read_json(Path(run) / TRAIN_LOG, "it was damaged or edited: train the run again")
    return check_best(run, stamp, settings["training"]["steps"], log if isinstance(log, list) else [],
                      str(Path(run) / TRAIN_LOG), remedy=remedy)


def check_loaded_best(adapters: str | Path) -> None:
    """``check_run_best`` of the run above ``adapters`` when they are a run's best: OUT/best beside OUT/run.json, or
    the PEFT export of a K = 1 run's best (OUT/best/peft), as `loramcl generate`, `loramcl nll` and every
    ``load_model`` read them. An ensemble's assembled best (best.json: its members' records) is the recipe runner's to
    check (``recipes.ensemble.check_best_adapters``)."""
    folder = Path(adapters)
    if folder.name == PEFT_FOLDER and folder.parent.name == BEST_FOLDER:
        folder = folder.parent
    if folder.name != BEST_FOLDER or not (folder.parent / RUN_RECORD).is_file():
        return
    if "members" not in (best_record(folder.parent) or {}):
        check_run_best(folder.parent)
