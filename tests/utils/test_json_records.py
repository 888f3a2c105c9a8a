"""Issue 61: every JSON file loramcl reads back names the file when it cannot be read (a truncated best.json said
`Expecting ',' delimiter: line 1 column 11 (char 10)` and nothing else)."""

import json

import pytest

from loramcl.metrics.io import read_report
from loramcl.recipes.stages import data_stats
from loramcl.training.runs import finished_run, run_record
from loramcl.utils.files import read_json, write_json
from loramcl.utils.inputs import model_config

DAMAGES = {"truncated": '{"settings": {"a": 1', "not UTF-8": b'{"a": "\xff"}', "empty": ""}


def damaged(folder, name, damage):
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    content = DAMAGES[damage]
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


@pytest.mark.parametrize("damage", sorted(DAMAGES))
@pytest.mark.parametrize("reader", ["read_json", "run record", "finished run", "data stats", "evaluation report",
                                    "model config"])
def test_each_record_we_read_back_names_its_file(tmp_path, reader, damage):
    name, read = {"read_json": ("record.json", lambda: read_json(tmp_path / "record.json", "write it again")),
                  "run record": ("run.json", lambda: run_record(tmp_path)),
                  "finished run": ("run.json", lambda: finished_run(tmp_path, {})),
                  "data stats": ("data/stats.json", lambda: data_stats(tmp_path / "data")),
                  "evaluation report": ("report.json", lambda: read_report(tmp_path / "report.json")),
                  "model config": ("config.json", lambda: model_config(str(tmp_path)))}[reader]
    path = damaged(tmp_path, name, damage)
    with pytest.raises(ValueError) as error:
        read()
    message = str(error.value)
    assert str(path) in message and "\n" not in message, message
    assert "damaged" in message or "again" in message, message  # and what to do


def test_a_whole_record_reads_as_json(tmp_path):
    (tmp_path / "record.json").write_text(json.dumps({"step": 4, "eval_loss": 1.5}))
    assert read_json(tmp_path / "record.json") == {"step": 4, "eval_loss": 1.5}
    with pytest.raises(FileNotFoundError, match="missing.json does not exist: restore it"):
        read_json(tmp_path / "missing.json", "restore it")


def test_our_json_records_are_written_one_way(tmp_path):
    """``write_json`` writes as the records were written by hand before it (issue 62): indented by one, ASCII unless
    asked, a final newline, UTF-8; and ``read_json`` reads it back."""
    value = {"settings": {"model": "m", "é": "Größe"}, "log": [{"step": 1, "loss": 0.5}], "none": None}
    path = write_json(tmp_path / "record.json", value)
    assert path.read_bytes() == (json.dumps(value, indent=1) + "\n").encode()
    assert read_json(path) == value
    write_json(path, value, indent=None, ensure_ascii=False)
    assert path.read_bytes() == (json.dumps(value, ensure_ascii=False) + "\n").encode("utf-8")


def test_a_failing_write_leaves_the_old_record(tmp_path, monkeypatch):
    """Atomic: a value that cannot be written, or a write killed half-way, leaves the old file whole and no
    temporary file beside it."""
    path = write_json(tmp_path / "run.json", {"seconds": 1.0})
    before = path.read_bytes()
    with pytest.raises(TypeError):
        write_json(path, {"seconds": object()})  # not JSON
    assert path.read_bytes() == before

    def half(self, text, encoding=None):  # writes part of the file, then the process is killed
        with open(self, "w", encoding=encoding) as f:
            f.write(text[:5])
        raise KeyboardInterrupt

    monkeypatch.setattr(type(path), "write_text", half)
    with pytest.raises(KeyboardInterrupt):
        write_json(path, {"seconds": 2.0})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]
