"""A dataset from a local file or folder, through ``datasets``: JSONL / JSON, Parquet, CSV, Arrow, or a folder written
by ``Dataset.save_to_disk`` (or a folder of such files, e.g. a dataset repository downloaded from the Hub). Nothing
is fetched at run time: a Hub name is refused with the way to download it first.

torch-free (``datasets`` does not load it), so that `loramcl train` reads and checks its data before torch loads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from loramcl.utils.files import decode_line, json_lines

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def read_dataset(path: str, split: str | None = None, what: str = "data file"):
    """The ``datasets.Dataset`` of ``path``; ``split``: the split of a folder holding several (a file is one split)."""
    import datasets

    if not os.path.exists(path):
        hub = "/" in path and not os.path.isabs(path) and Path(path).suffix not in BUILDERS and path.count("/") == 1
        if hub:
            raise FileNotFoundError(f"{what} {path} does not exist; if it is a Hugging Face Hub dataset, nothing is "
                                    "downloaded at run time: download it first (datasets.load_dataset(name)"
                                    ".save_to_disk(folder), or `hf download --repo-type dataset`) and give the folder")
        raise FileNotFoundError(f"{what} {path} does not exist")
    if os.path.isdir(path):
        saved = any((Path(path) / name).is_file() for name in ("dataset_dict.json", "state.json"))
        try:
            loaded = datasets.load_from_disk(path) if saved else datasets.load_dataset(path)
        except (ValueError, FileNotFoundError) as error:
            raise ValueError(f"{what} {path} is a folder that datasets cannot read ({_first_line(error)}): give a "
                             f"file ({', '.join(BUILDERS)}) or a folder written by save_to_disk") from None
        return _split_of(loaded, split, path)
    suffix = Path(path).suffix.lower()
    if suffix not in BUILDERS:
        raise ValueError(f"{what} {path}: a {suffix or 'file without extension'} file is not read; give a "
                         f"{', '.join(BUILDERS)} file or a save_to_disk folder")
    if split not in (None, "train"):
        raise ValueError(f"{what} {path} is one file, one split: leave out split ({split!r} given), or give a folder "
                         "holding several splits")
    if suffix in (".jsonl", ".json", ".csv"):
        _check_utf8(path)  # datasets' readers would read other bytes without a word
    try:
        return datasets.load_dataset(BUILDERS[suffix], data_files=path, split="train")
    except Exception as error:  # datasets' parsers raise many kinds; ours names the file and line
        if suffix in (".jsonl", ".json"):
            _check_json_lines(path)
        raise ValueError(f"{what} {path} cannot be read as {BUILDERS[suffix]} ({_first_line(error)})") from None


def row_names(path: str) -> Callable[[int], str]:
    """How the errors name row i (0-based) of ``path``: its line in a JSONL file, else its row number (from 1)."""
    from loramcl.utils.inputs import record_names

    if Path(path).suffix.lower() == ".jsonl":
        return record_names(path)
    return lambda i: f"{path} row {i + 1}"


def _split_of(loaded, split: str | None, path: str):
    import datasets

    if isinstance(loaded, datasets.Dataset):
        if split not in (None, "train"):
            raise ValueError(f"{path} holds one split: leave out split ({split!r} given)")
        return loaded
    names = list(loaded)
    if split is None and len(names) == 1:
        return loaded[names[0]]
    if split not in loaded:
        raise ValueError(f"{path} holds the splits {', '.join(names)}: choose one with split (--data.split)" +
                         ("" if split is None else f"; {split!r} is not one of them"))
    return loaded[split]


def _check_utf8(path: str) -> None:
    data = Path(path).read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start)
        decode_line(data.splitlines()[line], path, line + 1)  # names the line, byte and column


def _check_json_lines(path: str) -> None:
    """The first line of a JSONL file that is not UTF-8, not JSON, not an object, or whose field holds another kind
    of value than on the first line (a text here, a list there: datasets cannot read one column of both)."""
    kinds: dict[str, tuple[str, int]] = {}
    with open(path, "rb") as start:
        if start.read(64).lstrip().startswith(b"["):
            return  # a JSON file holding one list: datasets' error says more
    for number, line, record in json_lines(path):
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number} must be an object with the dataset's fields, got "
                             f"{line.strip()[:80]}")
        for field, value in record.items():
            kind = _kind(value)
            if value is None:
                continue
            first = kinds.setdefault(field, (kind, number))
            if first[0] != kind:
                raise ValueError(f'{path}:{number}: "{field}" is {kind}, and on line {first[1]} it is {first[0]}: '
                                 "one format per file (a row of several references holds a list of texts)")


def _kind(value) -> str:
    if isinstance(value, str):
        return "a text"
    if isinstance(value, list):
        inner = {_kind(v) for v in value if v is not None}
        return "a list of messages" if inner == {"an object"} else "a list"
    if isinstance(value, dict):
        return "an object"
    return "a number" if isinstance(value, int | float) and not isinstance(value, bool) else type(value).__name__


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


__all__ = ["read_dataset", "row_names"]
