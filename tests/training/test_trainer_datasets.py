"""MCLTrainer given rows of text, as SFTTrainer is: a datasets.Dataset in one of TRL's formats and the tokenizer."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from tiny_models import build_model, word_tokenizer
from transformers import TrainingArguments

from loramcl import MCLConfig, MCLTrainer, get_mcl_model
from loramcl.data import prepare_dataset

# a chat template over the tiny vocabulary: w5 opens a user turn, w6 an assistant turn, </s> ends a turn
TEMPLATE = ("{% for m in messages %}{{ 'w5 ' if m['role'] == 'user' else 'w6 ' }}{{ m['content'] }} </s> "
            "{% endfor %}{% if add_generation_prompt %}w6 {% endif %}")


def _model(k: int = 3):
    torch.manual_seed(0)
    return get_mcl_model(build_model("llama"), MCLConfig(num_hypotheses=k, r=4, target_modules=["q_proj", "v_proj"]))


def _args(tmp_path, **overrides):
    return TrainingArguments(**(dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2,
                                     learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no",
                                     disable_tqdm=True, remove_unused_columns=False) | overrides))


def test_rows_of_text_are_prepared_with_the_tokenizer_and_trained(tmp_path):
    tokenizer = word_tokenizer()
    tokenizer.chat_template = TEMPLATE
    rows = [{"prompt": f"w{10 + i} w{20 + i}", "completion": [f"w{40 + i}", f"w{50 + i}", f"w{60 + i}"]}
            for i in range(4)]  # three references per prompt: twelve examples
    trainer = MCLTrainer(_model(), args=_args(tmp_path), train_dataset=Dataset.from_list(rows),
                         eval_dataset=Dataset.from_list([{"messages": [{"role": "user", "content": "w7"},
                                                                       {"role": "assistant", "content": "w8 w9"}]}]),
                         processing_class=tokenizer)
    expected = prepare_dataset(Dataset.from_list(rows), tokenizer).select_columns(["input_ids", "labels"])
    assert trainer.train_dataset.to_list() == expected.to_list() and len(expected) == 12
    assert trainer.train_dataset[1] == {"input_ids": [10, 20, 50, 2], "labels": [-100, -100, 50, 2]}  # no BOS added
    assert trainer.eval_dataset.to_list() == [{"input_ids": [5, 7, 2, 6, 8, 9, 2], "labels": [-100] * 4 + [8, 9, 2]}]
    trainer.train()
    assert trainer.state.global_step == 2 and torch.isfinite(torch.tensor(trainer.state.log_history[-1]["train_loss"]))
    assert "eval_nll_h2" in trainer.evaluate()


def test_rows_of_text_need_the_tokenizer_and_packing_is_refused(tmp_path):
    rows = Dataset.from_list([{"text": "w5 w6"}])
    with pytest.raises(ValueError, match=r"train_dataset holds rows of text \(fields text\) and MCLTrainer has no "
                                         "tokenizer to prepare them: pass processing_class=tokenizer"):
        MCLTrainer(_model(), args=_args(tmp_path), train_dataset=rows)
    trl = pytest.importorskip("trl")
    packed = trl.SFTConfig(output_dir=str(tmp_path), packing=True, use_cpu=True, bf16=False, report_to=[])
    with pytest.raises(ValueError, match="packing is not supported: winner-takes-all picks one winning hypothesis per "
                                         "example"):
        MCLTrainer(_model(), args=packed, train_dataset=rows, processing_class=word_tokenizer())
