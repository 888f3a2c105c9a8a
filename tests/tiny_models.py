"""Tiny randomly initialised models of the real architecture classes, with a valid batch for each.

Every case gives (model, inputs, labels): labels are -100 on prompt, image and audio positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import transformers as tf

from loramcl.models.tiny import tiny_llava_next_config, tiny_llava_next_processor
from loramcl.models.tiny import token_rows, word_tokenizer  # noqa: F401  (the tests take them from here)

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

# Model classes the library was not written against (issue 12), each with the targets a user would pick: every
# linear layer, or the language model only where that is what exercises a harder input (Qwen2-VL's M-RoPE
# positions [3, B, T], Gemma3's dict of attention masks built from token_type_ids).
_LANGUAGE_MODEL = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
HELD_OUT = {name: Case(name, "all-linear", causal=causal) for name, causal in [
    ("mistral", True), ("qwen3", True), ("gemma2", True), ("gemma3", True), ("mixtral", True), ("opt", True),
    ("gpt_neox", True), ("gpt_bigcode", True), ("falcon", True), ("bloom", True), ("phi3", True),
    ("mt5", False), ("mbart", False), ("pegasus", False), ("whisper", False),
    ("blip2", True), ("paligemma", True), ("smolvlm", True), ("idefics3", True),
    ("qwen2_5_vl", True),  # adapters in the vision tower too, images of different sizes (variable patches)
]} | {
    "qwen2_vl": Case("qwen2_vl", _LANGUAGE_MODEL, expansion_module="model.language_model"),
    "gemma3_vlm": Case("gemma3_vlm", _LANGUAGE_MODEL, expansion_module="model.language_model"),
}
ARCHITECTURES = list(CASES)  # the families every test of the library runs on
CASES |= HELD_OUT


def _llama_text(**extra):
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, **extra)


def _vision(**extra):
    return dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, image_size=16,
                patch_size=4, **extra)


def _tokens(bos=1, eos=2, pad=0):
    return dict(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)


_ENCODER_DECODER = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=128)
_MROPE = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}  # sections of head_dim/2 = 4
VISION_START, VISION_END, VIDEO_TOKEN = 91, 92, 93
# Qwen2-VL: 2x2-pixel patches over 2 frames, 2x2 merged into one token: patch vectors of 3*2*2*2 values
QWEN_PATCH = 24


def _build_held_out(name: str) -> torch.nn.Module:
    text = _llama_text(**_tokens())
    builders = {
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**text)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**text, head_dim=8)),
        "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**text, head_dim=8)),
        "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**text, head_dim=8)),
        "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(**text, num_local_experts=4, num_experts_per_tok=2)),
        "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**text)),
        "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4,
            word_embed_proj_dim=32, max_position_embeddings=128, **_tokens())),
        "gpt_neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128, **_tokens())),
        "gpt_bigcode": lambda: tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, **_tokens())),
        "falcon": lambda: tf.FalconForCausalLM(tf.FalconConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **_tokens())),
        "bloom": lambda: tf.BloomForCausalLM(tf.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
                                                            **_tokens())),
        "mt5": lambda: tf.MT5ForConditionalGeneration(tf.MT5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, decoder_start_token_id=0,
            pad_token_id=0, eos_token_id=1)),
        "mbart": lambda: tf.MBartForConditionalGeneration(tf.MBartConfig(**_ENCODER_DECODER)),
        "pegasus": lambda: tf.PegasusForConditionalGeneration(tf.PegasusConfig(**_ENCODER_DECODER)),
        # 32 mel frames of 16 bins; no language/task tokens: a plain transcription decoder
        "whisper": lambda: tf.WhisperForConditionalGeneration(tf.WhisperConfig(
            vocab_size=VOCAB, num_mel_bins=16, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
            max_source_positions=16, max_target_positions=64, decoder_start_token_id=1, begin_suppress_tokens=None,
            suppress_tokens=None, **_tokens())),
        "blip2": lambda: tf.Blip2ForConditionalGeneration(tf.Blip2Config(
            vision_config=_vision(), num_query_tokens=4, image_token_index=IMAGE_TOKEN,
            qformer_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48,
                                encoder_hidden_size=32, vocab_size=VOCAB),
            text_config=dict(model_type="opt", vocab_size=VOCAB, hidden_size=32, ffn_dim=48, num_hidden_layers=2,
                             num_attention_heads=4, word_embed_proj_dim=32, **_tokens()))),
        "paligemma": lambda: tf.PaliGemmaForConditionalGeneration(tf.PaliGemmaConfig(
            vision_config=dict(model_type="siglip_vision_model", **_vision(), projection_dim=32),
            text_config=dict(model_type="gemma", **text, head_dim=8), image_token_index=IMAGE_TOKEN,
            projection_dim=32, hidden_size=32, vocab_size=VOCAB)),
        "smolvlm": lambda: tf.SmolVLMForConditionalGeneration(tf.SmolVLMConfig(
            vision_config=_vision(), text_config=dict(model_type="llama", **text), scale_factor=2,
            image_token_id=IMAGE_TOKEN)),
        "idefics3": lambda: tf.Idefics3ForConditionalGeneration(tf.Idefics3Config(
            vision_config=_vision(), text_config=dict(model_type="llama", **text), scale_factor=2,
            image_token_id=IMAGE_TOKEN)),
        "qwen2_vl": lambda: tf.Qwen2VLForConditionalGeneration(tf.Qwen2VLConfig(
            vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, patch_size=2,
                               spatial_merge_size=2, temporal_patch_size=2),
            text_config=dict(**text, rope_parameters=_MROPE), image_token_id=IMAGE_TOKEN,
            video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)),
        "qwen2_5_vl": lambda: tf.Qwen2_5_VLForConditionalGeneration(tf.Qwen2_5_VLConfig(
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=2,
                               spatial_merge_size=2, temporal_patch_size=2, window_size=8, out_hidden_size=32,
                               fullatt_block_indexes=[1]),
            text_config=dict(**text, rope_parameters=_MROPE), image_token_id=IMAGE_TOKEN,
            video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)),
        # 16 patches pooled into 4 tokens per image, between begin- and end-of-image tokens
        "gemma3_vlm": lambda: tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
            text_config=dict(**text, head_dim=8), vision_config=dict(model_type="siglip_vision_model", **_vision()),
            mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN, boi_token_index=VISION_START,
            eoi_token_index=VISION_END)),
    }
    return builders[name]()


def build_model(name: str) -> torch.nn.Module:
    if name in HELD_OUT:
        return _build_held_out(name)
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
    if name == "llava_next":  # the architecture `loramcl image-captioning`'s CPU recipe builds
        return tf.LlavaNextForConditionalGeneration(tiny_llava_next_config(VOCAB, IMAGE_TOKEN))
    raise KeyError(name)


def _qwen_vl_batch(tokens, g, batch: int) -> tuple[dict, torch.Tensor]:
    """Images of different sizes (4x4 and 4x8 patches: 4 and 8 tokens), left-padded prompts."""
    grids = torch.tensor([[1, 4, 4], [1, 4, 8]] * batch)[:batch]  # [n_images, 3]: frames, rows, columns
    counts = [int(grid.prod()) // 4 for grid in grids]
    width = max(counts) + 2
    prefix = torch.zeros(batch, width, dtype=torch.long)
    attention_mask = torch.ones(batch, width + 7, dtype=torch.long)
    for b, n in enumerate(counts):
        prefix[b, width - n - 2:] = torch.tensor([VISION_START] + [IMAGE_TOKEN] * n + [VISION_END])
        attention_mask[b, :width - n - 2] = 0
    input_ids = torch.cat([prefix, tokens(batch, 7)], dim=1)
    labels = input_ids.clone()
    labels[:, :width + 2] = -100
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask,
              "mm_token_type_ids": (input_ids == IMAGE_TOKEN).long(),  # 1 on image tokens (the processor's output)
              "pixel_values": torch.randn(int(grids.prod(-1).sum()), QWEN_PATCH, generator=g), "image_grid_thw": grids}
    return inputs, labels


def _image_batch(name: str, tokens, g, batch: int) -> tuple[dict, torch.Tensor]:
    """Image tokens, a 2-token prompt, then a 5-token target (the labels)."""
    image_tokens = {"blip2": 4, "paligemma": 16, "smolvlm": 4, "idefics3": 4, "gemma3_vlm": 4}[name]
    prefix = torch.full((batch, image_tokens), IMAGE_TOKEN)
    if name == "gemma3_vlm":
        prefix = torch.cat([torch.full((batch, 1), VISION_START), prefix, torch.full((batch, 1), VISION_END)], dim=1)
    input_ids = torch.cat([prefix, tokens(batch, 7)], dim=1)
    labels = input_ids.clone()
    labels[:, :prefix.shape[1] + 2] = -100
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if name in ("smolvlm", "idefics3"):  # one image per example
        inputs["pixel_values"] = torch.randn(batch, 1, 3, 16, 16, generator=g)
        inputs["pixel_attention_mask"] = torch.ones(batch, 1, 16, 16, dtype=torch.bool)
    else:
        inputs["pixel_values"] = torch.randn(batch, 3, 16, 16, generator=g)
    if name == "paligemma":  # prefix-LM: 0 on image and prompt, 1 on the target
        inputs["token_type_ids"] = (labels != -100).long()
    if name == "gemma3_vlm":  # 1 on image tokens: bidirectional attention inside each image
        inputs["token_type_ids"] = (input_ids == IMAGE_TOKEN).long()
    return inputs, labels


def build_batch(name: str, model: torch.nn.Module, batch: int = 2, generator: torch.Generator | None = None
                ) -> tuple[dict, torch.Tensor]:
    """A batch for ``model`` (built by ``build_model(name)``): (inputs, labels)."""
    g = generator or torch.Generator().manual_seed(0)

    def tokens(*shape):
        return torch.randint(3, 80, shape, generator=g)

    if name in ("qwen2_vl", "qwen2_5_vl"):
        return _qwen_vl_batch(tokens, g, batch)
    if name in ("blip2", "paligemma", "smolvlm", "idefics3", "gemma3_vlm"):
        return _image_batch(name, tokens, g, batch)
    if name == "whisper":  # labels only: the model derives its decoder inputs (as Whisper collators do)
        labels = tokens(batch, 5)
        labels[1:, -1] = -100
        return {"input_features": torch.randn(batch, 16, 32, generator=g)}, labels
    if name in ("t5", "bart", "marian", "mt5", "mbart", "pegasus"):
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




def save_tiny_run_inputs(root, examples: int = 16):
    """A tiny Llama (seed 0) and its word tokenizer in ``root/base``, and ``examples`` prompt/target rows of two
    words each in ``root/train.jsonl``: what a `loramcl train` test reads. Returns ``root``."""
    import json

    torch.manual_seed(0)
    build_model("llama").save_pretrained(root / "base")
    word_tokenizer().save_pretrained(root / "base")
    rows = [{"prompt": f"w{5 + i % 7} w{20 + i % 5}", "target": f"w{40 + i % 3} w{60 + i % 4}"}
            for i in range(examples)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root




# Caption words of the tiny LLaVA-NeXT processor (the chat template's words come with it).
CAPTION_WORDS = ("sign that says stop red blue green bottle of beer on table book called cover black white man woman "
                 "holding phone screen shows number street store front open close car license plate reads label brand "
                 "name coffee cup wall clock time is in at near two three big small yellow written text shirt poster"
                 ).split()


def llava_next_processor():
    """The LlavaNextProcessor of ``build_model('llava_next')`` (``pretrained.tiny_llava_next_processor``): its
    '<image>' is the model's image token."""
    return tiny_llava_next_processor(CAPTION_WORDS, image_token_id=IMAGE_TOKEN)


def uneven_batch(inputs: dict, labels: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """Rows with contexts of different lengths, one left-padded and one right-padded: labels from position 5 in
    row 0; row 1 padded on the left (2), labelled from 4 and right-padded (the base batch's last 2)."""
    labels = labels.clone()
    labels[0, :5] = -100
    mask = inputs["attention_mask"].clone()
    mask[1, :2] = 0
    labels[1, :4] = -100
    return {**inputs, "attention_mask": mask}, labels
