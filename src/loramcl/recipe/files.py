"""Recipe files: one common YAML file plus one per training run, merged section by section (as two `--config`
files are by `loramcl train`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from loramcl.inputs import _cached_hub_model

# The path settings of a `loramcl train --config` file, relative to the file that gives them (as the CLI reads them).
RUN_PATHS = (("model",), ("out",), ("data", "train_file"), ("data", "validation_file"))


def merged(base: dict, override: dict) -> dict:
    """``base`` with ``override``'s values, merged key by key inside nested sections."""
    result = dict(base)
    for key, value in override.items():
        inner = result.get(key)
        result[key] = merged(inner, value) if isinstance(value, dict) and isinstance(inner, dict) else value
    return result


def recipe_folder(given: str | None, task: str, files: Sequence[str]) -> Path:
    """The folder holding a task's recipe files: ``given``, else recipes/<task> of the working directory or of this
    repository; an error naming what is missing otherwise."""
    if given and not Path(given).is_dir():
        raise FileNotFoundError(f"--recipes {given}: no such folder; give the folder holding the {task} recipes "
                                f"({', '.join(files)}), or leave --recipes out to use the repository's")
    candidates = [Path(given)] if given else [Path("recipes") / task,
                                              Path(__file__).resolve().parents[3] / "recipes" / task]
    for folder in candidates:
        if all((folder / name).is_file() for name in files):
            return folder
    advice = "give --recipes the folder holding them" if given else "run from the repository root or pass --recipes"
    raise FileNotFoundError(f"no {task} recipes ({', '.join(files)}) in {', '.join(map(str, candidates))}: {advice}")


def read_recipe(folder: Path, names: Sequence[str], overrides: dict | None = None) -> dict:
    """The files ``names`` of ``folder`` merged in order, then ``overrides``. The paths of RUN_PATHS are made absolute
    relative to the file that gives them, as `loramcl train --config` reads them (a model that is no folder there,
    e.g. a Hugging Face id of the local cache, stays as given)."""
    import yaml

    values: dict = {}
    for name in names:
        path = folder / name
        content = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        if not isinstance(content, dict):
            raise ValueError(f"{path} must hold a mapping of settings, got {type(content).__name__}")
        values = merged(values, _absolute_paths(content, path.parent))
    return merged(values, overrides or {})


def _absolute_paths(content: dict, folder: Path) -> dict:
    content = merged({}, content)  # a copy, section by section
    for keys in RUN_PATHS:
        section = content
        for key in keys[:-1]:
            section = section.get(key) if isinstance(section, dict) else None
        value = section.get(keys[-1]) if isinstance(section, dict) else None
        if isinstance(value, str) and value:
            path = os.path.abspath(folder / os.path.expanduser(value))
            hub_model = keys == ("model",) and not os.path.exists(path) and _cached_hub_model(value)
            section[keys[-1]] = value if hub_model else path
    return content


def run_arguments(folder: Path, run: str, root: Path, model: str | None = None, quick: dict | None = None,
                  common: str = "common.yaml") -> dict:
    """The `loramcl train` arguments of one run of a recipe folder (``common`` + <run>.yaml) with its outputs moved
    under ``root``: out = root/<run>, the data files root/data/{train,validation}.jsonl (validation only where the
    recipe has one) and ``model`` when given; ``quick`` overrides merged last."""
    overrides: dict = {"out": str(root / run), "data": {"train_file": str(root / "data" / "train.jsonl")}}
    if model is not None:
        overrides["model"] = model
    values = read_recipe(folder, [common, f"{run}.yaml"], overrides)
    if values.get("data", {}).get("validation_file"):
        values["data"]["validation_file"] = str(root / "data" / "validation.jsonl")
    return merged(values, quick) if quick else values


def run_names(folder: Path, reserved: Sequence[str] = ("common.yaml",)) -> list[str]:
    """The training runs of a recipe folder, one per YAML file but the ``reserved`` ones, sorted: adding a run (a
    baseline, another K) is adding a file."""
    runs = sorted(p.stem for p in Path(folder).glob("*.yaml") if p.name not in reserved)
    if not runs:
        raise FileNotFoundError(f"{folder} holds no run file (one YAML file per training run beside "
                                f"{', '.join(reserved)})")
    return runs


def experiment_values(path: Path, known: Sequence[str], paths: Sequence[str] = ("out",)) -> dict:
    """The settings of a recipe's experiment.yaml, checked against the ``known`` names, with the settings named in
    ``paths`` made absolute relative to the file (as the run files' paths are to theirs)."""
    import yaml

    values = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    unknown = sorted(set(values) - set(known)) if isinstance(values, dict) else values
    if not isinstance(values, dict) or unknown:
        raise ValueError(f"{path}: unknown settings {unknown!r}; known: {sorted(known)}")
    for name in paths:
        if isinstance(values.get(name), str):
            values[name] = os.path.abspath(Path(path).parent / os.path.expanduser(values[name]))
    return values
