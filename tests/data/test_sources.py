"""loramcl.data.sources: the same rows read from every kind of local file datasets reads, and each file a user gets
wrong named in one line."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset, DatasetDict

from loramcl.data.formats import check_rows, detect_format
from loramcl.data.sources import read_dataset, row_names

ROWS = [{"prompt": "w5", "completion": "w40"}, {"prompt": "w6", "completion": "w41"}]


def write_every_kind(folder) -> dict[str, str]:
    data = Dataset.from_list(ROWS)
    paths = {kind: str(folder / f"train.{kind}") for kind in ("jsonl", "json", "parquet", "csv")}
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:1]) + "\n" + json.dumps(ROWS[1]))
    (folder / "train.json").write_text(json.dumps(ROWS))
    data.to_parquet(paths["parquet"])
    data.to_csv(paths["csv"], index=False)
    data.save_to_disk(folder / "saved")
    paths["save_to_disk"] = str(folder / "saved")
    arrow = next((folder / "saved").glob("*.arrow"))
    paths["arrow"] = str(arrow)
    DatasetDict({"train": data, "test": data.select([0])}).save_to_disk(folder / "splits")
    return paths


def test_every_kind_of_file_gives_the_same_rows(tmp_path):
    for kind, path in write_every_kind(tmp_path).items():
        assert read_dataset(path).to_list() == ROWS, kind
    assert read_dataset(str(tmp_path / "splits"), split="test").to_list() == ROWS[:1]


def test_rows_are_named_by_their_line_in_a_jsonl_file(tmp_path):
    paths = write_every_kind(tmp_path)
    assert row_names(paths["jsonl"])(1) == f"{paths['jsonl']}:3"  # a blank line holds no row
    assert row_names(paths["parquet"])(1) == f"{paths['parquet']} row 2"


def test_a_file_that_cannot_be_read_is_one_line(tmp_path):
    write_every_kind(tmp_path)
    with pytest.raises(ValueError, match=r"splits holds the splits train, test: choose one with split \(--data.spl"):
        read_dataset(str(tmp_path / "splits"))
    with pytest.raises(FileNotFoundError, match="nothing is downloaded at run time: download it first"):
        read_dataset("HuggingFaceH4/no_robots")
    mixed = tmp_path / "mixed.jsonl"  # datasets reads a column of texts and lists as JSON values, but not after a
    mixed.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n\n" + json.dumps({"prompt": "c",  # blank
                                                                                          "completion": ["d"]}))
    with pytest.raises(ValueError, match=r'mixed.jsonl:3: "completion" is a list, and on line 1 it is a text: one '
                                         "format per file"):
        read_dataset(str(mixed))
    mixed.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"prompt": "c",
                                                                                        "completion": ["d"]}))
    rows = read_dataset(str(mixed))
    with pytest.raises(ValueError, match=r'mixed.jsonl:2: "completion" must be a text \(the prompt/completion format '
                                         r"of the first row\), got list \['d'\]: one format per file"):
        check_rows(rows, detect_format(rows[0]), where=row_names(str(mixed)))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(json.dumps({"prompt": "a", "completion": "b"}).encode() + b"\n" +
                      '{"prompt": "caf\u00e9", "completion": "b"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin.jsonl:2 is not UTF-8 text \(byte 0xe9 at column 16\)"):
        read_dataset(str(latin))
    with pytest.raises(ValueError, match=r"a \.txt file is not read"):
        (tmp_path / "rows.txt").write_text("a")
        read_dataset(str(tmp_path / "rows.txt"))
    with pytest.raises(ValueError, match="is one file, one split: leave out split"):
        read_dataset(str(tmp_path / "train.jsonl"), split="test")


def test_loramcl_train_names_a_parquet_file_without_the_formats_fields_before_torch_loads(tmp_path):
    from loramcl.training.config import DataConfig
    from loramcl.training.fit import training_rows

    path = tmp_path / "qa.parquet"
    Dataset.from_list([{"question": "a", "answer": "b"}]).to_parquet(path)
    with pytest.raises(ValueError, match=rf'^{path} row 1 has none of the fields of a dataset format \("prompt" \+ '
                                         r'"completion" or "target", "messages", "text"\); its fields are "question", '
                                         r'"answer" \(choose the fields with data.prompt_key / data.target_key\)$'):
        training_rows(str(path), DataConfig(train_file=str(path)), "training file")
    assert training_rows(str(path), DataConfig(train_file=str(path), prompt_key="question", target_key="answer"),
                         "training file").to_list() == [{"question": "a", "answer": "b"}]


PAIR = b'{"prompt": "w5", "completion": "w40"}\n'
JSONL_HINT = 'give one JSON object per line, e.g. {"prompt": "...", "completion": "..."}'
# (family, file name, its bytes or rows to write, the one-line error that names it: "PATH": the file's path)
BAD_FILES = [
    ("empty file", "train.jsonl", b"", "training file PATH is empty (0 bytes): it holds no row; " + JSONL_HINT),
    ("empty file", "train.csv", b"", "training file PATH is empty (0 bytes): it holds no row; give a header line "
     "naming the fields, then one row per line"),
    ("blank lines", "train.jsonl", b"\n \n", "training file PATH holds no row (blank lines only); " + JSONL_HINT),
    ("non-object line", "train.jsonl", PAIR + b'"w6"\n', 'PATH:2 must be a JSON object (one row: its fields, e.g. '
     '{"prompt": ..., "completion": ...}), got a text: "w6"'),
    ("list of numbers", "train.jsonl", b"[1, 2]\n", 'PATH:1 must be a JSON object (one row: its fields, e.g. '
     '{"prompt": ..., "completion": ...}), got a list: [1, 2]'),
    ("list of numbers", "train.json", b"[1, 2]", "training file PATH must hold a list of JSON objects (one per row), "
     'got [1, 2]: give a list of JSON objects, e.g. [{"prompt": "...", "completion": "..."}], or JSON lines'),
    ("wrong field type", "train.jsonl", PAIR + b'{"prompt": 3, "completion": "w40"}\n',
     'PATH:2: "prompt" must be a text, got int 3'),
    ("wrong field type", "train.parquet", [{"prompt": "w5", "completion": 4}],
     'PATH row 1: "completion" must be a text (the prompt/completion format of the first row), got int 4: one '
     "format per file"),
    ("not UTF-8", "train.jsonl", PAIR + b'{"prompt": "caf\xe9", "completion": "w40"}\n',
     "PATH:2 is not UTF-8 text (byte 0xe9 at column 16): save the file as UTF-8"),
    ("not UTF-8", "train.csv", b"prompt,completion\ncaf\xe9,w40\n",
     "PATH:2 is not UTF-8 text (byte 0xe9 at column 4): save the file as UTF-8"),
    ("no rows", "train.parquet", [], "training file PATH holds no row (its table has 0 rows); give a table of at least "
     "one row"),
    ("no rows", "train.csv", b"prompt,completion\n", "training file PATH holds no row (a header line only); give a "
     "header line naming the fields, then one row per line"),
    ("no rows", "train.json", b"[ ]", "training file PATH holds no row (an empty list); give a list of JSON objects, "
     'e.g. [{"prompt": "...", "completion": "..."}], or JSON lines'),
]


@pytest.mark.parametrize("family,name,content,message", BAD_FILES,
                         ids=[f"{family}-{name.split('.')[1]}" for family, name, _, _ in BAD_FILES])
def test_each_bad_training_file_is_one_line_naming_the_file_what_is_expected_and_what_was_found(
        tmp_path, family, name, content, message):
    """Issue 51: an empty file said `cannot be read as json (StopIteration)`, a line [1, 2] `"text" must be a text, got
    int 1` (datasets reads a JSON list of numbers as a column "text"), a Parquet table of no row `An error occurred
    while generating the dataset`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from loramcl.training.config import DataConfig
    from loramcl.training.fit import training_rows

    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:  # a Parquet table of these rows, typed as written (no row: two text columns)
        pq.write_table(pa.Table.from_pylist(content) if content else pa.table(
            {"prompt": pa.array([], pa.string()), "completion": pa.array([], pa.string())}), path)
    with pytest.raises(ValueError) as refused:
        training_rows(str(path), DataConfig(train_file=str(path)), "training file")
    assert str(refused.value) == message.replace("PATH", str(path))
