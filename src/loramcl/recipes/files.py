"""Recipe files: one common YAML file plus one per training run, merged section by section (as two `--config`
files are by `loramcl train`), and the recipes that ship inside the package, found by name."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from loramcl.utils.inputs import absolute_path, cached_hub_model
from loramcl.utils.run_record import RunFile
from loramcl.utils.validate import require

# The path settings of a `loramcl train --config` file, relative to the file that gives them (as the CLI reads them).
RUN_PATHS = (("model",), ("out",), ("data", "train_file"), ("data", "validation_file"))


def merged(base: dict, override: dict) -> dict:
    """``base`` with ``override``'s values, merged key by key inside nested sections."""
    result = dict(base)
    for key, value in override.items():
        inner = result.get(key)
        result[key] = merged(inner, value) if isinstance(value, dict) and isinstance(inner, dict) else value
    return result


def packaged_recipes() -> Path:
    """The folder of the recipes that ship inside the package (package data, `src/loramcl/recipes/` in a checkout):
    one folder per recipe, `<task>/<name>` (or `<task>` where a task has one), each file a `loramcl train --config`
    file or a task's experiment.yaml."""
    from importlib.resources import files

    folder = files("loramcl") / "recipes"
    if not isinstance(folder, Path) or not folder.is_dir():  # e.g. a zip import, or a wheel built without them
        raise FileNotFoundError(f"loramcl's packaged recipes are not a folder ({folder}): install loramcl from its "
                                "wheel or sdist (pip install loramcl-<version>-py3-none-any.whl)")
    return folder


def recipe_ids() -> list[str]:
    """Every packaged recipe, as `<task>/<name>` (`<task>` alone for a task with one recipe), sorted."""
    root = packaged_recipes()
    return sorted({p.parent.relative_to(root).as_posix() for p in root.rglob("*.yaml")})


def is_packaged(path: str | Path) -> bool:
    """Whether ``path`` lies inside the packaged recipes."""
    return Path(path).resolve().is_relative_to(packaged_recipes().resolve())


def path_base(file: str | Path) -> Path:
    """The folder a recipe file's relative paths are relative to: the file's own, except for the packaged recipes,
    which live inside the installed package and whose `./runs`, `./data`, `./models` are those of the current
    folder (`loramcl recipes copy` rewrites them relative to the copy)."""
    return Path.cwd() if is_packaged(file) else Path(file).parent


def matching_recipes(name: str, task: str | None = None) -> list[str]:
    """The ids of the packaged recipes ``name`` names: its id (`translation/alma`), or its name (`alma`) inside
    ``task`` (inside any task when None)."""
    ids = [i for i in recipe_ids() if task is None or i.split("/")[0] == task]
    return [i for i in ids if name.strip("/") in (i, i.split("/", 1)[-1])]


def packaged_config(value: str) -> str | None:
    """The text of the packaged recipe file ``value`` names (its path inside the package, or `<recipe id>/<file>`,
    e.g. `bilingual/common.yaml`, where no such file exists here); None for any other value."""
    path = Path(value).expanduser()
    if path.suffix not in (".yaml", ".yml") or (path.exists() and not path.is_file()):
        return None
    if not path.exists():
        path = packaged_recipes() / value
    return path.read_text(encoding="utf-8") if path.is_file() and is_packaged(path) else None


def recipe_folder(given: str | None, default: str, files: Sequence[str]) -> Path:
    """The folder holding a task's recipe files: ``given`` (a folder, or the name of a packaged recipe of the task),
    else the packaged recipe ``default`` (`<task>/<name>`); an error saying what to give otherwise."""
    task = default.split("/")[0]
    if given is None:
        folder = packaged_recipes() / default
    elif Path(given).is_dir():
        folder = Path(given)
    else:
        found = matching_recipes(given, task)  # one at most: a task's recipe names differ
        if not found:
            names = ", ".join(i.split("/", 1)[-1] for i in recipe_ids() if i.split("/")[0] == task)
            raise FileNotFoundError(f"--recipes {given}: no such folder, nor a packaged {task} recipe (packaged: "
                                    f"{names}; `loramcl recipes` lists every recipe)")
        folder = packaged_recipes() / found[0]
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{folder} holds no {', '.join(missing)}: give --recipes a folder with the {task} "
                                f"recipe files ({', '.join(files)}, one file per run) or a packaged {task} recipe's "
                                "name")
    return folder


def read_recipe(folder: Path, names: Sequence[str], overrides: dict | None = None) -> dict:
    """The files ``names`` of ``folder`` merged in order, then ``overrides``. The paths of RUN_PATHS are made absolute
    relative to the file that gives them (``path_base``), as `loramcl train --config` reads them (a model that is
    no folder there, e.g. a Hugging Face id of the local cache, stays as given)."""
    import yaml

    values: dict = {}
    for name in names:
        path = folder / name
        content = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        if not isinstance(content, dict):
            raise ValueError(f"{path} must hold a mapping of settings, got {type(content).__name__}")
        values = merged(values, _absolute_paths(content, path_base(path)))
    return merged(values, overrides or {})


def _absolute_paths(content: dict, folder: Path) -> dict:
    content = merged({}, content)  # a copy, section by section
    for keys in RUN_PATHS:
        section = content
        for key in keys[:-1]:
            section = section.get(key) if isinstance(section, dict) else None
        value = section.get(keys[-1]) if isinstance(section, dict) else None
        if isinstance(value, str) and value:
            path = absolute_path(value, folder)
            hub_model = keys == ("model",) and not os.path.exists(path) and cached_hub_model(value)
            section[keys[-1]] = value if hub_model else path
    return content


def run_values(folder: Path, run: str, root: Path, model: str | None = None, quick: dict | None = None,
               common: str = "common.yaml") -> dict:
    """The settings of one run of a recipe folder: ``common`` + <run>.yaml, its output at root/<run>, ``model`` when
    given; ``quick`` (a quick run's settings, e.g. {"training": {"steps": 2}}) merged last."""
    overrides = {"out": str(root / run)} | ({"model": model} if model is not None else {})
    values = read_recipe(folder, [common, f"{run}.yaml"], overrides)
    require(isinstance(values.get("model"), str), f"{folder}: no model folder (`model:` in {common})")
    return merged(values, quick) if quick else values


def run_arguments(folder: Path, run: str, root: Path, model: str | None = None, quick: dict | None = None,
                  common: str = "common.yaml") -> dict:
    """The `loramcl train` arguments of one run (``run_values``), its data files moved under ``root`` too:
    root/data/{train,validation}.jsonl (validation only where the recipe has one)."""
    values = run_values(folder, run, root, model, quick, common)
    data = merged(values.get("data", {}), {"train_file": str(root / "data" / "train.jsonl")})
    if data.get("validation_file"):
        data["validation_file"] = str(root / "data" / "validation.jsonl")
    return values | {"data": data}


def method_of(values: dict) -> tuple[str, object]:
    """(method, its configuration object) of a run's settings: LoRA-MCL (K = 1: LoRA-MLE), LoRA-MoE or multi-head
    MCL."""
    from loramcl.training.runs import METHOD_CONFIGS

    run = RunFile.of(values)
    require(run.method in METHOD_CONFIGS, f"method must be one of {sorted(METHOD_CONFIGS)}, got {run.method!r}")
    require(isinstance(run.method_block, dict), f"method {run.method} needs its `{run.method}:` block")
    return run.method, METHOD_CONFIGS[run.method].from_dict(run.method_block)


def num_hypotheses(values: dict) -> int:
    """How many candidates a run's model decodes as one model: its K hypotheses (a LoRA-MoE model is one model: 1)."""
    method, config = method_of(values)
    return 1 if method == "moe" else config.num_hypotheses


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
            values[name] = absolute_path(values[name], path_base(path))
    return values
