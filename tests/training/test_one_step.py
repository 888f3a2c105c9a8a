"""The benchmarks time the step training runs (issue 62): on one batch, with ties drawn at random from one seed,
benchmarks/common.py's ``train_step`` and ``MCLTrainer.compute_loss`` give the same loss and the same winners, both
through ``loramcl.mcl.step.mcl_step``, for the stacked step and two-pass WTA's (whole and in blocks)."""

import copy

import pytest
import torch
from tiny_models import build_model, token_rows
from transformers import default_data_collator

from benchmarks import common as benchmark_common
from loramcl import MCLConfig, MCLTrainer, get_mcl_model
from loramcl.training.arguments import MCLTrainingArguments


@pytest.mark.parametrize("variant,two_pass,per_block", [("stacked", False, "auto"), ("wta-two-pass", True, None),
                                                        ("wta-two-pass-blocks", True, "auto")])
def test_the_benchmarks_step_is_the_trainers(tmp_path, variant, two_pass, per_block):
    torch.manual_seed(0)
    mcl = get_mcl_model(build_model("llama"), MCLConfig(num_hypotheses=3, r=4, alpha=8, tie_break="random",
                                                        scoring=True, target_modules=["q_proj", "v_proj"]))
    batch = default_data_collator(token_rows(7, 8, 0, prompt=2))
    trained, timed = copy.deepcopy(mcl).train(), copy.deepcopy(mcl).train()
    args = MCLTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no",
                                two_pass_wta=two_pass, scoring_examples_per_block=per_block)
    trainer = MCLTrainer(trained, args=args)
    torch.manual_seed(1)
    _, ours = trainer.compute_loss(trained, dict(batch), return_outputs=True)
    torch.manual_seed(1)
    theirs = benchmark_common.train_step(variant, timed, dict(batch), torch.optim.SGD(timed.parameters(), lr=0.1))
    assert torch.equal(theirs.winners, ours.winners)
    assert torch.equal(theirs.loss.detach(), ours.loss.detach())
    assert ours.scoring_loss is not None  # the scoring head's loss is in both
    # B = 0: every example's hypotheses tie, so the seed's draw picked the winners, not the lowest k
    assert len(set(ours.winners.tolist())) > 1
