"""The record of a training run, read by ``loramcl train`` (to resume or skip it) and by the recipes' stages (to
reuse what was made from it): the settings it was trained with, its checkpoints' settings, and stamps that change
when a run is retrained or an input file changes. Imports nothing heavy."""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, fields
from pathlib import Path

from loramcl.baselines.config import MoEConfig, MultiHeadConfig
from loramcl.mcl.config import MCLConfig, without_defaults_added_later
from loramcl.training.config import DataConfig, TrainConfig
from loramcl.utils.files import read_json, sha256
from loramcl.utils.inputs import RUN_RECORD
from loramcl.utils.run_record import RunRecord

CHECKPOINTS = "checkpoints"  # Trainer's resumable checkpoints of a run, inside its `out` folder
SETTINGS_NAME = "settings.json"  # in CHECKPOINTS: what the checkpoints were trained with, checked on resume


def finished_run(out: str | Path, settings: dict) -> bool:
    """Whether `out` holds a finished `loramcl train` run with these settings (from ``run_settings``)."""
    path = Path(out) / RUN_RECORD
    return path.is_file() and not _differing(_record_settings(path), settings)


def _record_settings(path: Path) -> dict:
    """The "settings" of a run.json (an empty dict when the record has none)."""
    record = read_json(path, "it was damaged or edited: train the run again, or delete the folder")
    return (record.get("settings") if isinstance(record, dict) else None) or {}


METHOD_CONFIGS = {"mcl": MCLConfig, "moe": MoEConfig, "multihead": MultiHeadConfig}  # a run's method -> its settings


def run_settings(model: str, mcl, data: DataConfig | None, training: TrainConfig, dtype: str, method: str = "mcl",
                 examples: dict | None = None, files: dict[str, str | Path] | None = None) -> dict:
    """Everything that decides a run's adapters, as JSON (as read back from run.json: lists, not tuples): its model,
    its method's configuration (``mcl`` is that of ``method``, recorded under the method's name), its ``data``
    settings (a run on dataset files, `loramcl train`), its training settings and dtype, what its examples depend on
    beside the data files (``examples``: a recipe that builds its examples in Python, ``recipes.steps``), and the
    SHA-256 of its data files (a rebuilt file under the same name is another run): ``data``'s train and validation
    files, else ``files`` ({role: path}). A finished run's run.json and its checkpoints record it."""
    if data is not None:
        files = {"train": data.train_file, "validation": data.validation_file}
    settings = {"model": model, **method_settings(method, mcl), **({"data": asdict(data)} if data is not None else {}),
                "training": without_defaults_added_later(asdict(training)), "dtype": dtype, **(examples or {}),
                "data_sha256": {name: data_sha256(path) for name, path in (files or {}).items() if path}}
    return json.loads(json.dumps(settings))


def data_sha256(path: str | Path) -> str:
    """The SHA-256 of a data file; of a folder (a save_to_disk dataset), that of its files' names and hashes."""
    if not Path(path).is_dir():
        return sha256(path)
    files = sorted(p for p in Path(path).rglob("*") if p.is_file())
    listing = "".join(f"{p.relative_to(path).as_posix()} {sha256(p)}\n" for p in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def method_settings(method: str, config) -> dict:
    """How a run's settings record its method's configuration: LoRA-MCL's under "mcl", a baseline's under its
    method's name with "method" naming it (``recipes.files.method_of`` reads them back)."""
    return {"mcl": config.to_dict()} if method == "mcl" else {"method": method, method: config.to_dict()}

def quantization_settings(quantization: str | None) -> dict:
    """How a run's settings record the quantization of its base (QLoRA-MCL): only where there is one, so that the
    settings of runs on a plain base stay as they were (and their checkpoints resume)."""
    return {"quantization": quantization} if quantization else {}

# Fields that decide how a run is computed, not its adapters: a run resumed or compared with another value is the same
_COMPUTATION_ONLY = {"mcl": ("logits_chunk_size",), "training": ("compile", "output_verdict", "mode_column")}
# Fields that act only under one loss (loss name, fields): a run under another loss is the same whatever they hold (a
# WTA run recorded when `loramcl train`'s temperature_decay default was 0.999 is the run of today's default, "auto")
_LOSS_ONLY = {"mcl": ("annealed", ("temperature0", "temperature_decay", "temperature_min"))}


def _as_configs(settings: dict) -> dict:
    """``settings`` with each configuration section rebuilt through its dataclass, so that a field added to
    loramcl since a run was recorded compares at its default (an option added later is off by default: the run
    is the same) rather than as a difference."""
    result = dict(settings)
    for key, value in settings.items():
        try:
            if key in METHOD_CONFIGS and isinstance(value, dict):
                result[key] = METHOD_CONFIGS[key].from_dict(value).to_dict()
                for name in _COMPUTATION_ONLY.get(key, ()):
                    del result[key][name]
                loss, fields = _LOSS_ONLY.get(key, (None, ()))
                for name in fields if result[key].get("loss") != loss else ():
                    del result[key][name]
            elif key in ("data", "training") and isinstance(value, dict):
                result[key] = asdict((DataConfig if key == "data" else TrainConfig)(**value))
                for name in _COMPUTATION_ONLY.get(key, ()):
                    del result[key][name]
        except (TypeError, ValueError):  # a field removed or renamed since: compared as recorded
            pass
    return json.loads(json.dumps(result))


def _differing(saved: dict, settings: dict) -> list[str]:
    saved, settings = _as_configs(saved), _as_configs(settings)
    return sorted(key for key in saved.keys() | settings.keys() if saved.get(key) != settings.get(key))


def stale_checkpoint_fields(out: str | Path, settings: dict) -> list[str]:
    """The settings in which the checkpoints under `out` differ from ``settings`` ([] if none or no checkpoints)."""
    folder = Path(out) / CHECKPOINTS
    if not any(folder.glob("checkpoint-*")):
        return []
    path = folder / SETTINGS_NAME
    if not path.is_file():
        return [f"unknown: no {SETTINGS_NAME} beside them"]
    return _differing(read_json(path, f"it was damaged or edited: delete {folder} to train the run afresh"), settings)


def file_stamp(path: str | Path) -> str:
    """Identifies a stage's input file by the hash of its bytes: a decoding or scoring stage keyed by it is redone
    when the test set changes under the same name."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def run_stamp(run: Path) -> str:
    """Identifies a finished training run by the hash of its run.json (which holds its wall time to 0.1 s), so that
    outputs made from an older run of the same name are not reused."""
    return file_stamp(Path(run) / RUN_RECORD)


def run_record(run: Path) -> RunRecord:
    """The run.json of a finished training run (``training.fit.fit``), typed."""
    return RunRecord.read(run)


def settings_stamp(settings: dict) -> str:
    """Identifies a run by its settings (``run_settings``) as resuming compares them: two settings that
    ``stale_checkpoint_fields`` finds the same have the same stamp. Fields that decide only how a run is computed are
    left out, and so is every configuration field at its default, so that a field added to loramcl after a run was
    recorded (at its default: the same run) leaves the run's stamp as it was."""
    values = _as_configs(settings)
    for key, config in {**METHOD_CONFIGS, "data": DataConfig, "training": TrainConfig}.items():
        if isinstance(values.get(key), dict):
            defaults = {f.name: f.default if f.default is not MISSING else f.default_factory()
                        for f in fields(config) if f.default is not MISSING or f.default_factory is not MISSING}
            defaults = json.loads(json.dumps(defaults, default=str))
            values[key] = {name: value for name, value in values[key].items()
                           if name not in defaults or value != defaults[name]}
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]
