"""MCLTrainer's settings as fields of MCLTrainingArguments (issue 62): checked when made, with the messages of the
older keyword form; plain TrainingArguments give the defaults; the keywords still override."""

import pytest
from conftest import wrapped_model
from transformers import TrainingArguments

from loramcl import MCLTrainer, MCLTrainingArguments
from loramcl.training.arguments import MCLTrainerSettings


@pytest.mark.parametrize("setting,value,message", [
    ("scoring_examples_per_block", 0, "scoring_examples_per_block must be 'auto', None or a number"),
    ("collapse_window", 0, "collapse_window must be a number of steps >= 1"),
    ("collapse_share", 1.0, r"collapse_share must be in \[0, 1\)"),
    ("scoring_learning_rate", float("nan"), "scoring_learning_rate must be a finite number > 0")])
def test_the_fields_are_checked_when_made(tmp_path, setting, value, message):
    with pytest.raises(ValueError, match=message):
        MCLTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **{setting: value})


def test_the_trainer_reads_its_arguments_fields_the_defaults_or_the_keywords(tmp_path):
    mcl = wrapped_model("llama")[0]
    common = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no")
    ours = MCLTrainingArguments(**common, two_pass_wta=False, collapse_window=8, scoring_learning_rate=1e-2)
    assert MCLTrainer(mcl, args=ours).settings == MCLTrainerSettings(False, "auto", 8, 0.01, 1e-2)
    assert MCLTrainer(mcl, args=TrainingArguments(**common)).settings == MCLTrainerSettings()
    assert MCLTrainer(mcl, args=ours, collapse_window=20).settings.collapse_window == 20  # the older form
    assert MCLTrainer(mcl, args=TrainingArguments(**common), two_pass_wta=False).settings.two_pass_wta is False
    assert "two_pass_wta" not in TrainingArguments(**common).to_dict()  # plain arguments are saved as they were
    assert ours.to_dict()["collapse_window"] == 8
