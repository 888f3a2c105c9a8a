"""Tiny randomly initialised models of the real architecture classes, with a valid batch for each.

Every case gives (model, inputs, labels): labels are -100 on prompt, image and audio positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import transformers as tf

VOCAB = 97
IMAGE_TOKEN = AUDIO_TOKEN = 90  # inside the vocabulary, never drawn as an ordinary token (< 80)


@dataclass
class Case:
    name: str
    targets: list[str] | str
    causal: bool = True
    # regex restricting adapters to the language model of a multimodal model (None for text models)
    language_model_targets: str | None = None
    expansion_module: str = ""  # where the K copies are made with `targets`
    kwargs: dict = field(default_factory=dict)


CASES = {
    "gpt2": Case("gpt2", ["c_attn", "c_proj", "c_fc"], expansion_module="transformer"),
    "gpt_neo": Case("gpt_neo", ["q_proj", "k_proj", "v_proj", "out_proj"], expansion_module="transformer"),
    "llama": Case("llama", ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"], expansion_module="model"),
    "qwen2": Case("qwen2", ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"], expansion_module="model"),
    "t5": Case("t5", ["q", "k", "v", "o", "wi", "wo"], causal=False),
    "bart": Case("bart", ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"], causal=False,
                 expansion_module="model"),
    "marian": Case("marian", ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"], causal=False,
                   expansion_module="model"),
    # as in the paper: adapters in the audio encoder and in the language model
    "qwen2_audio": Case("qwen2_audio", ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj", "fc1", "fc2"],
                        language_model_targets=r".*language_model.*\.(q_proj|k_proj|v_proj|up_proj|down_proj)",
                        expansion_module="model"),
    # as in the paper: adapters in the language model only
    "llava_next": Case("llava_next", r".*language_model.*\.(q_proj|k_proj|v_proj|up_proj|down_proj)",
                       language_model_targets=r".*language_model.*\.(q_proj|k_proj|v_proj|up_proj|down_proj)",
                       expansion_module="model.language_model"),
}


def _llama_text(**extra):
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, **extra)


def build_model(name: str) -> torch.nn.Module:
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                                bos_token_id=1, eos_token_id=2))
    if name == "gpt_neo":  # local attention with a window of 5, as in the paper's Markov model
        return tf.GPTNeoForCausalLM(tf.GPTNeoConfig(
            vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]],
            window_size=5, max_position_embeddings=128, bos_token_id=1, eos_token_id=2))
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**_llama_text()))
    if name == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**_llama_text()))
    if name == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, decoder_start_token_id=0,
            pad_token_id=0, eos_token_id=1))
    if name in ("bart", "marian"):
        common = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=128)
        if name == "bart":
            return tf.BartForConditionalGeneration(tf.BartConfig(**common))
        return tf.MarianMTModel(tf.MarianConfig(**common, decoder_start_token_id=96, pad_token_id=96, eos_token_id=0))
    if name == "qwen2_audio":
        return tf.Qwen2AudioForConditionalGeneration(tf.Qwen2AudioConfig(
            audio_config=dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=48,
                              num_mel_bins=16, max_source_positions=50),
            text_config=dict(model_type="qwen2", **_llama_text()), audio_token_index=AUDIO_TOKEN))
    if name == "llava_next":
        return tf.LlavaNextForConditionalGeneration(tf.LlavaNextConfig(
            vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48,
                               num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4,
                               projection_dim=32),
            text_config=dict(model_type="llama", **_llama_text()), image_token_index=IMAGE_TOKEN,
            image_grid_pinpoints=[[16, 16], [16, 32]], vision_feature_layer=-1))
    raise KeyError(name)


def build_batch(name: str, model: torch.nn.Module, batch: int = 2, generator: torch.Generator | None = None
                ) -> tuple[dict, torch.Tensor]:
    """A batch for ``model`` (built by ``build_model(name)``): (inputs, labels)."""
    g = generator or torch.Generator().manual_seed(0)

    def tokens(*shape):
        return torch.randint(3, 80, shape, generator=g)

    if name in ("t5", "bart", "marian"):
        input_ids = tokens(batch, 7)
        attention_mask = torch.ones_like(input_ids)
        attention_mask[1:, -2:] = 0  # padding in the source
        labels = tokens(batch, 5)
        labels[1:, -1] = -100  # padding in the target
        return {"input_ids": input_ids, "attention_mask": attention_mask}, labels
    if name == "qwen2_audio":
        # 100 mel frames -> 25 audio tokens after the encoder's stride-2 conv and pooling
        prompt = torch.cat([torch.full((batch, 25), AUDIO_TOKEN), tokens(batch, 3)], dim=1)
        input_ids = torch.cat([prompt, tokens(batch, 5)], dim=1)
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                  "input_features": torch.randn(batch, 16, 100, generator=g),
                  "feature_attention_mask": torch.ones(batch, 100, dtype=torch.long)}
        labels = input_ids.clone()
        labels[:, :prompt.shape[1]] = -100
        return inputs, labels
    if name == "llava_next":
        sizes = torch.tensor([[16, 16], [16, 32]] * batch)[:batch]
        pixel_values = torch.randn(batch, 3, 3, 16, 16, generator=g)  # 3 anyres patches per image
        with torch.no_grad():
            features = model.model.get_image_features(pixel_values=pixel_values, image_sizes=sizes).pooler_output
        image_tokens = [f.shape[0] for f in features]
        length = max(image_tokens) + 8
        input_ids = tokens(batch, length)
        labels = input_ids.clone()
        for b, n in enumerate(image_tokens):  # image tokens, then text; the text after them is the target
            input_ids[b, :n] = IMAGE_TOKEN
            labels[b, :n + 2] = -100
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "pixel_values": pixel_values,
                "image_sizes": sizes}, labels
    input_ids = tokens(batch, 9)
    attention_mask = torch.ones_like(input_ids)
    labels = input_ids.clone()
    labels[:, :3] = -100  # prompt
    attention_mask[1:, -2:] = 0  # right padding
    labels[1:, -2:] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask}, labels


def word_tokenizer():
    """A word-level tokenizer over the tiny models' vocabulary: w3 ... w96, with <pad>=0, <s>=1, </s>=2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
