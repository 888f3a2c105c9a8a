"""Prompt -> target pairs for a causal LM: tokenized as generation sees the prompt, labels only on the target.

The prompt is tokenized exactly as `loramcl generate` tokenizes it (the same text, the tokenizer's own special
tokens, or the chat template), the target follows without special tokens and ends with the end-of-sequence
token, so a fine-tuned model learns where to stop. Labels are -100 on the prompt and on padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loramcl.metrics.io import read_jsonl


def prompt_text(tokenizer, prompt: str, chat_template: bool) -> str:
    """The prompt as the model reads it: raw, or wrapped as one user message with the chat template."""
    if not chat_template:
        return prompt
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def encode_pairs(tokenizer, prompts: Sequence[str], targets: Sequence[str], chat_template: bool = False,
                 max_length: int | None = None) -> list[dict[str, list[int]]]:
    """One {input_ids, labels} per pair: prompt tokens (label -100), then target tokens + end-of-sequence.

    A pair longer than max_length is cut from the end of the target (the prompt is kept whole); a pair whose
    prompt alone reaches max_length raises.
    """
    if len(prompts) != len(targets):
        raise ValueError(f"{len(prompts)} prompts for {len(targets)} targets")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no end-of-sequence token: the target could never end")
    special = not chat_template  # the chat template writes its own special tokens
    prompt_ids = tokenizer([prompt_text(tokenizer, p, chat_template) for p in prompts],
                           add_special_tokens=special)["input_ids"]
    target_ids = tokenizer(list(targets), add_special_tokens=False)["input_ids"]
    rows = []
    for i, (p, t) in enumerate(zip(prompt_ids, target_ids, strict=True)):
        t = t + [tokenizer.eos_token_id]
        if max_length is not None and len(p) + len(t) > max_length:
            if len(p) >= max_length:
                raise ValueError(f"pair {i}: the prompt alone has {len(p)} tokens, max_length is {max_length}")
            t = t[:max_length - len(p)]
        rows.append({"input_ids": p + t, "labels": [-100] * len(p) + t})
    return rows


def read_pairs(path: str, prompt_key: str = "prompt", target_key: str = "target") -> tuple[list, list[str], list]:
    """(ids, prompts, targets) of a JSONL file; a target may be a string or a list of strings (references)."""
    records = read_jsonl(path, prompt_key, number_missing_ids=True)
    for item_id, record in records.items():
        if target_key not in record:
            raise ValueError(f'{path}: line with id {item_id!r} has no "{target_key}" field (the target text)')
        if not isinstance(record[prompt_key], str):
            raise ValueError(f'{path}: "{prompt_key}" must be a string (id {item_id!r})')
    return list(records), [r[prompt_key] for r in records.values()], [r[target_key] for r in records.values()]


class PairDataset(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict[str, list[int]]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.rows[i]


def pad_token_id(tokenizer) -> int:
    """The tokenizer's padding id, else its end-of-sequence id (padding is masked out either way)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def collate(rows: list[dict[str, list[int]]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch: input_ids with pad_token_id, labels with -100, attention_mask 0 on padding."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        labels[i, :n] = torch.tensor(r["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
