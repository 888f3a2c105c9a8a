"""A dataset from a local file or folder, through ``datasets``: JSONL / JSON, Parquet, CSV, Arrow, or a folder written
by ``Dataset.save_to_disk`` (or a folder of such files, e.g. a dataset repository downloaded from the Hub). Nothing
is fetched at run time: a Hub name is refused with the way to download it first.

torch-free (``datasets`` does not load it), so that `loramcl train` reads and checks its data before torch loads.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from loramcl.utils.files import decode_line, json_lines
from loramcl.utils.inputs import read_relative

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
# What a file of each kind holds, said when it holds no row or something else than rows.
ROW_HINTS = {".jsonl": 'give one JSON object per line, e.g. {"prompt": "...", "completion": "..."}',
        ".json": 'give a list of JSON objects, e.g. [{"prompt": "...", "completion": "..."}], or JSON lines',
        ".csv": "give a header line naming the fields, then one row per line",
        ".parquet": "give a table of at least one row", ".arrow": "give a table of at least one row"}


def read_dataset(path: str, split: str | None = None, what: str = "data file"):
    """The ``datasets.Dataset`` of ``path``; ``split``: the split of a folder holding several (a file is one split)."""
    import datasets

    if not os.path.exists(path):
        hub = "/" in path and not os.path.isabs(path) and Path(path).suffix not in BUILDERS and path.count("/") == 1
        if hub:
            raise FileNotFoundError(f"{what} {path} does not exist; if it is a Hugging Face Hub dataset, nothing is "
                                    "downloaded at run time: download it first (datasets.load_dataset(name)"
                                    ".save_to_disk(folder), or `hf download --repo-type dataset`) and give the folder")
        raise FileNotFoundError(f"{what} {path} does not exist{read_relative(path)}")
    if os.path.isdir(path):
        saved = any((Path(path) / name).is_file() for name in ("dataset_dict.json", "state.json"))
        try:
            loaded = datasets.load_from_disk(path) if saved else datasets.load_dataset(path)
        except (ValueError, FileNotFoundError) as error:
            raise ValueError(f"{what} {path} is a folder that datasets cannot read ({_first_line(error)}): give a "
                             f"file ({', '.join(BUILDERS)}) or a folder written by save_to_disk") from None
        return _with_rows(_split_of(loaded, split, path), path, what)
    suffix = Path(path).suffix.lower()
    if suffix not in BUILDERS:
        raise ValueError(f"{what} {path}: a {suffix or 'file without extension'} file is not read; give a "
                         f"{', '.join(BUILDERS)} file or a save_to_disk folder")
    if split not in (None, "train"):
        raise ValueError(f"{what} {path} is one file, one split: leave out split ({split!r} given), or give a folder "
                         "holding several splits")
    if os.path.getsize(path) == 0:
        raise ValueError(f"{what} {path} is empty (0 bytes): it holds no row; {ROW_HINTS[suffix]}")
    if suffix in (".jsonl", ".json", ".csv"):
        _check_text(path, suffix, what)  # datasets' readers would read other bytes, and lists, without a word
    try:
        loaded = datasets.load_dataset(BUILDERS[suffix], data_files=path, split="train")
    except Exception as error:  # datasets' parsers raise many kinds; ours names the file and line
        if suffix in (".jsonl", ".json"):
            _check_json_lines(path)
        if (empty := _no_row(path, suffix)) is not None:
            raise ValueError(f"{what} {path} holds no row ({empty}); {ROW_HINTS[suffix]}") from None
        raise ValueError(f"{what} {path} cannot be read as {BUILDERS[suffix]} ({_first_line(error)})") from None
    return _with_rows(loaded, path, what)


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


def _with_rows(dataset, path: str, what: str):
    if len(dataset) == 0:
        raise ValueError(f"{what} {path} holds no row: nothing to train on or score")
    return dataset


def _check_text(path: str, suffix: str, what: str) -> None:
    """A text file's bytes before datasets reads them: UTF-8 (named by line, byte and column), not blank, and JSON rows
    that are objects: datasets reads a JSON list of numbers or texts (even the one line `[1, 2]` of a JSONL file) as a
    column "text" of them, which the format's checks would then name as a field the file never had."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start)
        decode_line(data.splitlines()[line], path, line + 1)  # names the line, byte and column
    if not text.strip():
        raise ValueError(f"{what} {path} holds no row (blank lines only); {ROW_HINTS[suffix]}")
    if suffix == ".jsonl" and re.search(r"^[ \t]*[^{\s]", text, re.MULTILINE):
        _check_json_lines(path)  # a line that is not an object: named with its line
    if suffix == ".json" and (found := re.match(r"\s*\[\s*([^{\s])", text)):
        if found[1] == "]":
            raise ValueError(f"{what} {path} holds no row (an empty list); {ROW_HINTS[suffix]}")
        raise ValueError(f"{what} {path} must hold a list of JSON objects (one per row), got "
                         f"{text.strip()[:80]}: {ROW_HINTS[suffix]}")


def _no_row(path: str, suffix: str) -> str | None:
    """What a file that datasets could not read holds when it holds no row (datasets' error does not say it), else
    None."""
    if suffix in (".parquet", ".arrow"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.read_metadata(path).num_rows if suffix == ".parquet" else \
                pa.ipc.open_stream(path).read_all().num_rows
        except Exception:  # noqa: BLE001 - not a readable table: datasets' error says why
            return None
        return "its table has 0 rows" if rows == 0 else None
    lines = [line for line in Path(path).read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    return "a header line only" if suffix == ".csv" and len(lines) == 1 else None


def _check_json_lines(path: str) -> None:
    """The first line of a JSONL file that is not UTF-8, not JSON, not an object, or whose field holds another kind
    of value than on the first line (a text here, a list there: datasets cannot read one column of both)."""
    kinds: dict[str, tuple[str, int]] = {}
    with open(path, "rb") as start:
        if path.lower().endswith(".json") and start.read(64).lstrip().startswith(b"["):
            return  # a JSON file holding one list: datasets' error says more
    for number, line, record in json_lines(path):
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number} must be a JSON object (one row: its fields, e.g. {{\"prompt\": ..., "
                             f"\"completion\": ...}}), got {_kind(record)}: {line.strip()[:80]}")
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
