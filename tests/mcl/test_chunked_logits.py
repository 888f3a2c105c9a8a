"""Vocabulary logits and cross-entropy in chunks (MCLConfig.logits_chunk_size): the same NLL, loss and adapter
gradients as the whole [N, V] logits, on causal, encoder-decoder and multimodal classes, tied output layers and
models that transform their logits after the output layer."""

import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from conftest import randomize_adapters, wrapped_model
from tiny_models import VOCAB, build_batch

from loramcl import MCLConfig, get_mcl_model
from loramcl.mcl.nll import chunked_token_nll


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 13, 64])
def test_chunked_token_nll_equals_the_whole_cross_entropy(chunk_size):
    """13 tokens: chunks that divide N (1, 13), leave a remainder (4, 7) or exceed it (64)."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 29).requires_grad_(False)  # a bias too
    hidden = torch.randn(13, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 29, (13,), generator=g)
    weights = torch.rand(13, generator=g)  # the loss weighs each token
    whole = F.cross_entropy(head(hidden), targets, reduction="none")  # [13]
    expected_grad, = torch.autograd.grad((whole * weights).sum(), hidden)
    nll = chunked_token_nll(hidden, targets, head, chunk_size)
    torch.testing.assert_close(nll, whole, atol=1e-6, rtol=0)
    grad, = torch.autograd.grad((nll * weights).sum(), hidden)
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=0)
    with torch.no_grad():  # the scoring pass keeps no gradient
        torch.testing.assert_close(chunked_token_nll(hidden, targets, head, chunk_size), whole, atol=1e-6, rtol=0)


def _nll_loss_grads(mcl, inputs, labels, chunk_size, hypotheses=None):
    mcl.mcl_config.logits_chunk_size = chunk_size
    mcl.zero_grad(set_to_none=True)
    out = mcl(**inputs, labels=labels, hypotheses=hypotheses)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in mcl.named_parameters() if p.grad is not None}
    return out.nll.detach(), out.loss.detach(), grads


def _assert_same(expected, got):
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=0)  # nll per example and hypothesis
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=0)  # loss
    assert got[2].keys() == expected[2].keys() and expected[2]
    for name, grad in expected[2].items():
        torch.testing.assert_close(got[2][name], grad, atol=1e-5, rtol=1e-5, msg=name)


# llama: causal; t5: encoder-decoder with the output layer tied to the embeddings (and the decoder output scaled
# before it); bart: encoder-decoder adding final_logits_bias after the output layer; gemma2: soft-capped logits;
# qwen2_audio, llava_next: multimodal
@pytest.mark.parametrize("name", ["llama", "t5", "bart", "gemma2", "qwen2_audio", "llava_next"])
def test_chunks_give_the_nll_loss_and_gradients_of_the_whole_logits(name):
    mcl, _, inputs, labels = wrapped_model(name, loss="relaxed", epsilon=0.2)
    base = mcl.base_model
    if name == "t5":
        assert base.get_output_embeddings().weight is base.get_input_embeddings().weight
    if name == "bart":  # zeros when initialised: make it matter
        base.final_logits_bias.normal_(generator=torch.Generator().manual_seed(1))
    rows = []
    layer = base.get_output_embeddings()
    layer.register_forward_hook(lambda module, args, output: rows.append(args[0].shape[0]))
    expected = _nll_loss_grads(mcl, inputs, labels, None)
    tokens = rows.pop()  # K * label tokens of the batch, in one call
    assert tokens >= 8
    for chunk_size in (3, 5, tokens):  # remainders, and one chunk
        _assert_same(expected, _nll_loss_grads(mcl, inputs, labels, chunk_size))
        assert mcl.label_logits.unchunkable is None  # the chunks ran, none fell back to the whole logits
        # the model's probe row, the same row to check it (at the first chunked forward only), then the chunks
        checked = 2 if chunk_size == 3 else 1
        assert rows[:checked] == [1] * checked and max(rows[checked:]) <= chunk_size
        assert sum(rows[checked:]) == tokens
        rows.clear()


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_two_pass_wta_with_chunks_equals_it_without(name):
    """The no-grad scoring pass over all K and the winners' forward + backward (one hypothesis per example)."""
    mcl, _, inputs, labels = wrapped_model(name)
    for chunk_size in (None, 3):
        mcl.mcl_config.logits_chunk_size = chunk_size
        with torch.no_grad():
            scored = mcl(**inputs, labels=labels).nll  # [B, K]
        if chunk_size is None:
            expected_scores = scored
        torch.testing.assert_close(scored, expected_scores, atol=1e-5, rtol=0)
    winners = expected_scores.argmin(dim=1)
    _assert_same(_nll_loss_grads(mcl, inputs, labels, None, winners),
                 _nll_loss_grads(mcl, inputs, labels, 3, winners))


def test_logits_transformed_by_the_model_in_an_unknown_way_are_computed_whole():
    """Cohere multiplies its logits by logit_scale after the output layer: the probe row differs from what the
    chunks would compute, so the forward warns once and computes the whole logits, right from that forward."""
    config = tf.CohereConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, logit_scale=0.5, bos_token_id=1,
                             eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    mcl = get_mcl_model(tf.CohereForCausalLM(config), MCLConfig(num_hypotheses=2, target_modules=["q_proj", "v_proj"],
                                                                loss="relaxed", epsilon=0.2, logits_chunk_size=None))
    randomize_adapters(mcl)
    inputs, labels = build_batch("llama", mcl.base_model)
    expected = _nll_loss_grads(mcl, inputs, labels, None)
    with pytest.warns(UserWarning, match="CohereForCausalLM transforms the output of its output layer"):
        got = _nll_loss_grads(mcl, inputs, labels, 3)
    _assert_same(expected, got)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        _assert_same(expected, _nll_loss_grads(mcl, inputs, labels, 3))


def test_a_trainable_output_layer_gets_its_gradient_from_the_whole_logits():
    """The chunks give no gradient to the output layer's weight: one that trains is computed whole."""
    mcl, _, inputs, labels = wrapped_model("llama", loss="relaxed", epsilon=0.2)
    mcl.base_model.lm_head.weight.requires_grad_(True)
    expected = _nll_loss_grads(mcl, inputs, labels, None)
    got = _nll_loss_grads(mcl, inputs, labels, 3)
    assert "base_model.lm_head.weight" in got[2]
    _assert_same(expected, got)


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "64"])
def test_logits_chunk_size_is_a_positive_integer_or_none(value):
    with pytest.raises(ValueError, match="logits_chunk_size"):
        MCLConfig(logits_chunk_size=value)
