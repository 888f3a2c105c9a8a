"""Image captioning through a vision-language model's own processor (paper §4.3, App. H.2: LLaVA-1.6 on TextCaps).

The prompt is the model's conversation, written by its processor's chat template: one user turn holding the image
and the instruction (by default the one of the paper's reference code, a Vicuna-v1 conversation), then the
assistant's turn. The processor expands the image placeholder into the image's tokens (their number depends on the
image's size with LLaVA-NeXT's anyres); the caption follows as the assistant's reply, and the labels are the
caption's tokens and the end-of-sequence token only (-100 on the prompt, the image tokens and padding).

torch and PIL load inside the functions.
"""

from __future__ import annotations

from collections.abc import Sequence

from loramcl.recipes.image_captioning.textcaps import CaptionImage, load_image

IGNORE_INDEX = -100  # the label of positions nothing is predicted at (as scoring.IGNORE_INDEX; no torch here)

DEFAULT_INSTRUCTION = "Please carefully observe the image and come up with a caption for the image."


def conversation(instruction: str, caption: str | None = None) -> list[dict]:
    """The messages of one example: the user's image and instruction, then (for training) the assistant's caption."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": instruction}]}]
    if caption is not None:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": caption}]})
    return messages


def caption_prompt(processor, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """The prompt text decoding continues: the conversation up to the start of the assistant's reply."""
    if getattr(processor, "chat_template", None) is None:
        raise ValueError(f"{type(processor).__name__} has no chat template: the conversation of a captioning example "
                         "is written by the model's chat template (set processor.chat_template)")
    return processor.apply_chat_template(conversation(instruction), add_generation_prompt=True)


class CaptionEncoder:
    """(image, caption) -> one training row {input_ids, labels, pixel_values, image_sizes}, as the processor reads it.

    input_ids: the prompt as ``processor(images=[image], text=[prompt])`` gives it (image tokens expanded), then the
    reply's tokens: the text the chat template writes after the prompt for this caption, cut after its first
    end-of-sequence token (appended if the template writes none). labels: -100 on the prompt, the reply's tokens
    after. A reply longer than ``max_length`` tokens (EOS included) loses its end.
    """

    def __init__(self, processor, instruction: str = DEFAULT_INSTRUCTION, max_length: int = 64) -> None:
        if not isinstance(instruction, str) or not instruction.strip():
            raise ValueError(f"instruction must be a non-empty string, got {instruction!r}")
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"max_length must be an integer >= 2, got {max_length!r}")
        self.processor, self.instruction, self.max_length = processor, instruction, max_length
        self.tokenizer = getattr(processor, "tokenizer", None)
        if self.tokenizer is None or self.tokenizer.eos_token_id is None:
            raise ValueError("the processor needs a tokenizer with an end-of-sequence token (captions must end)")
        self.prompt = caption_prompt(processor, instruction)
        self._prompt_text_ids = self.tokenizer(self.prompt)["input_ids"]

    def reply_ids(self, caption: str) -> list[int]:
        """The caption's tokens as they follow the prompt in the conversation, ending with end-of-sequence."""
        eos = self.tokenizer.eos_token_id
        full = self.processor.apply_chat_template(conversation(self.instruction, caption))
        if not full.startswith(self.prompt):  # a template whose reply does not extend the generation prompt
            full = f"{self.prompt} {caption}"
        ids = self.tokenizer(full)["input_ids"]
        if ids[:len(self._prompt_text_ids)] != self._prompt_text_ids:
            raise ValueError(f"the tokenizer reads the prompt differently once the caption {caption!r} follows it: "
                             "end the chat template's generation prompt where a new token starts")
        reply = ids[len(self._prompt_text_ids):]
        reply = reply[:reply.index(eos) + 1] if eos in reply else [*reply, eos]  # caption + EOS, nothing after
        if len(reply) < 2:
            raise ValueError(f"caption {caption!r} has no tokens")
        return reply[:self.max_length]

    def __call__(self, image: CaptionImage, caption: str) -> dict:
        picture = load_image(image.image_path, f"image {image.image_id!r}")
        prompt = self.processor(images=[picture], text=[self.prompt], return_tensors="pt")
        prompt_ids = prompt["input_ids"][0].tolist()
        reply = self.reply_ids(caption)
        row = {"input_ids": prompt_ids + reply, "labels": [IGNORE_INDEX] * len(prompt_ids) + reply}
        row |= {name: value[0] for name, value in prompt.items() if name not in ("input_ids", "attention_mask")}
        return row


def collate_captions(rows: Sequence[dict], pad_token_id: int) -> dict:
    """A training batch: input_ids right-padded with ``pad_token_id`` (attention_mask 0 there), labels with -100,
    image tensors stacked; LLaVA-NeXT's pixel_values [patches, C, H, W] padded with zeros to the batch's most
    patches (the model reads each image's own patches from its image_sizes, as the processor pads them)."""
    import torch

    width = max(len(r["input_ids"]) for r in rows)
    batch = {"input_ids": torch.full((len(rows), width), pad_token_id, dtype=torch.long),
             "attention_mask": torch.zeros((len(rows), width), dtype=torch.long),
             "labels": torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)}
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        batch["input_ids"][i, :n] = torch.tensor(r["input_ids"])
        batch["labels"][i, :n] = torch.tensor(r["labels"])
        batch["attention_mask"][i, :n] = 1
    for name in rows[0]:
        if name in batch:
            continue
        values = [torch.as_tensor(r[name]) for r in rows]
        most = max(v.shape[0] for v in values) if values[0].dim() else 0
        if values[0].dim() and any(v.shape[0] != most for v in values):
            values = [torch.cat([v, v.new_zeros(most - v.shape[0], *v.shape[1:])]) for v in values]
        batch[name] = torch.stack(values)
    return batch


def decoding_batch(processor, images: Sequence[CaptionImage], instruction: str = DEFAULT_INSTRUCTION) -> dict:
    """The inputs of generation for ``images``: the prompt of each, left-padded (decoding continues the last
    position), images processed together."""
    pictures = [load_image(image.image_path, f"image {image.image_id!r}") for image in images]
    prompt = caption_prompt(processor, instruction)
    return dict(processor(images=pictures, text=[prompt] * len(pictures), padding=True, padding_side="left",
                          return_tensors="pt"))


__all__ = ["DEFAULT_INSTRUCTION", "CaptionEncoder", "caption_prompt", "collate_captions", "conversation",
           "decoding_batch"]
