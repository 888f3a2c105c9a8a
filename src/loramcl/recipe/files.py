"""Recipe files: one common YAML file plus one per training run, merged section by section (as two `--config`
files are by `loramcl train`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


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
    candidates = [Path(given)] if given else [Path("recipes") / task,
                                              Path(__file__).resolve().parents[3] / "recipes" / task]
    for folder in candidates:
        if all((folder / name).is_file() for name in files):
            return folder
    raise FileNotFoundError(f"no {task} recipes ({', '.join(files)}) in {', '.join(map(str, candidates))}: run "
                            "from the repository root or pass --recipes")


def read_recipe(folder: Path, names: Sequence[str], overrides: dict | None = None) -> dict:
    """The files ``names`` of ``folder`` merged in order, then ``overrides``."""
    import yaml

    values: dict = {}
    for name in names:
        path = folder / name
        content = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        if not isinstance(content, dict):
            raise ValueError(f"{path} must hold a mapping of settings, got {type(content).__name__}")
        values = merged(values, content)
    return merged(values, overrides or {})


def run_names(folder: Path, reserved: Sequence[str] = ("common.yaml",)) -> list[str]:
    """The training runs of a recipe folder, one per YAML file but the ``reserved`` ones, sorted: adding a run (a
    baseline, another K) is adding a file."""
    runs = sorted(p.stem for p in Path(folder).glob("*.yaml") if p.name not in reserved)
    if not runs:
        raise FileNotFoundError(f"{folder} holds no run file (one YAML file per training run beside "
                                f"{', '.join(reserved)})")
    return runs
