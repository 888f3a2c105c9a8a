"""Issue 61: every JSON file loramcl reads back names the file when it cannot be read (a truncated best.json said
`Expecting ',' delimiter: line 1 column 11 (char 10)` and nothing else)."""

import json

import pytest

from loramcl.metrics.io import read_report
from loramcl.recipes.stages import data_stats
from loramcl.training.runs import finished_run, run_record
from loramcl.utils.files import read_json
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
