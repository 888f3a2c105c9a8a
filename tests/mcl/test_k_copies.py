"""The one K-copy mechanism (DESIGN decision 9): nested inputs, batch dimensions by rule, items flattened over the
batch, adapted towers whose rows per example vary; encoder-decoders that derive decoder inputs from labels."""

import collections
import types
import warnings

import pytest
import torch
from conftest import randomize_adapters, wrapped_model
from tiny_models import build_batch, build_model
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutput

from loramcl import MCLConfig, get_mcl_model
from loramcl.decoding import generate_hypotheses
from loramcl.mcl.copies import RowsPerExampleUnknown, repeat_examples
from loramcl.mcl.model import decoder_input_ids_from_labels
from loramcl.mcl.nll import sequence_nll

B, K, T = 2, 3, 5
Pair = collections.namedtuple("Pair", "cos sin")


def test_repeat_examples_follows_one_rule_for_every_input():
    hidden = torch.arange(B * T * 1.0).view(B, T, 1)
    inputs = {
        "masks": {"full_attention": torch.ones(B, 1, T, T), "sliding_attention": torch.zeros(B, 1, T, T)},  # Gemma3
        "position_ids": torch.arange(3 * B * T).view(3, B, T),  # M-RoPE: batch on dim 1
        "shared_positions": torch.arange(T).view(1, T),  # broadcast over the batch
        "cache_position": torch.arange(B),  # never per example, even when its size is B
        "patches": torch.arange(7 * 4.0).view(7, 4),  # items of all examples, flattened in example order
        "encoder_outputs": BaseModelOutput(last_hidden_state=hidden),
        "position_embeddings": Pair(hidden, -hidden),
        "layers": [hidden, None, 3],
    }
    copies = repeat_examples(inputs, K, B)
    assert torch.equal(copies["masks"]["full_attention"], torch.ones(K * B, 1, T, T))
    assert copies["position_ids"].shape == (3, K * B, T)
    for c in range(K):  # copy c of a batch-first tensor: rows c*B ... (c+1)*B - 1
        assert torch.equal(copies["position_ids"][:, c * B:(c + 1) * B], inputs["position_ids"])
        assert torch.equal(copies["encoder_outputs"].last_hidden_state[c * B:(c + 1) * B], hidden)
        assert torch.equal(copies["patches"][c * 7:(c + 1) * 7], inputs["patches"])  # copy-major, not interleaved
    assert copies["shared_positions"] is inputs["shared_positions"] and copies["cache_position"].shape == (B,)
    assert isinstance(copies["encoder_outputs"], BaseModelOutput) and isinstance(copies["position_embeddings"], Pair)
    assert torch.equal(copies["position_embeddings"].sin, -copies["position_embeddings"].cos)
    assert copies["layers"][0].shape == (K * B, T, 1) and copies["layers"][1:] == [None, 3]
    with pytest.raises(ValueError, match=r"'position_ids' of shape \(3, 4, 5\).*batch \(2\) on dimension 1"):
        repeat_examples(torch.zeros(3, 4, T), K, B, "position_ids")
    cache = DynamicCache()
    cache.update(torch.zeros(B, 1, T, 4), torch.zeros(B, 1, T, 4), 0)
    with pytest.raises(ValueError, match="cache of past keys and values"):
        repeat_examples({"past_key_values": cache}, K, B)


@pytest.mark.parametrize("name", ["llava_next", "qwen2_vl"])
def test_adapted_vision_tower_with_rows_per_example_that_vary(name):
    """Adapters in the vision tower, images of different sizes (LLaVA-NeXT anyres crops, Qwen2-VL patches): the K
    copies and K-hypothesis decoding route by copy; one hypothesis per example is computed exactly through all K
    (with a warning), and refused where that is impossible (generate)."""
    base = build_model(name).eval()
    inputs, labels = build_batch(name, base)
    mcl = get_mcl_model(base, MCLConfig(num_hypotheses=K, r=4, alpha=8, target_modules="all-linear")).eval()
    randomize_adapters(mcl, std=0.5)
    tower = "model.vision_tower" if name == "llava_next" else "model.visual"
    assert tower in mcl.branch_names and any(n.startswith(tower + ".") for n in mcl.layer_names)
    index = torch.tensor([2, 0])
    with torch.no_grad():
        nll = mcl(**inputs, labels=labels).nll  # [B, K]
        for k in range(K):
            torch.testing.assert_close(mcl(**inputs, labels=labels, hypotheses=k).nll, nll[:, k], atol=1e-5, rtol=0)
        with pytest.warns(UserWarning, match=f"cannot be routed in '{tower}'.*Running all K hypotheses"):
            chosen = mcl(**inputs, labels=labels, hypotheses=index).nll
    torch.testing.assert_close(chosen, nll[torch.arange(B), index], atol=1e-5, rtol=0)

    settings = dict(strategy="beam", num_beams=2, max_new_tokens=3, min_new_tokens=3)
    batched = generate_hypotheses(mcl, None, inputs, **settings)
    for k in range(K):
        alone = generate_hypotheses(mcl, None, inputs, hypotheses=[k], **settings)
        assert [row[k].token_ids for row in batched] == [row[0].token_ids for row in alone]
    assert any(len({tuple(c.token_ids) for c in row}) > 1 for row in batched)
    with pytest.raises(RowsPerExampleUnknown, match=f"'{tower}'.*rows for 2 examples"), torch.no_grad():
        with mcl.use_hypotheses(index):
            mcl.generate(**inputs, max_new_tokens=2)


def test_whisper_trains_from_labels_as_whisper_does():
    """Whisper builds decoder inputs from labels itself (shift right, decoder start token): so do we."""
    mcl, pristine, inputs, labels = wrapped_model("whisper", targets="all-linear")
    assert set(inputs) == {"input_features"}
    with torch.no_grad():
        own = pristine(**inputs, labels=labels).logits  # Whisper's forward derives decoder_input_ids
        with mcl.disable_adapters():
            nll = mcl(**inputs, labels=labels).nll
    torch.testing.assert_close(nll, sequence_nll(own, labels, causal=False), atol=1e-6, rtol=0)
    expected = torch.cat([torch.full((B, 1), pristine.config.decoder_start_token_id), labels[:, :-1]], dim=1)
    assert torch.equal(decoder_input_ids_from_labels(pristine, labels), expected.masked_fill(expected == -100, 0))
    assert mcl(**inputs, labels=labels).nll.shape == (B, K)


def test_whisper_beam_baseline_log_probs_are_the_model_likelihood():
    """Whisper's generate keeps step logits for the returned rows only: log-probs come from teacher forcing."""
    model = build_model("whisper").eval()
    inputs, _ = build_batch("whisper", model)
    outs = generate_hypotheses(model, None, inputs, strategy="beam", num_beams=3, num_sequences=2,
                               max_new_tokens=3, min_new_tokens=3)
    for i in range(B):
        for candidate in outs[i]:
            sequence = torch.tensor([[model.config.decoder_start_token_id] + candidate.token_ids])
            with torch.no_grad():
                logits = model(input_features=inputs["input_features"][i:i + 1], decoder_input_ids=sequence).logits
            expected = logits[0, :-1].log_softmax(-1).gather(1, sequence[0, 1:, None]).sum().item()
            assert candidate.log_prob == pytest.approx(expected, abs=1e-4)


def test_an_encoder_decoder_without_a_rule_for_decoder_inputs_is_a_clear_error():
    class Seq2Seq(torch.nn.Module):  # neither prepare_decoder_input_ids_from_labels nor a shift_tokens_right
        config = types.SimpleNamespace(decoder_start_token_id=0, pad_token_id=0, is_encoder_decoder=True)

    with pytest.raises(ValueError, match="pass decoder_input_ids: Seq2Seq has no rule"):
        decoder_input_ids_from_labels(Seq2Seq(), torch.ones(1, 3, dtype=torch.long))


def test_exported_task_type_suits_the_model(tmp_path):
    import json

    for name, task_type in (("whisper", None), ("llama", "CAUSAL_LM"), ("t5", "SEQ_2_SEQ_LM")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mcl = wrapped_model(name, num_hypotheses=2, targets="all-linear")[0]
        mcl.export_hypothesis(0, tmp_path / name)
        assert json.loads((tmp_path / name / "adapter_config.json").read_text())["task_type"] == task_type


def test_a_time_first_layout_is_refused_not_misrouted():
    """XLNet runs its blocks on [T, B, d]: splitting dim 0 into K blocks would mix time steps across hypotheses."""
    import transformers as tf

    model = tf.XLNetLMHeadModel(tf.XLNetConfig(vocab_size=97, d_model=16, n_layer=1, n_head=2, d_inner=16))
    mcl = get_mcl_model(model, MCLConfig(num_hypotheses=K, target_modules=["layer_1"]))
    input_ids = torch.randint(3, 80, (B, 3 * K))  # T = 9: a multiple of K, unlike K*B = 6
    with pytest.raises(RuntimeError, match="batch is on dimension 1 .*time-first"):
        mcl(input_ids=input_ids, labels=input_ids)


def test_decoding_runs_a_frozen_tower_once_for_the_k_copies():
    """LLaVA-NeXT with adapters in the language model only (the paper's setting): decoding K hypotheses gives the
    vision tower and projector one copy of the images (anyres, different sizes), not K, and every hypothesis's
    tokens equal its decoding alone; with the sharing off the tower sees K times the patches and the outputs are the
    same. Copies that are not equal are never shared."""
    mcl, _, inputs, _ = wrapped_model("llava_next", num_hypotheses=K)
    assert mcl.shared_module_names == ["model.vision_tower", "model.multi_modal_projector"]
    tower = mcl.base_model.get_submodule("model.vision_tower")
    seen = []
    handle = tower.register_forward_pre_hook(lambda module, args, kwargs: seen.append(
        (args[0] if args else kwargs["pixel_values"]).shape[0]), with_kwargs=True)
    settings = dict(strategy="beam", num_beams=2, max_new_tokens=4, min_new_tokens=4)
    generate_hypotheses(mcl, None, inputs, hypotheses=[0], **settings)
    once, patches = list(seen), 5  # 2 anyres crops of the 16x16 image, 3 of the 16x32 one
    assert once == [patches]
    seen.clear()
    shared = generate_hypotheses(mcl, None, inputs, **settings)
    assert seen == once
    seen.clear()
    mcl.share_frozen_modules = False
    repeated = generate_hypotheses(mcl, None, inputs, **settings)
    assert seen == [K * patches]
    mcl.share_frozen_modules = True
    assert [[c.token_ids for c in row] for row in shared] == [[c.token_ids for c in row] for row in repeated]
    for k in range(K):
        alone = generate_hypotheses(mcl, None, inputs, hypotheses=[k], **settings)
        assert [row[k].token_ids for row in shared] == [row[0].token_ids for row in alone]
    assert any(len({tuple(c.token_ids) for c in row}) > 1 for row in shared)
    # two "copies" that differ (another image in the second): the tower runs on both
    other = dict(inputs, pixel_values=torch.cat([inputs["pixel_values"], inputs["pixel_values"].flip(0)]),
                 **{name: torch.cat([inputs[name]] * 2) for name in ("input_ids", "attention_mask")},
                 image_sizes=torch.cat([inputs["image_sizes"], inputs["image_sizes"].flip(0)]))
    seen.clear()
    with torch.no_grad(), mcl.use_hypotheses(torch.tensor([0, 1]), copies=True):
        logits = mcl.base_model(**other).logits
    handle.remove()
    assert seen == [2 * patches]
    with torch.no_grad(), mcl.use_hypotheses(torch.tensor([0, 1]), copies=True):
        mcl.share_frozen_modules = False
        expected = mcl.base_model(**other).logits
        mcl.share_frozen_modules = True
    torch.testing.assert_close(logits, expected, atol=0, rtol=0)


@pytest.mark.parametrize("adapt_context", [True, False])
def test_generate_hands_the_frozen_output_layer_a_contiguous_input(adapt_context):
    """The prefill's last-position states are a strided slice; on a frozen output layer torch would multiply them
    by the weight expanded once per row (``mcl.generate.contiguous_head_input``). Every call of the output layer
    in a generate reads a contiguous input, and the hook is gone afterwards."""
    mcl, _, batch, _ = wrapped_model("llama", num_hypotheses=K, adapt_context=adapt_context)
    inputs = {"input_ids": batch["input_ids"][:, :T]}  # unpadded prompts
    head = mcl.base_model.get_output_embeddings()
    assert not head.weight.requires_grad
    seen = []
    handle = head.register_forward_hook(lambda module, args, output: seen.append(
        (tuple(args[0].shape), args[0].is_contiguous())))
    hooks = len(head._forward_pre_hooks)
    generate_hypotheses(mcl, None, inputs, strategy="greedy", max_new_tokens=3, min_new_tokens=3)
    handle.remove()
    rows = K * len(inputs["input_ids"])
    steps = [call for call in seen if call[0][0]]  # adapt_context=False: the context's run asks for no logits
    assert steps[0][0][:2] == (rows, 1) and all(contiguous for _, contiguous in steps) and len(steps) == 3
    assert len(head._forward_pre_hooks) == hooks


def test_decoding_runs_an_encoder_without_adapters_once():
    """Whisper with adapters in its decoder only: the encoder runs on the B examples, not K*B, and every
    hypothesis decodes as it does alone."""
    base = build_model("whisper").eval()
    inputs, _ = build_batch("whisper", base)
    mcl = get_mcl_model(base, MCLConfig(num_hypotheses=K, r=4, alpha=8,
                                        target_modules=r".*decoder.*\.(q_proj|k_proj|v_proj)")).eval()
    randomize_adapters(mcl, std=0.5)
    assert mcl.shared_module_names == ["model.encoder"]
    seen = []
    mcl.base_model.get_encoder().register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((args[0] if args else kwargs["input_features"]).shape[0]),
        with_kwargs=True)
    settings = dict(strategy="beam", num_beams=2, max_new_tokens=4, min_new_tokens=4)
    batched = generate_hypotheses(mcl, None, inputs, **settings)
    assert set(seen) == {B}
    for k in range(K):
        alone = generate_hypotheses(mcl, None, inputs, hypotheses=[k], **settings)
        assert [row[k].token_ids for row in batched] == [row[0].token_ids for row in alone]
    assert any(len({tuple(c.token_ids) for c in row}) > 1 for row in batched)
