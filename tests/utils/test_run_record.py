"""Issue 62: the recipes read a run's files through one type (``loramcl.utils.run_record``): a setting left out of a
run file, or a field an older run.json lacks, takes the default every reader assumed, written once."""

import json

import pytest

from loramcl.utils.run_record import RunFile, RunRecord


def test_a_run_file_without_a_setting_takes_its_default():
    run = RunFile.of({"model": "m", "out": "runs/mle", "mcl": {"num_hypotheses": 1}})
    assert (run.model, run.out, run.method, run.dtype, run.quantization) == ("m", "runs/mle", "mcl", "float32", None)
    assert (run.training, run.data, run.ensemble) == ({}, {}, None)
    assert run.method_block == {"num_hypotheses": 1}
    moe = RunFile.of({"model": "m", "method": "moe", "moe": {"num_experts": 2}, "dtype": "bfloat16",
                      "quantization": "nf4", "eval_examples": 8})
    assert (moe.method, moe.method_block, moe.dtype, moe.quantization) == ("moe", {"num_experts": 2}, "bfloat16", "nf4")
    assert moe.values["eval_examples"] == 8  # a task's own setting stays in the mapping
    assert RunFile.of(moe) is moe


def test_an_older_run_record_reads_with_the_defaults(tmp_path):
    """A run.json written before loramcl recorded the settings stamp, with settings of before dtype was recorded."""
    written = {"settings": {"model": "m", "mcl": {"num_hypotheses": 2, "r": 4}, "training": {"steps": 5}},
               "trainable_parameters": 1024, "seconds": 12.5}
    (tmp_path / "run.json").write_text(json.dumps(written))
    record = RunRecord.read(tmp_path)
    assert (record.seconds, record.trainable_parameters, record.total_parameters) == (12.5, 1024, None)
    assert (record.resumed_from, record.settings_stamp) == (None, None)
    assert (record.settings.dtype, record.settings.method, record.settings.training) == ("float32", "mcl", {"steps": 5})
    assert record.values == written  # the whole file, as a report copies it
    full = written | {"settings_stamp": "0123456789abcdef", "resumed_from": "checkpoint-4", "total_parameters": 9}
    assert RunRecord.of(full).settings_stamp == "0123456789abcdef" and RunRecord.of(full).total_parameters == 9
    # resumed from a checkpoint that did not record the earlier processes' seconds: they are not in `seconds`
    assert not record.seconds_partial and RunRecord.of(full).seconds_partial
    assert not RunRecord.of(full | {"seconds_before_resume": 10.0}).seconds_partial
    assert RunRecord.of(written | {"seconds_counted_from_resume": ["mle-s1"]}).seconds_partial  # an ensemble's member


@pytest.mark.parametrize("content, says", [
    ('{"settings": {"model": "m"', "is not valid JSON"),
    ("[]", "holds no run settings"),
    ('{"seconds": 1.0, "trainable_parameters": 4}', "holds no run settings"),
    ('{"settings": {"model": "m"}, "trainable_parameters": 4}', "lacks seconds"),
])
def test_a_malformed_run_record_is_one_line_naming_it(tmp_path, content, says):
    (tmp_path / "run.json").write_text(content)
    with pytest.raises(ValueError) as error:
        RunRecord.read(tmp_path)
    message = str(error.value)
    assert str(tmp_path / "run.json") in message and says in message and "\n" not in message, message
    assert message.endswith("it was damaged or edited: train the run again"), message
