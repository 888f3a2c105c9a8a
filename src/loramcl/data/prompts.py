"""Prompt -> target pairs, tokenized as generation sees the prompt, labels only on the target.

A causal LM reads prompt + target as one sequence: the prompt is tokenized exactly as `loramcl generate` tokenizes
it (the same text, the tokenizer's own special tokens, or the chat template), the target follows without special
tokens and ends with the end-of-sequence token, so a fine-tuned model learns where to stop; labels are -100 on the
prompt and on padding. An encoder-decoder (T5, BART, Marian, NLLB) reads the prompt alone in its encoder, as
`loramcl generate` gives it, and the target, with the tokenizer's target special tokens, is the labels (the model
derives its decoder inputs from them).

torch loads inside `collate` only, so that a command reads and checks its files before importing it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from loramcl.utils.files import read_jsonl
from loramcl.utils.inputs import PositionLimits, record_line


def prompt_text(tokenizer, prompt: str | list[dict], chat_template: bool) -> str:
    """The prompt as the model reads it: raw, or wrapped as one user message with the chat template; a conversation
    (a list of messages) rendered by the chat template. Either way with the generation prompt, as training renders
    the turns before an answer (``loramcl.data.formats``)."""
    if isinstance(prompt, list):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the prompts are conversations but the tokenizer has no chat template: give a tokenizer "
                             "that has one (--tokenizer), or prompts of text")
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    if not chat_template:
        return prompt
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def encode_pairs(tokenizer, prompts: Sequence[str], targets: Sequence[str], chat_template: bool = False,
                 max_length: int | None = None, encoder_decoder: bool = False,
                 where: Callable[[int], str] = "pair {}".format) -> list[dict[str, list[int]]]:
    """One {input_ids, labels} per pair.

    Causal LM: input_ids = prompt tokens + target tokens + end-of-sequence, labels -100 on the prompt. A pair longer
    than max_length is cut from the end of the target (the prompt is kept whole); a pair whose prompt alone reaches
    max_length raises.

    Encoder-decoder (``encoder_decoder=True``): input_ids = the prompt tokens only (the encoder input), labels = the
    target as the tokenizer encodes a target (``text_target``: its own special tokens, e.g. NLLB's language code),
    with end-of-sequence appended if the tokenizer adds none; each side at most max_length tokens (a longer
    prompt raises, a longer target loses its end).

    ``where(i)`` names pair i in the errors (e.g. its file and line).
    """
    if len(prompts) != len(targets):
        raise ValueError(f"{len(prompts)} prompts for {len(targets)} targets")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no end-of-sequence token: the target could never end")
    special = not chat_template  # the chat template writes its own special tokens
    prompt_ids = tokenizer([prompt_text(tokenizer, p, chat_template) for p in prompts],
                           add_special_tokens=special)["input_ids"]
    if encoder_decoder:
        target_ids = tokenizer(text_target=list(targets))["input_ids"]
    else:
        target_ids = tokenizer(list(targets), add_special_tokens=False)["input_ids"]
    rows = []
    for i, (p, t) in enumerate(zip(prompt_ids, target_ids, strict=True)):
        if encoder_decoder:
            if not t or eos not in t[-2:]:  # the end token, possibly followed by a language code (mBART)
                t = t + [eos]
            if max_length is not None and len(p) > max_length:
                raise ValueError(f"{where(i)}: the prompt has {len(p)} tokens, max_length is {max_length}: shorten "
                                 "it, or raise max_length")
            rows.append({"input_ids": p, "labels": t[:max_length]})
            continue
        t = t + [eos]
        if max_length is not None and len(p) + len(t) > max_length:
            if len(p) >= max_length:
                raise ValueError(f"{where(i)}: the prompt alone has {len(p)} tokens, max_length is {max_length} (and "
                                 "the target needs one more): shorten it, or raise max_length")
            t = t[:max_length - len(p)]
        rows.append({"input_ids": p + t, "labels": [-100] * len(p) + t})
    return rows


def read_pairs(path: str, prompt_key: str = "prompt", target_key: str = "target", what: str = "",
               ) -> tuple[list, list[str], list]:
    """(ids, prompts, targets) of a JSONL file; a target may be a string or a list of strings (references).

    what: the options naming the two fields, for the errors (e.g. "--data.prompt_key / --data.target_key").
    """
    hint = f" (choose the fields with {what})" if what else ""
    records = read_jsonl(path, prompt_key, number_missing_ids=True, hint=hint)
    for number, (item_id, record) in enumerate(records.items(), start=1):
        if target_key not in record:
            has = ", ".join(f'"{key}"' for key in list(record)[:10] if key != "id")
            raise ValueError(f'{path}: record {number} (id {item_id!r}) has no "{target_key}" field; its fields are '
                             f"{has}{hint}")
        if not isinstance(record[prompt_key], str):
            raise ValueError(f'{path}: "{prompt_key}" must be a string (id {item_id!r})')
        if not record[prompt_key].strip():
            raise ValueError(f'{path}:{record_line(path, number - 1)}: "{prompt_key}" is empty: a model continues a '
                             "prompt, give it some text (or remove the line)")
    return list(records), [r[prompt_key] for r in records.values()], [r[target_key] for r in records.values()]


def first_too_long(rows: Sequence[dict[str, list[int]]], limits: PositionLimits,
                   encoder_decoder: bool = False) -> tuple[int, str] | None:
    """(index, what does not fit) of the first pair of ``encode_pairs`` whose tokens the model's positions
    (``loramcl.utils.inputs.model_positions``) cannot hold; None when all fit."""
    for i, row in enumerate(rows):
        prompt = len(row["input_ids"]) if encoder_decoder else sum(label == -100 for label in row["labels"])
        target = len(row["labels"]) if encoder_decoder else len(row["input_ids"]) - prompt
        if (excess := limits.excess(prompt, target)) is not None:
            return i, excess
    return None


def pad_token_id(tokenizer) -> int:
    """The tokenizer's padding id, else its end-of-sequence id (padding is masked out either way)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def collate(rows: list[dict[str, list[int]]], pad_token_id: int) -> dict:
    """Right-pad a batch: input_ids with pad_token_id (attention_mask 0 there), labels with -100, each to its own
    longest row (an encoder-decoder's labels are not as long as its input_ids)."""
    import torch

    width = max(len(r["input_ids"]) for r in rows)
    label_width = max(len(r["labels"]) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), label_width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        labels[i, :len(r["labels"])] = torch.tensor(r["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
