"""Two-pass WTA's scoring pass in blocks of examples (``MCLModel.forward(examples_per_block=)``, MCLTrainer's
``scoring_examples_per_block``): the nll, loss, weights and scores of the whole batch at once, with each call of the
base model seeing only its block's K*n rows."""

import copy
import warnings

import pytest
import torch
from conftest import wrapped_model
from tiny_models import build_batch, uneven_batch
from transformers import TrainingArguments

from loramcl import MCLTrainer
from loramcl.mcl.step import scoring_block


def _scored(mcl, inputs, labels, examples_per_block=None):
    """(output of the no-grad forward of all K, rows of each base-model call)."""
    rows = []
    hook = mcl.base_model.get_submodule(mcl.layer_names[-1]).register_forward_pre_hook(
        lambda module, args: rows.append(args[0].shape[0]))
    try:
        with torch.no_grad():
            out = mcl(**inputs, labels=labels, examples_per_block=examples_per_block)
    finally:
        hook.remove()
    return out, rows


def _assert_same(got, expected):
    for field in ("nll", "loss", "weights", "log_scores", "mixture_nll", "scoring_loss"):
        if getattr(expected, field) is None:
            assert getattr(got, field) is None, field
        else:
            torch.testing.assert_close(getattr(got, field), getattr(expected, field), rtol=0, atol=1e-6, msg=field)


# llama: causal (right padding); t5: encoder-decoder; qwen2_audio: an audio tower before the adapters (mel features
# and their mask cut by example); llava_next: image crops [B, crops, ...] with image_sizes [B, 2]
@pytest.mark.parametrize("name", ["llama", "t5", "qwen2_audio", "llava_next"])
def test_blocks_give_the_nll_loss_and_weights_of_the_whole_batch(name):
    mcl, pristine, _, _ = wrapped_model(name, loss="relaxed", epsilon=0.2, logits_chunk_size=3)
    inputs, labels = build_batch(name, pristine, batch=5, generator=torch.Generator().manual_seed(3))
    expected, rows = _scored(mcl, inputs, labels)
    assert expected.nll.shape == (5, 3) and expected.nll.unique().numel() == 15  # a mis-assigned row would show
    whole_rows = rows[0]
    for per_block, sizes in ((1, [1] * 5), (2, [2, 2, 1]), (3, [3, 2]), (5, [5]), (8, [5])):
        got, rows = _scored(mcl, inputs, labels, per_block)
        _assert_same(got, expected)
        assert rows == [whole_rows // 5 * n for n in sizes], per_block  # K*n rows (times the tokens) per call


def test_blocks_with_hypothesis_scores_context_once_and_whole_logits():
    """Scores read every block's states and learn once, from all B (the head's gradient is that of the whole
    batch); the context is computed once per block; whole logits as well as chunks."""
    mcl, pristine, inputs, labels = wrapped_model("llama", adapt_context=False, scoring=True, logits_chunk_size=None)
    inputs, labels = build_batch("llama", pristine, batch=4, generator=torch.Generator().manual_seed(3))
    inputs, labels = uneven_batch(inputs, labels)  # contexts of different lengths, left and right padding
    mcl.train()
    grads = []
    for per_block in (None, 3, 1):
        mcl.zero_grad(set_to_none=True)
        out, rows = _scored(mcl, inputs, labels, per_block)
        if per_block is None:
            expected = out
        _assert_same(out, expected)
        out.scoring_loss.backward()  # the head learns even in a no-grad forward
        grads.append(torch.cat([p.grad.flatten() for p in mcl.scoring_head.parameters()]))
        sizes = {None: [4], 3: [3, 1], 1: [1] * 4}[per_block]
        assert rows == [rows for n in sizes for rows in (n, 3 * n)]  # per block: its context on n rows, targets on K*n
    for grad in grads[1:]:
        torch.testing.assert_close(grad, grads[0], rtol=0, atol=1e-6)


def test_inputs_that_cannot_be_cut_by_example_run_whole_with_one_warning():
    """Qwen2-VL's image patches are flattened over the batch: which rows are whose is the model's business."""
    mcl, _, inputs, labels = wrapped_model("qwen2_vl")
    expected, _ = _scored(mcl, inputs, labels)
    with pytest.warns(UserWarning, match=r"'pixel_values'.*runs the batch whole, not 1 example at a time"):
        got, rows = _scored(mcl, inputs, labels, 1)
    _assert_same(got, expected)
    assert len(rows) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        _scored(mcl, inputs, labels, 1)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_two_pass_step_with_the_scoring_pass_in_blocks_equals_it_whole(tmp_path, checkpointing):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no")
    mcl, pristine, _, _ = wrapped_model("llama")
    inputs, labels = build_batch("llama", pristine, batch=5, generator=torch.Generator().manual_seed(3))
    results = {}
    for per_block in (None, "auto", 4):
        model = copy.deepcopy(mcl).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        trainer = MCLTrainer(model, args=args, scoring_examples_per_block=per_block)
        calls = []
        model.base_model.register_forward_pre_hook(lambda module, args, calls=calls: calls.append(None))
        loss = trainer.compute_loss(model, {**inputs, "labels": labels})
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results[per_block] = loss.detach(), trainer.log_store.wins.clone(), grads
        assert len(calls) == {None: 1, "auto": 3, 4: 2}[per_block] + 1  # scoring blocks (auto: 2, 2, 1), winners
    expected = results[None]
    assert expected[2]
    for loss, wins, grads in list(results.values())[1:]:
        torch.testing.assert_close(loss, expected[0], rtol=0, atol=1e-6)
        assert torch.equal(wins, expected[1])
        assert grads.keys() == expected[2].keys()
        for key, grad in expected[2].items():
            torch.testing.assert_close(grads[key], grad, rtol=0, atol=1e-6, msg=key)


def test_the_automatic_block_has_about_as_many_rows_as_the_winners_pass():
    # ceil(B / K) examples: K*n rows, the winners' B rows rounded up to a multiple of K
    assert [scoring_block(batch, 5) for batch in (1, 4, 5, 6, 10, 11)] == [1, 1, 1, 2, 2, 3]
    assert [scoring_block(batch, 3) for batch in (2, 4, 8)] == [1, 2, 3]


def test_misuse_of_examples_per_block_is_refused(tmp_path):
    mcl, _, inputs, labels = wrapped_model("llama")
    for value in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="examples_per_block must be a number of examples"), torch.no_grad():
            mcl(**inputs, labels=labels, examples_per_block=value)
    with pytest.raises(ValueError, match="hypotheses=None"), torch.no_grad():
        mcl(**inputs, labels=labels, hypotheses=1, examples_per_block=1)
    with pytest.raises(ValueError, match="hypotheses=None"), torch.no_grad():
        mcl(**inputs, examples_per_block=1)
    with pytest.raises(ValueError, match="hypotheses=None"), torch.no_grad(), mcl.disable_adapters():
        mcl(**inputs, labels=labels, examples_per_block=1)
    with pytest.raises(ValueError, match=r"with gradients.*torch.no_grad\(\)"):
        mcl(**inputs, labels=labels, examples_per_block=1)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no")
    for value in (0, True, "whole"):
        with pytest.raises(ValueError, match="scoring_examples_per_block must be 'auto', None or a number"):
            MCLTrainer(mcl, args=args, scoring_examples_per_block=value)
