"""Audio captioning prompts and labels through Qwen2-Audio's processor, on a tiny random Qwen2-Audio."""

import numpy as np
import pytest
import torch
from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

from loramcl import MCLConfig, get_mcl_model
from loramcl.decoding import generate_hypotheses
from loramcl.models import tiny_qwen2_audio
from loramcl.recipes.audio_captioning.prompts import CaptionEncoder, collate_audio

WORDS = "a dog barks loudly rain falls".split()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tiny_qwen2_audio(tmp_path_factory.mktemp("tiny") / "qwen2-audio", WORDS)
    return Qwen2AudioForConditionalGeneration.from_pretrained(folder).eval(), AutoProcessor.from_pretrained(folder)


def noise(seconds: float, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.5, 0.5, int(16_000 * seconds)).astype(np.float32)


def test_chat_prompt_labels_only_on_caption_and_end_of_turn(tiny):
    _, processor = tiny
    encoder = CaptionEncoder(processor, chat_template=True)
    assert encoder.end == "<|im_end|>"
    assert encoder.prompt.endswith("Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nGenerate the caption in "
                                   "English:<|im_end|>\n<|im_start|>assistant\n")
    for seconds, audio_tokens in [(0.5, 12), (1.0, 25), (3.0, 25)]:  # 50 / 100 frames: ((n - 1) // 2 - 1) // 2 + 1
        row = encoder.encode(noise(seconds), "a dog barks")
        ids, labels = row["input_ids"], row["labels"]
        assert ids.count(processor.tokenizer.convert_tokens_to_ids("<|AUDIO|>")) == audio_tokens
        target = [i for i, label in zip(ids, labels, strict=True) if label != -100]
        assert processor.tokenizer.convert_ids_to_tokens(target) == ["a", "dog", "barks", "<|im_end|>"]
        assert labels[-4:] == ids[-4:] and all(label == -100 for label in labels[:-4])
        assert row["input_features"].shape == (16, 100) and int(row["feature_attention_mask"].sum()) == min(
            100, int(seconds * 100))


def test_raw_prompt_of_the_paper(tiny):
    _, processor = tiny
    encoder = CaptionEncoder(processor, chat_template=False)
    assert encoder.prompt == "<|audio_bos|><|AUDIO|><|audio_eos|>Generate the caption in English:"
    row = encoder.encode(noise(0.5), "rain falls")
    tokens = processor.tokenizer.convert_ids_to_tokens(row["input_ids"])
    assert tokens[0] == "<|audio_bos|>" and tokens[1:13] == ["<|AUDIO|>"] * 12 and tokens[13] == "<|audio_eos|>"
    target = [t for t, label in zip(tokens, row["labels"], strict=True) if label != -100]
    assert target == ["rain", "falls", "<|endoftext|>"]
    with pytest.raises(ValueError, match="non-empty string"):
        encoder.encode(noise(0.5), "  ")


def test_no_chat_template_is_a_clear_error(tiny):
    _, processor = tiny
    saved, processor.chat_template = processor.chat_template, None
    try:
        with pytest.raises(ValueError, match="has no chat template: set chat_template: false"):
            CaptionEncoder(processor, chat_template=True)
    finally:
        processor.chat_template = saved


def test_batch_nll_is_the_mean_over_caption_tokens(tiny):
    """The processor's audio tokens match the model's audio features (else the model refuses the batch), and the
    MCL NLL of a K = 1 model with zero adapters is the base model's mean cross-entropy on caption + end token."""
    model, processor = tiny
    encoder = CaptionEncoder(processor)
    rows = [encoder.encode(noise(0.5, 1), "a dog barks loudly"), encoder.encode(noise(1.0, 2), "rain falls")]
    batch = collate_audio(rows, processor.tokenizer.pad_token_id)
    assert batch["input_features"].shape == (2, 16, 100) and batch["feature_attention_mask"].shape == (2, 100)
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits  # [B, T, V]
    labels = batch["labels"]
    expected = []
    for b in range(2):
        positions = (labels[b, 1:] != -100).nonzero().squeeze(1)  # predicted from the token before
        expected.append(torch.nn.functional.cross_entropy(logits[b, positions], labels[b, 1:][positions]))
    mcl = get_mcl_model(model, MCLConfig(num_hypotheses=1, r=2, alpha=2, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        nll = mcl(**batch).nll  # [B, 1]
    torch.testing.assert_close(nll[:, 0], torch.stack(expected), rtol=1e-5, atol=1e-5)
    mcl.unload()


def test_generation_batch_is_left_padded_and_decodes(tiny):
    model, processor = tiny
    encoder = CaptionEncoder(processor)
    batch = encoder.generation_batch([noise(0.5), noise(1.0)])
    assert processor.tokenizer.padding_side == "right"  # restored
    assert batch["attention_mask"][:, -1].all() and not batch["attention_mask"][0, 0]
    mcl = get_mcl_model(model, MCLConfig(num_hypotheses=2, r=2, alpha=2, target_modules=["q_proj", "v_proj"]))
    outs = generate_hypotheses(mcl, processor, batch, max_new_tokens=3)
    assert [len(o) for o in outs] == [2, 2] and all(isinstance(c.text, str) for o in outs for c in o)
    mcl.unload()


def test_raw_prompt_keeps_the_caption_boundary_under_byte_level_bpe():
    """With Qwen2's byte-level BPE (its pre-tokenizer joins ':' to the letters after it), the paper's literal
    "English:<caption>" would merge ':' with the caption's first letters, so the prompt alone would not tokenize as
    it does before the caption; the space that starts the target keeps them apart."""
    from transformers import Qwen2AudioProcessor, Qwen2Tokenizer, WhisperFeatureExtractor
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = sorted(set(bytes_to_unicode().values()))
    merges = [(":", "r"), ("\u0120", "r"), ("a", "i")]  # "Ġ" is byte-level BPE's space
    vocab = {s: i for i, s in enumerate(symbols)} | {a + b: len(symbols) + i for i, (a, b) in enumerate(merges)}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]})
    processor = Qwen2AudioProcessor(WhisperFeatureExtractor(feature_size=16, chunk_length=1), tokenizer)
    assert tokenizer.tokenize("English:rain")[-3:] == [":r", "ai", "n"]  # the literal form merges ':' and 'r'
    encoder = CaptionEncoder(processor, chat_template=False)
    row = encoder.encode(noise(0.5), "rain")
    target = [t for t, label in zip(tokenizer.convert_ids_to_tokens(row["input_ids"]), row["labels"], strict=True)
              if label != -100]
    assert target == ["\u0120r", "ai", "n", "<|endoftext|>"]
    prompt_ids = encoder.generation_batch([noise(0.5)])["input_ids"][0].tolist()
    assert row["input_ids"][:len(prompt_ids)] == prompt_ids  # decoding reads exactly the training prompt
    encoder.separator = ""  # the literal form: the encoder's check refuses it
    with pytest.raises(ValueError, match="not a prefix of prompt \\+ caption"):
        encoder.encode(noise(0.5), "rain")
