"""adapt_context=False: the context computed once equals the full forward with the adapters masked on the context."""

import copy

import pytest
import torch
from conftest import randomize_adapters, wrapped_model
from tiny_models import build_model, uneven_batch
from transformers import TrainingArguments

from loramcl import MCLConfig, MCLTrainer, get_mcl_model
from loramcl.mcl.model import MCLModel


def _run(mcl: MCLModel, inputs: dict, labels: torch.Tensor, context_once: bool, hypotheses=None):
    """(output, logits at the label positions [N, V], adapter gradients, rows x positions each adapted layer saw)."""
    mcl.context_once = context_once
    mcl.zero_grad()
    logits, shapes = [], []
    hooks = [mcl.base_model.get_output_embeddings().register_forward_hook(lambda m, a, o: logits.append(o)),
             mcl.base_model.get_submodule(mcl.layer_names[0]).register_forward_hook(
                 lambda m, a, o: shapes.append(tuple(a[0].shape[:2])))]
    try:
        out = mcl(**inputs, labels=labels, hypotheses=hypotheses)
    finally:
        for hook in hooks:
            hook.remove()
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in mcl.named_parameters() if p.grad is not None}
    return out, [x for x in logits if x.shape[0]][-1], grads, shapes


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("loss", ["relaxed", "annealed", "wta"])
def test_context_once_equals_the_masked_full_forward(name, loss):
    mcl, _, inputs, labels = wrapped_model(name, adapt_context=False, loss=loss,
                                           epsilon=0.1 if loss == "relaxed" else 0.0)
    inputs, labels = uneven_batch(inputs, labels)
    full, full_logits, full_grads, full_shapes = _run(mcl, inputs, labels, context_once=False)
    once, once_logits, once_grads, once_shapes = _run(mcl, inputs, labels, context_once=True)
    assert full_shapes == [(6, 9)]  # K*B rows over the whole sequence
    assert once_shapes == [(2, 4), (6, 6)]  # the context (C = 4) on B rows, the targets (L = 9 - 3) on K*B rows
    torch.testing.assert_close(once_logits, full_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(once.nll, full.nll, rtol=0, atol=1e-6)
    torch.testing.assert_close(once.loss, full.loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(once.weights, full.weights)
    assert full_grads.keys() == once_grads.keys() and full_grads
    for key, grad in full_grads.items():
        torch.testing.assert_close(once_grads[key], grad, rtol=0, atol=1e-6, msg=key)
    # the option changes the model: the masked adapters are not the paper's (adapt_context=True)
    mcl.mcl_config.adapt_context = True
    assert (mcl(**inputs, labels=labels).nll - full.nll).abs().max() > 1e-3


@pytest.mark.parametrize("hypotheses", [1, torch.tensor([2, 0])])
def test_one_hypothesis_per_example_shares_the_context_too(hypotheses):
    mcl, _, inputs, labels = wrapped_model("llama", adapt_context=False)
    inputs, labels = uneven_batch(inputs, labels)
    full, _, full_grads, _ = _run(mcl, inputs, labels, context_once=False, hypotheses=hypotheses)
    once, _, once_grads, shapes = _run(mcl, inputs, labels, context_once=True, hypotheses=hypotheses)
    assert shapes == [(2, 4), (2, 6)]
    torch.testing.assert_close(once.nll, full.nll, rtol=0, atol=1e-6)
    for key, grad in full_grads.items():
        torch.testing.assert_close(once_grads[key], grad, rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", ["bart", "t5"])
def test_encoder_decoder_runs_the_encoder_once_without_adapters(name):
    mcl, _, inputs, labels = wrapped_model(name, adapt_context=False, loss="relaxed", epsilon=0.1)
    reference = copy.deepcopy(mcl)  # the naive model: the encoder's adapters at zero, all K on the full batch
    reference.mcl_config.adapt_context = True
    encoder = {n for n, _ in mcl.mcl_layers() if ".encoder." in f".{n}"}
    with torch.no_grad():
        for n, layer in reference.mcl_layers():
            if n in encoder:
                layer.lora_B.zero_()
    rows = []
    first_encoder_layer = sorted(encoder)[0]
    mcl.base_model.get_submodule(first_encoder_layer).register_forward_hook(lambda m, a, o: rows.append(a[0].shape[0]))
    once, expected = mcl(**inputs, labels=labels), reference(**inputs, labels=labels)
    assert rows == [2]  # B rows, not K*B
    torch.testing.assert_close(once.nll, expected.nll, rtol=0, atol=1e-6)
    once.loss.backward()
    expected.loss.backward()
    for (n, layer), (_, ref_layer) in zip(mcl.mcl_layers(), reference.mcl_layers(), strict=True):
        if n in encoder:  # the encoder's adapters never act, so they get no gradient
            assert layer.lora_A.grad is None and layer.lora_B.grad is None
        else:
            torch.testing.assert_close(layer.lora_B.grad, ref_layer.lora_B.grad, rtol=0, atol=1e-6)
            torch.testing.assert_close(layer.lora_A.grad, ref_layer.lora_A.grad, rtol=0, atol=1e-6)


def test_two_pass_wta_step_equals_the_masked_full_step(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no")
    mcl, _, inputs, labels = wrapped_model("llama", adapt_context=False)
    inputs, labels = uneven_batch(inputs, labels)
    grads = {}
    for once in (True, False):
        model = copy.deepcopy(mcl).train()
        model.context_once = once
        MCLTrainer(model, args=args).compute_loss(model, {**inputs, "labels": labels}).backward()
        grads[once] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys() and grads[True]
    for key, grad in grads[False].items():
        torch.testing.assert_close(grads[True][key], grad, rtol=0, atol=1e-6, msg=key)


def test_unsupported_inputs_and_uses_are_refused(tmp_path):
    mcl, _, inputs, labels = wrapped_model("llava_next", adapt_context=False)
    with pytest.raises(ValueError, match=r"pixel_values.*not supported yet.*adapt_context=True"):
        mcl(**inputs, labels=labels)
    with pytest.raises(ValueError, match="needs labels to know where the context ends"):
        mcl(**inputs)
    with pytest.raises(ValueError, match="adapt_context=False.*export"):
        mcl.export_hypothesis(0, tmp_path / "h0")
    with pytest.raises(ValueError, match="adapt_context=False.*merged"):
        mcl.merge_hypothesis(0)
    with pytest.raises(ValueError, match="adapt_context must be True or False"):
        MCLConfig(adapt_context="no")


def test_sliding_window_caches_are_refused():
    base = build_model("mistral")
    base.config.sliding_window = 4
    mcl = get_mcl_model(base, MCLConfig(num_hypotheses=2, target_modules=["q_proj"], adapt_context=False))
    ids = torch.randint(3, 80, (2, 9))
    labels = ids.clone()
    labels[:, :4] = -100
    with pytest.raises(ValueError, match="DynamicSlidingWindowLayer.*not supported yet"):
        mcl(input_ids=ids, labels=labels)


def _decoder(name):
    """A model whose hypotheses decode differently (larger adapters)."""
    mcl, _, inputs, _ = wrapped_model(name, adapt_context=False)
    randomize_adapters(mcl, std=0.3)
    return mcl, inputs


def _left_padded(mcl, inputs):
    if mcl.config.is_encoder_decoder:
        return inputs
    mask = torch.ones_like(inputs["input_ids"])
    mask[1, :3] = 0
    return {"input_ids": inputs["input_ids"], "attention_mask": mask}


@pytest.mark.parametrize(("name", "strategy", "beams"), [("llama", "greedy", None), ("llama", "beam", 2),
                                                         ("gpt2", "greedy", None), ("t5", "greedy", None)])
def test_batched_decoding_equals_each_hypothesis_alone_with_masked_adapters(name, strategy, beams):
    from loramcl.decoding import generate_hypotheses

    mcl, inputs = _decoder(name)
    inputs = _left_padded(mcl, inputs)
    options = dict(inputs=inputs, strategy=strategy, num_beams=beams, max_new_tokens=6, seed=3)
    shapes = []
    first = sorted(mcl.layer_names)[0]
    hook = mcl.base_model.get_submodule(first).register_forward_hook(lambda m, a, o: shapes.append(a[0].shape[:2]))
    batched = generate_hypotheses(mcl, **options)  # [B][K], the context once
    hook.remove()
    mcl.context_once = False
    alone = [generate_hypotheses(mcl, hypotheses=[k], **options) for k in range(3)]  # [K][B][1], masked prefill
    for i in range(2):
        for k in range(3):
            assert batched[i][k].token_ids == alone[k][i][0].token_ids, (i, k)
            assert batched[i][k].log_prob == pytest.approx(alone[k][i][0].log_prob, abs=1e-4)
    if not mcl.config.is_encoder_decoder:  # the prompt but its last token ran once, on B rows
        assert tuple(shapes[0]) == (2, inputs["input_ids"].shape[1] - 1)
        assert shapes[1][0] == 3 * 2 * (beams or 1)
    mcl.mcl_config.adapt_context = True
    paper = generate_hypotheses(mcl, **options)
    assert any(paper[i][k].token_ids != batched[i][k].token_ids for i in range(2) for k in range(3))


def test_rescored_log_probs_follow_the_masked_adapters():
    """Diverse MCL decoding at lambda = 0 is beam search; its log-probs come from a teacher-forced forward, the beam
    search's from the step logits."""
    from loramcl.decoding import generate_hypotheses

    mcl, inputs = _decoder("llama")
    options = dict(inputs=_left_padded(mcl, inputs), num_beams=2, max_new_tokens=5)
    beam = generate_hypotheses(mcl, strategy="beam", **options)
    diverse = generate_hypotheses(mcl, strategy="diverse_beam", diversity_penalty=0.0, **options)
    for row_beam, row_diverse in zip(beam, diverse, strict=True):
        for b, d in zip(row_beam, row_diverse, strict=True):
            assert b.token_ids == d.token_ids
            assert d.log_prob == pytest.approx(b.log_prob, abs=1e-4)


def test_hypothesis_scores_read_the_first_target_position():
    mcl, _, inputs, labels = wrapped_model("llama", adapt_context=False, scoring=True)
    inputs, labels = uneven_batch(inputs, labels)
    with torch.no_grad():
        mcl.scoring_head.weight.normal_()
        mcl.context_once = False
        full = mcl(**inputs, labels=labels)
        mcl.context_once = True
        once = mcl(**inputs, labels=labels)
    torch.testing.assert_close(once.log_scores, full.log_scores, rtol=0, atol=1e-6)
    torch.testing.assert_close(once.mixture_nll, full.mixture_nll, rtol=0, atol=1e-6)


def test_activation_checkpointing_recomputes_the_same_gradient():
    mcl, _, inputs, labels = wrapped_model("llama", adapt_context=False, loss="relaxed", epsilon=0.1)
    inputs, labels = uneven_batch(inputs, labels)
    _, _, expected, _ = _run(mcl.train(), inputs, labels, context_once=False)
    mcl.activation_checkpointing_enable({"use_reentrant": False})
    _, _, grads, _ = _run(mcl, inputs, labels, context_once=True)
    assert grads.keys() == expected.keys()
    for key, grad in expected.items():
        torch.testing.assert_close(grads[key], grad, rtol=0, atol=1e-6, msg=key)
