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
    with pytest.raises(ValueError, match=r'mixed.jsonl:2: "completion" must be a text as in the first row, got '
                                         r"\['d'\]: one format per file"):
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
