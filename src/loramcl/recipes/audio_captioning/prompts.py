"""Audio captioning prompts and labels through an audio-language model's own processor (Qwen2-Audio's).

The processor builds the prompt and expands its one audio placeholder into as many audio tokens as the encoder
gives for the clip (``Qwen2AudioProcessor``: from the feature attention mask), so the text side always matches the
audio features. Two prompt formats:

- chat (default, for an Instruct checkpoint): one user turn holding the audio and the instruction, rendered with the
  processor's chat template, then the assistant turn: ``... <|im_start|>assistant\\n<caption><|im_end|>``;
- raw (the paper's, App. H.1, for the base checkpoint): ``<|audio_bos|><|AUDIO|><|audio_eos|>Generate the caption
  in English: <caption><eos>``. The space before the caption belongs to the target: byte-level BPE tokenizers
  (Qwen2's) would otherwise merge the instruction's last character with the caption's first word, and the prompt
  alone would not tokenize as it does before the caption.

Training labels are -100 everywhere but on the caption and the end token that closes it (the chat template's end of
turn, or the tokenizer's end-of-sequence token for the raw prompt): the loss starts at the first caption token and
includes the end token, as in the paper.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_INSTRUCTION = "Generate the caption in English:"
_MARK = "\x00caption\x00"  # stands for the caption when the chat template's end of turn is read


class CaptionEncoder:
    """Encodes (audio, caption) training rows and audio-only generation batches with ``processor``.

    chat_template: use the processor's chat template (an error if it has none); False: the raw prompt.
    instruction: the text after the audio.
    sampling_rate: of the waveforms given (the feature extractor's, 16 kHz for Qwen2-Audio).
    """

    def __init__(self, processor, chat_template: bool = True, instruction: str = DEFAULT_INSTRUCTION,
                 sampling_rate: int = 16_000) -> None:
        if not isinstance(instruction, str):
            raise TypeError(f"instruction must be a string, got {instruction!r}")
        self.processor, self.tokenizer = processor, getattr(processor, "tokenizer", None)
        if self.tokenizer is None or not hasattr(processor, "feature_extractor"):
            raise TypeError(f"{type(processor).__name__} is not an audio processor (a tokenizer and a feature "
                            "extractor, e.g. Qwen2AudioProcessor)")
        self.audio_token = getattr(processor, "audio_token", None)
        if self.audio_token is None:
            raise TypeError(f"{type(processor).__name__} names no audio token (processor.audio_token)")
        self.chat_template, self.instruction, self.sampling_rate = chat_template, instruction, sampling_rate
        if chat_template:
            if not getattr(processor, "chat_template", None):
                raise ValueError(f"{type(processor).__name__} has no chat template: set chat_template: false for the "
                                 "raw prompt")
            self.prompt = self._render(add_generation_prompt=True)
            turn = self._render(add_generation_prompt=False, answer=_MARK)
            if not turn.startswith(self.prompt) or _MARK not in turn:
                raise ValueError("the chat template does not render the assistant's answer after the generation "
                                 "prompt: set chat_template: false for the raw prompt")
            self.end = turn[turn.index(_MARK) + len(_MARK):].rstrip()  # Qwen: "<|im_end|>" (the "\n" is not learnt)
        else:
            bos = getattr(processor, "audio_bos_token", None) or ""
            eos = getattr(processor, "audio_eos_token", None) or ""
            self.prompt = f"{bos}{self.audio_token}{eos}{instruction}"
            self.end = self.tokenizer.eos_token
        self.separator = "" if chat_template else " "  # between prompt and caption, part of the target
        if not self.end:
            raise ValueError("no end token closes the caption (the tokenizer has no eos_token): the model could never "
                             "learn to stop")
        self.audio_token_id = self.tokenizer.convert_tokens_to_ids(self.audio_token)

    def _render(self, add_generation_prompt: bool, answer: str | None = None) -> str:
        messages = [{"role": "user", "content": [{"type": "audio", "audio_url": "clip"},
                                                 {"type": "text", "text": self.instruction}]}]
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
        return self.processor.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)

    def encode(self, waveform, caption: str) -> dict:
        """A training row: input_ids and labels (lists; labels only on the caption and its end token),
        input_features [n_mels, frames] and feature_attention_mask [frames] (tensors)."""
        if not isinstance(caption, str) or not caption.strip():
            raise ValueError(f"a caption must be a non-empty string, got {caption!r}")
        full = self.processor(text=self.prompt + self.separator + caption + self.end, audio=[waveform],
                              sampling_rate=self.sampling_rate, return_tensors="pt")
        ids = full["input_ids"][0].tolist()
        audio_tokens = ids.count(self.audio_token_id)  # as the processor expanded the placeholder for this clip
        prompt = self.tokenizer(self.prompt.replace(self.audio_token, self.audio_token * audio_tokens),
                                add_special_tokens=False)["input_ids"]
        if ids[:len(prompt)] != prompt or len(ids) <= len(prompt):
            raise ValueError(f"the prompt's tokens are not a prefix of prompt + caption (the tokenizer merges across "
                             f"their boundary) for caption {caption!r}: change the end of the instruction")
        return {"input_ids": ids, "labels": [-100] * len(prompt) + ids[len(prompt):],
                "input_features": full["input_features"][0],  # [n_mels, frames]
                "feature_attention_mask": full["feature_attention_mask"][0]}  # [frames]

    def generation_batch(self, waveforms: Sequence) -> dict:
        """Left-padded prompts and their audio features for ``generate``: input_ids, attention_mask
        [B, T], input_features [B, n_mels, frames], feature_attention_mask [B, frames]."""
        side = self.tokenizer.padding_side
        self.tokenizer.padding_side = "left"
        try:
            batch = self.processor(text=[self.prompt] * len(waveforms), audio=list(waveforms),
                                   sampling_rate=self.sampling_rate, return_tensors="pt", padding=True)
        finally:
            self.tokenizer.padding_side = side
        return dict(batch)


def collate_audio(rows: list[dict], pad_token_id: int) -> dict:
    """A training batch: the text right-padded as ``prompts.collate`` pads it, the audio features stacked (the
    processor pads every clip's features to the same number of frames)."""
    import torch

    from loramcl.data.prompts import collate

    batch = collate(rows, pad_token_id)
    batch["input_features"] = torch.stack([r["input_features"] for r in rows])  # [B, n_mels, frames]
    batch["feature_attention_mask"] = torch.stack([r["feature_attention_mask"] for r in rows])  # [B, frames]
    return batch
