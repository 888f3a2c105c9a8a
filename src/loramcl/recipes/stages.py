"""An output folder whose stages run once: each stage is skipped when its outputs exist with the same settings, a
training stage resumes from its last checkpoint, and the wall time of every stage that ran is kept for the report."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loramcl.training.runs import CHECKPOINTS, file_stamp, finished_run, run_stamp, stale_checkpoint_fields
from loramcl.utils.files import read_json, write_json
from loramcl.utils.inputs import BEST_FOLDER, RUN_RECORD
from loramcl.utils.run_best import BEST_RECORD


def data_stats(folder: Path) -> dict:
    """The data stage's record (``folder``/stats.json: its examples, splits, skipped items), its file named if it
    cannot be read."""
    return read_json(Path(folder) / "stats.json",
                     "it was damaged or edited: delete the data folder to prepare it again")


@dataclass
class Stages:
    """The stages of one recipe run under ``root``.

    A stage's *record* is a JSON file ``{"settings": ...}`` written after the stage succeeds (beside its outputs);
    the stage is skipped when its record holds the same settings. A stage whose settings include ``run_stamp`` of a
    training run is redone when that run is retrained.
    """

    root: Path
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.root.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, record: Path, settings: dict, fn: Callable, /, *args, **kwargs) -> bool:
        """``fn(*args, **kwargs)`` unless ``record`` holds ``settings``; then write the record. True if it ran."""
        settings = _as_json(settings)
        saved = read_json(record, "it was damaged or edited: delete it to redo the stage") if record.is_file() else None
        if isinstance(saved, dict) and saved.get("settings") == settings:
            return False
        self.timed(name, fn, *args, **kwargs)
        record.parent.mkdir(parents=True, exist_ok=True)
        write_json(record, {"settings": settings})
        return True

    def train(self, name: str, out: Path, settings: dict, fn: Callable, /, *args, **kwargs) -> bool:
        """A training stage ``fn(*args, **kwargs)`` writing a finished run to ``out`` (``training.fit.fit``): skipped
        when ``out`` holds a finished run of these settings; checkpoints of other settings, and the best adapters
        (``training.keep_best``) of a run trained again, are deleted (the recipe or its data changed), and ``fn`` must
        resume from the checkpoints left. True if it ran."""
        settings = _as_json(settings)
        if finished_run(out, settings):
            return False
        stale = stale_checkpoint_fields(out, settings)
        if stale:
            shutil.rmtree(Path(out) / CHECKPOINTS)
        if stale or (Path(out) / RUN_RECORD).is_file():  # the run is trained again: its best goes with its checkpoints
            shutil.rmtree(Path(out) / BEST_FOLDER, ignore_errors=True)
        self.timed(name, fn, *args, **kwargs)
        return True

    def predictions(self, system: str) -> Path:
        """Where the decoding stage of the system named ``system`` writes its candidates."""
        return self.root / "predictions" / f"{system}.jsonl"

    def decode(self, system, arguments: dict, batch_size: int, test: str | Path, fn: Callable, /, *args,
               extra: dict | None = None, **kwargs) -> bool:
        """The decoding stage of ``system`` (a ``recipes.grid.System``): ``fn(*args, **kwargs)`` writes
        ``self.predictions(system.name)``; redone when its decoding ``arguments``, ``batch_size``, ``extra`` settings,
        its trained run, the best adapters it decodes (a ``best`` system: their best.json, which holds the weights'
        SHA-256, or an ensemble's members') or the ``test`` file change. True if it ran."""
        settings = {**arguments, "batch_size": batch_size, "trained": run_stamp(self.root / system.run),
                    "test": file_stamp(test), **(extra or {})}
        if system.best:  # only then: the records of the last adapters' systems stay as they were
            settings["best"] = file_stamp(self.root / system.run / BEST_FOLDER / BEST_RECORD)
        return self.run(f"generate {system.name}", self.predictions(system.name).with_suffix(".settings.json"),
                        settings, fn, *args, **kwargs)

    def timed(self, name: str, fn: Callable, /, *args, **kwargs):
        started = time.perf_counter()
        result = fn(*args, **kwargs)
        self.timings[name] = round(time.perf_counter() - started, 1)
        return result


def _as_json(settings: dict) -> dict:
    return json.loads(json.dumps(settings))
