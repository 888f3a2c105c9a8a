"""The checkpoint folders of a training run (``output_dir/checkpoint-N``, written by ``MCLTrainer``): published whole
or not at all, checked, rotated, and the one to resume from chosen (docs/guide/reliability.md, "Checkpoints and resuming
after a kill"). Plain operations on folders, and ``StagedCheckpoints``, the two ``TrainerCallback`` s through which
``MCLTrainer`` runs them: the writing rank (``args.should_save``) publishes and rotates; every rank chooses the
checkpoint to resume.

A checkpoint is written into ``STAGING_PREFIX + "checkpoint-N"/checkpoint-N`` (``staging_folder``), then renamed next
to the others (``publish``): a ``checkpoint-N`` folder that exists is whole. The name is the completion marker (a file
inside would change the folder's contents); the adapters' checksum is in its ``mcl_config.json``, checked on resume.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
import zipfile
from collections.abc import Callable, Iterable

import safetensors
import torch
from accelerate import Accelerator, PartialState
from transformers import TrainerCallback
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, sort_checkpoints

from loramcl.mcl.adapter_files import CONFIG_NAME, WEIGHTS_NAME, read_adapters
from loramcl.mcl.compat import upstream_error

CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
# The name matches neither Trainer's `checkpoint-*` glob (rotation) nor its resume pattern.
STAGING_PREFIX = "incomplete-"


def checkpoint_problem(folder: str | os.PathLike, read_weights: bool = True) -> str | None:
    """Why the Trainer checkpoint ``folder`` cannot be resumed from (a file missing, unreadable, cut short or
    damaged), or None when it is whole.

    read_weights: read the adapters in full as loading will (checksum, shapes, finite values: ``read_adapters``).
        False reads headers only (the JSON files, the safetensors header, the end of each torch zip file): enough to
        tell a write cut short, and cheap enough to look at every checkpoint when rotating.
    """
    path = os.path.join(folder, TRAINER_STATE_NAME)
    if not os.path.isfile(path):
        return f"no {TRAINER_STATE_NAME}"
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except ValueError as error:  # JSON or UTF-8
        return f"{TRAINER_STATE_NAME} is not valid JSON ({error})"
    try:
        if read_weights:
            read_adapters(folder)
        else:
            with open(os.path.join(folder, CONFIG_NAME), encoding="utf-8") as f:
                json.load(f)
            with safetensors.safe_open(os.path.join(folder, WEIGHTS_NAME), framework="pt"):
                pass
    except (OSError, ValueError, safetensors.SafetensorError) as error:  # ValueError: JSON, UTF-8, checksum
        return str(error)
    for name in sorted(os.listdir(folder)):  # optimizer, scheduler, scaler, RNG states (torch.save zip archives)
        if name.endswith((".pt", ".pth")) and not zipfile.is_zipfile(os.path.join(folder, name)):
            return f"{name} is cut short or damaged"
    return None


def checkpoint_step(folder: str | os.PathLike) -> int:
    """The global step recorded in a whole checkpoint's trainer state."""
    with open(os.path.join(folder, TRAINER_STATE_NAME), encoding="utf-8") as f:
        return int(json.load(f)["global_step"])


def _checkpoints_by_step(folder: str) -> list[tuple[int, str]]:
    """[(N, folder/checkpoint-N)] of the checkpoint folders in ``folder``, highest N first."""
    if not os.path.isdir(folder):
        return []
    found = [(int(match[1]), os.path.join(folder, name)) for name in os.listdir(folder)
             if (match := CHECKPOINT_NAME.match(name)) and os.path.isdir(os.path.join(folder, name))]
    return sorted(found, reverse=True)


# ---- writing: staged, then published by one rename -------------------------------------------------------------

def staging_folder(checkpoint: str) -> str:
    """Where ``run_dir/checkpoint-N`` is written before it is published: ``run_dir/incomplete-checkpoint-N``, whose
    ``checkpoint-N`` Trainer fills (Trainer's rotation inside it finds nothing to delete)."""
    return os.path.join(os.path.dirname(checkpoint), STAGING_PREFIX + os.path.basename(checkpoint))


def remove_staging_leftovers(run_dir: str) -> None:
    """Remove the staging folders that writes killed earlier left in ``run_dir``."""
    for leftover in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
        if leftover.startswith(STAGING_PREFIX + PREFIX_CHECKPOINT_DIR):
            shutil.rmtree(os.path.join(run_dir, leftover), ignore_errors=True)


def publish(checkpoint: str) -> None:
    """Rename the whole folder written in ``staging_folder(checkpoint)`` to ``checkpoint`` (one rename on the same file
    system), then remove the staging folder."""
    staging = staging_folder(checkpoint)
    staged = os.path.join(staging, os.path.basename(checkpoint))
    _fsync_tree(staged)
    if os.path.isdir(checkpoint):  # the same step of an earlier, abandoned run: replaced as a whole
        os.replace(checkpoint, os.path.join(staging, "replaced"))
    os.replace(staged, checkpoint)
    _fsync(os.path.dirname(checkpoint))  # the rename itself
    shutil.rmtree(staging, ignore_errors=True)


def _fsync(path: str) -> None:
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:  # a folder cannot be opened on some systems (Windows): nothing to flush there
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_tree(folder: str) -> None:
    """Flush every file and folder under ``folder`` to disk, so that after a power cut the renamed folder is not
    an empty shell (a killed process alone loses nothing it wrote)."""
    for root, _, files in os.walk(folder):
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root)


def rotate_checkpoints(run_dir: str, limit: int | None, keep: Iterable[str | None]) -> None:
    """``save_total_limit`` (``limit``) as Trainer applies it (oldest first, by modification time), except that the
    checkpoints in ``keep`` (the one just written, the best one) are always kept, and damaged checkpoints are deleted
    first: an older or skewed folder must never push out the one a resume needs."""
    if limit is None or limit <= 0:
        return
    kept = {os.path.abspath(path) for path in keep if path is not None and os.path.isdir(path)}
    others = [path for path in sort_checkpoints(run_dir, use_mtime=True) if os.path.abspath(path) not in kept]
    whole = [path for path in others if checkpoint_problem(path, read_weights=False) is None]
    excess = len(whole) - max(limit - len(kept), 0)
    for path in [path for path in others if path not in whole] + whole[:max(excess, 0)]:
        shutil.rmtree(path, ignore_errors=True)


class StagedCheckpoints(TrainerCallback):
    """Checkpoints written whole or not at all, through two callbacks: this one, last of the trainer's callbacks (so
    that ``control.should_save`` is final), points ``args.output_dir`` (the trainer's own copy of the arguments) at
    ``staging_folder`` once the step that saves has ended, so that Trainer writes ``checkpoint-N`` there; ``publisher``,
    first of the callbacks (so that every other ``on_save`` sees the published folder), points it back, waits for
    every rank's files, publishes and rotates.

    wait_for_pushes: returns once the Hub uploads Trainer started from the staged folder are done (``push_to_hub``).
    """

    def __init__(self, wait_for_pushes: Callable[[], None]) -> None:
        self.run_dir: str | None = None  # while a checkpoint may be written: the output_dir it is published to
        self.wait_for_pushes = wait_for_pushes
        self.publisher = _Publish(self)

    def put_in_order(self, callbacks: list[TrainerCallback]) -> None:
        """Staging last of the trainer's ``callbacks``, publishing first, whatever was added since."""
        for callback in (self, self.publisher):
            if callback in callbacks:
                callbacks.remove(callback)
        callbacks.insert(0, self.publisher)
        callbacks.append(self)

    def unstage(self, args) -> None:
        """Point ``args.output_dir`` back at the run's folder (after a save, an evaluation that saved nothing, an
        error)."""
        if self.run_dir is not None:
            args.output_dir, self.run_dir = self.run_dir, None

    def _stage(self, args, state, control) -> None:
        self.unstage(args)
        saving = control.should_save or (args.save_strategy == SaveStrategy.BEST and control.should_evaluate)
        if not saving or state.is_hyper_param_search:  # a trial writes under output_dir/run-*: in place
            return
        if args.should_save:
            remove_staging_leftovers(args.output_dir)  # what writes killed earlier left behind
        PartialState().wait_for_everyone()  # no rank writes its RNG state into a folder being removed
        self.run_dir = args.output_dir
        args.output_dir = staging_folder(os.path.join(self.run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"))

    def on_step_end(self, args, state, control, **kwargs):
        self._stage(args, state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._stage(args, state, control)

    def on_step_begin(self, args, state, control, **kwargs):
        self.unstage(args)

    def on_train_end(self, args, state, control, **kwargs):
        self.unstage(args)

    def publish(self, args, state) -> None:
        if self.run_dir is None:
            return
        staging, run_dir = args.output_dir, self.run_dir
        self.unstage(args)
        checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        PartialState().wait_for_everyone()  # every rank's files (RNG states, shards) are in the folder
        staged = os.path.join(staging, os.path.basename(checkpoint))
        if args.should_save and not os.path.isdir(staged):  # Trainer no longer writes into args.output_dir
            raise upstream_error(f"Trainer did not write {os.path.basename(checkpoint)} into the output_dir of its "
                                 f"arguments ({staging}), where MCLTrainer stages checkpoints to publish them whole",
                                 "train with the versions loramcl was tested with")
        if state.best_model_checkpoint == staged:  # Trainer recorded the staging path (on every rank)
            state.best_model_checkpoint = checkpoint
            if args.should_save:
                state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
        if args.should_save:
            self.wait_for_pushes()  # an upload reads the staged folder
            publish(checkpoint)
            rotate_checkpoints(run_dir, args.save_total_limit, keep=(checkpoint, state.best_model_checkpoint))
        PartialState().wait_for_everyone()  # on_save callbacks of every rank see the published checkpoint


class _Publish(TrainerCallback):
    def __init__(self, staged: StagedCheckpoints) -> None:
        self.staged = staged

    def on_save(self, args, state, control, **kwargs):
        self.staged.publish(args, state)


# ---- resuming --------------------------------------------------------------------------------------------------

def checkpoint_to_resume(request: str | os.PathLike | bool, output_dir: str, say: bool) -> str | None:
    """The whole checkpoint to resume from for ``train(resume_from_checkpoint=request)``, or None to start from the
    beginning: the newest whole one in ``output_dir`` for True; for a path, that checkpoint, or when it is damaged the
    newest whole one before it. ``say``: warn about each checkpoint skipped (one rank warns)."""
    chosen = folder = before = None
    if request is True:
        folder = output_dir
    else:
        path = os.fspath(request)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"resume_from_checkpoint={path!r} is not a folder; pass a checkpoint-N folder "
                                    "written by the trainer, or True for the newest one in output_dir")
        problem = checkpoint_problem(path)
        if problem is None:
            chosen = path
        elif (match := CHECKPOINT_NAME.match(os.path.basename(os.path.normpath(path)))) is None:
            raise ValueError(f"cannot resume from {path}: {problem}")
        else:
            if say:
                warnings.warn(f"checkpoint {path} is incomplete ({problem}); resuming from the newest whole "
                              "checkpoint before it", stacklevel=3)
            folder, before = os.path.dirname(os.path.normpath(path)), int(match[1])
    if folder is not None:
        for step, candidate in _checkpoints_by_step(folder):
            if before is not None and step >= before:
                continue
            problem = checkpoint_problem(candidate)
            if problem is None:
                chosen = candidate
                break
            if say:
                warnings.warn(f"skipping the incomplete checkpoint {candidate} ({problem}); trying an earlier "
                              "one", stacklevel=3)
        if chosen is None and say:
            warnings.warn(f"no whole checkpoint to resume from in {folder}: training starts from the beginning",
                          stacklevel=3)
    return chosen


def same_on_every_rank(checkpoint: str | None, accelerator: Accelerator) -> str | None:
    """``checkpoint``, once every rank has chosen the same step to resume from (they resume the same or none)."""
    step = -1 if checkpoint is None else checkpoint_step(checkpoint)
    steps = accelerator.gather(torch.tensor([step], device=accelerator.device))  # [world size]
    if (steps != step).any():
        raise RuntimeError(f"the ranks found different checkpoints to resume from (global steps {steps.tolist()}, "
                           "-1 = none): every rank must see the same files")
    return checkpoint
