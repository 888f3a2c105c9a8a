"""Files read and written with care: UTF-8 text, JSONL records and our own JSON records read with errors that name
the file (and line), a file's SHA-256, and writing under a temporary name renamed when complete (``write_json``: our
own JSON records, all written one way). Imports nothing heavy
(the recipes use it before torch is loaded)."""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from pathlib import Path


def sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_json(path: str | os.PathLike, remedy: str = "it was damaged or edited: write it again"):
    """The JSON value of a file of ours (a record loramcl wrote); an error naming the file when it is missing, not
    UTF-8 or not JSON, ending with ``remedy`` (what to do)."""
    try:
        return json.loads(read_utf8(path))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist: {remedy}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error}): {remedy}") from None
    except ValueError as error:  # read_utf8's, which names the file and line
        raise ValueError(f"{error}; {remedy}") from None


def write_atomically(path: str | os.PathLike, write) -> None:
    """``write(temporary_path)``, then rename onto ``path``: a reader finds the old file or the new one, never half."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path: str | os.PathLike, value, indent: int | None = 1, ensure_ascii: bool = True) -> Path:
    """Write a JSON record of ours (``read_json`` reads it back): ``json.dumps(value, indent, ensure_ascii)`` and a
    newline, UTF-8, atomically (``write_atomically``: a reader, or a run killed while it writes, finds the old file
    or the new one). ensure_ascii=False keeps non-ASCII text readable (a report's examples). Returns the path."""
    text = json.dumps(value, indent=indent, ensure_ascii=ensure_ascii) + "\n"
    write_atomically(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return Path(path)


def read_jsonl(path: str | Path, field: str, number_missing_ids: bool = False, hint: str = "") -> dict[object, dict]:
    """{id: record} from a JSONL file whose records all have "id" and `field`; clear errors on bad lines.

    number_missing_ids: a record without "id" gets its position among the records (0, 1, ...) instead.
    hint: appended to the error of a record without `field`, e.g. the option that names the field.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    records, ids = {}, []
    for number, line, record in json_lines(path):
        if not isinstance(record, dict) or field not in record or ("id" not in record and not number_missing_ids):
            fields = f'"{field}"' if number_missing_ids else f'"id" and "{field}"'
            if isinstance(record, dict):  # name the fields it has: the usual mistake is another field name
                has = ", ".join(f'"{key}"' for key in list(record)[:10]) or "none"
                raise ValueError(f"{path}:{number} must be an object with {fields}; its fields are {has}{hint}")
            raise ValueError(f"{path}:{number} must be an object with {fields}, got {line.strip()[:120]}")
        if number_missing_ids and "id" not in record:
            record["id"] = len(ids)
        if not isinstance(record["id"], (str, int)) or isinstance(record["id"], bool):
            raise ValueError(f"{path}:{number}: id must be a string or an integer, got {record['id']!r}")
        ids.append(record["id"])
        records[record["id"]] = record
    duplicated = [i for i, n in Counter(ids).items() if n > 1]
    if duplicated:
        raise ValueError(f"{path} has duplicate ids (each item once): {shown_ids(duplicated)}")
    if not records:
        raise ValueError(f"{path} has no record")
    return records


def json_lines(path: str | Path):
    """(line number, line, value) of each non-blank line of a JSONL file; an error naming the file and line where
    one is not UTF-8 or not JSON."""
    with open(path, "rb") as lines:
        for number, raw in enumerate(lines, start=1):
            line = decode_line(raw, path, number)
            if not line.strip():
                continue
            try:
                yield number, line, json.loads(line)
            except json.JSONDecodeError as error:
                if line.startswith("\ufeff"):  # accepted on line 1 only (decode_line): files were joined?
                    raise ValueError(f"{path}:{number} starts with a byte-order mark (U+FEFF), which only the first "
                                     "line may have (were files joined?): remove it") from None
                raise ValueError(f"{path}:{number} is not valid JSON ({error.msg})") from None


def decode_line(raw: bytes, path: str | Path, number: int) -> str:
    """One line of a text file as str; a clear error naming the file and line if it is not UTF-8 (a byte-order mark
    on the first line is accepted)."""
    try:
        return raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}:{number} is not UTF-8 text (byte {raw[error.start]:#04x} at column "
                         f"{error.start + 1}): save the file as UTF-8") from None


def read_utf8(path: str | Path) -> str:
    """A whole text file; a clear error naming the file and line if it is not UTF-8."""
    raw = Path(path).read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = raw[:error.start].count(b"\n") + 1
        column = error.start - (raw.rfind(b"\n", 0, error.start) + 1) + 1
        raise ValueError(f"{path}:{line} is not UTF-8 text (byte {raw[error.start]:#04x} at column {column}): save "
                         "the file as UTF-8") from None


def shown_ids(ids: list) -> str:
    shown = ", ".join(repr(i) for i in ids[:10])
    return shown + (f" ... ({len(ids)} in all)" if len(ids) > 10 else "")
