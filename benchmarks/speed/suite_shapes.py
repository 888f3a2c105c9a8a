"""The shapes the benchmark suite measures (benchmarks/speed/suite.py) and their frozen base: a named model shape (a
transformers config with random weights, built directly on its device in its dtype, or on the meta device for its
shapes alone), the request checks that refuse a run whose numbers would mean nothing, and ``Suite``: the shape's base
built once, wrapped as many times as the measurements need (twins sharing its weights), with its batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from benchmarks.common import TARGETS, build_model, perturb_adapters, twin
from loramcl import MCLConfig, get_mcl_model

AUDIO_TARGETS = [*TARGETS, "fc1", "fc2"]  # the paper's: the audio encoder's layers too (q, k, v, fc1, fc2)


@dataclass(frozen=True)
class Shape:
    """A named model shape and the lengths it is measured at."""

    name: str
    family: str  # "llama" or "qwen2_audio"
    config: dict  # the LlamaConfig's, or the Qwen2AudioConfig's (audio_config, text_config)
    seqs: tuple[int, ...]  # training-step lengths in tokens (after the audio tokens); labels on the last 3/4
    batch: int
    context_target: tuple[int, int]  # the context-once step: a context then a target (labels on the target only)
    prompt: int  # decoding: prompt tokens (after the audio tokens), batch 1
    new_tokens: int
    gpu: bool  # built for a GPU: refused on the CPU unless asked for explicitly
    audio_frames: int = 0  # qwen2_audio: mel frames of the clip (4 frames per audio token)
    note: str = ""

    @property
    def audio_tokens(self) -> int:
        # Qwen2-Audio's encoder: a stride-2 convolution, then pooling by 2
        return ((self.audio_frames - 1) // 2 + 1 - 2) // 2 + 1 if self.audio_frames else 0

    def build(self, device: str | torch.device, dtype: torch.dtype) -> torch.nn.Module:
        import transformers as tf

        if self.family == "llama":
            return build_model(tf.LlamaForCausalLM, tf.LlamaConfig(**self.config), device, dtype)
        return build_model(tf.Qwen2AudioForConditionalGeneration, tf.Qwen2AudioConfig(**self.config), device, dtype)


def _llama(layers, hidden, vocab, heads, kv_heads, intermediate, positions=4096, **extra) -> dict:
    return dict(num_hidden_layers=layers, hidden_size=hidden, vocab_size=vocab, num_attention_heads=heads,
                num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=positions,
                **extra)


def _qwen2_audio(audio: dict, text: dict, source_positions: int, mel_bins: int, audio_token: int) -> dict:
    return dict(audio_config=dict(audio, num_mel_bins=mel_bins, max_source_positions=source_positions),
                text_config=dict(model_type="qwen2", **text), audio_token_index=audio_token)


_LLAMA3 = dict(rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001)
SHAPES = {shape.name: shape for shape in [
    Shape("tiny", "llama", _llama(2, 64, 512, 4, 2, 128), seqs=(32,), batch=2, context_target=(32, 4), prompt=8,
          new_tokens=4, gpu=False, note="the test's shape: every measurement in seconds"),
    Shape("tiny-audio", "qwen2_audio", _qwen2_audio(
        dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64),
        _llama(2, 64, 512, 4, 2, 128), source_positions=50, mel_bins=16, audio_token=500),
        seqs=(16,), batch=2, context_target=(32, 4), prompt=4, new_tokens=4, gpu=False, audio_frames=100,
        note="the test's audio shape"),
    Shape("cpu-small", "llama", _llama(2, 576, 8192, 9, 3, 1536, positions=512), seqs=(64, 256), batch=2,
          context_target=(256, 32), prompt=32, new_tokens=16, gpu=False,
          note="a 2-layer Llama of SmolLM2-135M's width, vocabulary 8192"),
    Shape("smollm2-135m", "llama", _llama(30, 576, 49152, 9, 3, 1536, positions=2048, tie_word_embeddings=True),
          seqs=(256,), batch=2, context_target=(256, 32), prompt=32, new_tokens=32, gpu=False,
          note="SmolLM2-135M's config (134.5M parameters, vocabulary 49152): issue 40's peer measurement"),
    Shape("llama-1b", "llama", _llama(16, 2048, 128256, 32, 8, 8192, positions=8192, tie_word_embeddings=True,
                                      **_LLAMA3),
          seqs=(256, 2048), batch=1, context_target=(2048, 256), prompt=256, new_tokens=64, gpu=True,
          note="Llama-3.2-1B's config (1.24B parameters)"),
    Shape("llama-8b", "llama", _llama(32, 4096, 128256, 32, 8, 14336, positions=8192, **_LLAMA3),
          seqs=(256, 1024), batch=1, context_target=(1024, 128), prompt=256, new_tokens=64, gpu=True,
          note="Llama-3.1-8B's config (8.0B parameters)"),
    Shape("qwen2-audio", "qwen2_audio", _qwen2_audio(
        dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120),
        _llama(32, 4096, 156032, 32, 32, 11008, positions=8192), source_positions=1500, mel_bins=128,
        audio_token=151646),
        seqs=(64,), batch=1, context_target=(256, 32), prompt=16, new_tokens=32, gpu=True, audio_frames=1000,
        note="Qwen2-Audio-7B's config (8.4B parameters), a 10 s clip (250 audio tokens)"),
]}


def check_request(shape: Shape, device: str, dtype: str, allow_cpu: bool) -> None:
    """Refuse a run whose numbers would mean nothing, saying what to change."""
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"--dtype {dtype} is not a torch dtype (float32, bfloat16, float16)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible here; run on a GPU machine or use --device cpu")
    if device == "cpu" and shape.gpu and not allow_cpu:
        raise ValueError(f"--shape {shape.name} is a GPU shape ({shape.note}): run it with --device cuda, choose "
                         f"a CPU shape ({', '.join(n for n, s in SHAPES.items() if not s.gpu)}), or pass "
                         "--allow-cpu to build it on the CPU anyway")
    if device == "cpu" and dtype != "float32":
        raise ValueError(f"--dtype {dtype} on the CPU times its slow CPU kernels, which say nothing about the GPU "
                         "run it stands for: use --dtype float32 on the CPU, bfloat16 with --device cuda")


@dataclass
class Suite:
    """The shape's frozen base on the device, wrapped as many times as the measurements need."""

    shape: Shape
    device: str
    dtype: torch.dtype
    base: torch.nn.Module = field(init=False)

    def __post_init__(self) -> None:
        torch.manual_seed(0)
        self.base = self.shape.build(self.device, self.dtype)

    def wrap(self, k: int, loss: str = "relaxed", adapt_context: bool = True):
        torch.manual_seed(0)  # the same adapters for every variant of a K
        targets = AUDIO_TARGETS if self.shape.family == "qwen2_audio" else TARGETS
        mcl = get_mcl_model(twin(self.base), MCLConfig(
            num_hypotheses=k, r=8, alpha=8, loss=loss, epsilon=0.05 if loss == "relaxed" and k > 1 else 0.0,
            target_modules=targets, adapt_context=adapt_context))
        perturb_adapters(mcl)
        optimizer = torch.optim.AdamW([p for p in mcl.parameters() if p.requires_grad], lr=1e-4)
        return mcl.train(), optimizer

    def batch(self, length: int, labelled: int, rows: int, seed: int = 1) -> dict:
        """``rows`` random sequences of ``length`` tokens (after the audio tokens) with labels on the last
        ``labelled`` positions."""
        g = torch.Generator().manual_seed(seed)
        config = self.base.config
        ids = torch.randint(3, getattr(config, "audio_token_index", config.get_text_config().vocab_size),
                            (rows, length), generator=g)  # never the audio token
        inputs = {}
        if self.shape.audio_frames:
            audio = config.audio_config
            ids = torch.cat([torch.full((rows, self.shape.audio_tokens), config.audio_token_index), ids], dim=1)
            frames = torch.zeros(rows, 2 * audio.max_source_positions, dtype=torch.long)  # padded to 30 s, as Whisper
            frames[:, : self.shape.audio_frames] = 1
            inputs = {"input_features": torch.randn(rows, audio.num_mel_bins, frames.shape[1], generator=g),
                      "feature_attention_mask": frames}
        labels = ids.clone()
        labels[:, : ids.shape[1] - labelled] = -100
        inputs |= {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
        return {name: value.to(self.device, self.dtype if value.is_floating_point() else None)
                for name, value in inputs.items()}
