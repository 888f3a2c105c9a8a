"""Tiny randomly initialised models of real classes (Qwen2-Audio, LLaVA-NeXT) with their processors, for end-to-end
checks of the audio and image recipes on the CPU: their outputs mean nothing; and the word tokenizer and token rows of
the tests' and benchmarks' tiny Llama."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


# Qwen2-Audio's chat and audio special tokens, in the tiny model's vocabulary.
TINY_AUDIO_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_bos|>", "<|AUDIO|>",
                             "<|audio_eos|>")
# Words the chat template and the default instruction write.
_TEMPLATE_WORDS = "system user assistant You are a helpful assistant. Audio 1: Generate the caption in English:"


def tiny_qwen2_audio(out: str | Path, words: Sequence[str], seed: int = 0) -> Path:
    """A randomly initialised ``Qwen2AudioForConditionalGeneration`` (the real class, tiny: a 2-layer audio encoder
    on 16 mel bins and a 2-layer Qwen2 language model of width 32) with its ``Qwen2AudioProcessor`` (Whisper's
    feature extractor at 16 kHz with 16 mel bins and 1 s windows, so 25 audio tokens per second of audio; a
    word-level tokenizer over ``words``, the chat template's words and Qwen2-Audio's special tokens; the processor's
    chat template), written to ``out``. For CPU end-to-end checks of audio recipes: its outputs mean nothing.
    Returns ``out``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    out = Path(out)
    vocabulary = list(dict.fromkeys([*TINY_AUDIO_SPECIAL_TOKENS, "<unk>", *_TEMPLATE_WORDS.split(), *words]))
    backend = Tokenizer(models.WordLevel({token: i for i, token in enumerate(vocabulary)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<|endoftext|>",
                                        eos_token="<|endoftext|>",
                                        additional_special_tokens=list(TINY_AUDIO_SPECIAL_TOKENS[1:]))
    features = WhisperFeatureExtractor(feature_size=16, sampling_rate=16_000, hop_length=160, chunk_length=1)
    processor = Qwen2AudioProcessor(feature_extractor=features, tokenizer=tokenizer)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in TINY_AUDIO_SPECIAL_TOKENS}
    config = Qwen2AudioConfig(
        audio_config=dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=48,
                          num_mel_bins=16, max_source_positions=50),  # 100 frames (1 s) -> 50 positions
        text_config=dict(model_type="qwen2", vocab_size=len(vocabulary), hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256),
        audio_token_index=ids["<|AUDIO|>"])
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config)
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]  # as the Instruct checkpoint
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


# LLaVA-NeXT's tiny vocabulary: padding, begin and end of sequence, unknown word, then the words, then the image token.
TINY_LLAVA_SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
# A Vicuna-v1-like conversation as LLaVA-1.6-Vicuna's chat template writes it: "USER: <image>\n<instruction>
# ASSISTANT: <caption></s>" (the newline as a space: the tiny tokenizer splits on whitespace and punctuation).
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image> {% else %}{{ item['text'] }}"
    "{% endif %}{% endfor %}{% if message['role'] == 'user' %} {% else %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
# Words the chat template and the default instruction write (data.captioning.DEFAULT_INSTRUCTION).
_LLAVA_TEMPLATE_WORDS = ("USER ASSISTANT : . , Please carefully observe the image and come up with a caption for "
                         "the image .")


def tiny_llava_next_config(vocab_size: int, image_token_index: int):
    """The tiny LLaVA-NeXT architecture: a 2-layer CLIP vision tower on 16x16 crops of 4x4 patches, anyres over the
    grid 16x16 / 16x32, and a 2-layer Llama of width 32 (the vision tower's last layer is read)."""
    from transformers import LlavaNextConfig

    return LlavaNextConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, image_size=16, patch_size=4, projection_dim=32),
        text_config=dict(model_type="llama", vocab_size=vocab_size, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128),
        image_token_index=image_token_index, image_grid_pinpoints=[[16, 16], [16, 32]], vision_feature_layer=-1)


def tiny_llava_next_processor(words: Sequence[str], image_token_id: int | None = None):
    """A ``LlavaNextProcessor`` for ``tiny_llava_next_config``: a CLIP-like image processor with 16x16 crops and the
    model's anyres grid; a word-level tokenizer (words and punctuation apart) over TINY_LLAVA_SPECIAL_TOKENS, the
    chat template's words and ``words``, its '<image>' at ``image_token_id`` (default: the id after the words); and
    LLAVA_CHAT_TEMPLATE."""
    import re

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor, PreTrainedTokenizerFast

    vocabulary = list(dict.fromkeys([*TINY_LLAVA_SPECIAL_TOKENS, *re.findall(r"\w+|[^\w\s]+", _LLAVA_TEMPLATE_WORDS),
                                     *words]))
    image_token_id = len(vocabulary) if image_token_id is None else image_token_id
    if image_token_id < len(vocabulary):
        raise ValueError(f"image_token_id {image_token_id} falls inside the {len(vocabulary)} words' ids")
    backend = Tokenizer(models.WordLevel({token: i for i, token in enumerate(vocabulary)} | {
        "<image>": image_token_id}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()  # words and punctuation apart
    backend.decoder = decoders.WordPiece()  # joins words with spaces
    backend.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", extra_special_tokens={"image_token": "<image>"})
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
                                                 image_grid_pinpoints=[[16, 16], [16, 32]])
    return LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=4,
                              vision_feature_select_strategy="default", chat_template=LLAVA_CHAT_TEMPLATE,
                              num_additional_image_tokens=1)


def tiny_llava_next(out: str | Path, words: Sequence[str], seed: int = 0) -> Path:
    """A randomly initialised ``LlavaNextForConditionalGeneration`` (the real class, tiny: ``tiny_llava_next_config``)
    with its ``LlavaNextProcessor`` (``tiny_llava_next_processor`` over ``words``), written to ``out``. For CPU
    end-to-end checks of image recipes: its outputs mean nothing. Returns ``out``."""
    import torch
    from transformers import LlavaNextForConditionalGeneration

    out = Path(out)
    processor = tiny_llava_next_processor(words)
    tokenizer = processor.tokenizer
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(tiny_llava_next_config(image_token_id + 1, image_token_id))
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def word_tokenizer(vocab_size: int = 97):
    """A word-level tokenizer for a tiny model of ``vocab_size`` tokens (the tests' and benchmarks' tiny Llama: 97):
    w3 ... w{vocab_size - 1}, with <pad>=0, <s>=1, </s>=2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def token_rows(n: int = 16, length: int = 8, seed: int = 0, prompt: int = 2) -> list[dict]:
    """``n`` random token sequences (ids 3 to 79) as training rows of a tiny model, the first ``prompt`` positions
    unlabelled (-100)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, 80, (length,), generator=g)
        labels = ids.clone()
        labels[:prompt] = -100
        rows.append({"input_ids": ids, "attention_mask": torch.ones(length, dtype=torch.long), "labels": labels})
    return rows
