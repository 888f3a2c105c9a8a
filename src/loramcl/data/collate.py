"""Batches as MCLTrainer trains on them: rows of text tokenized (``tokenized``), every example checked to have a
target (``check_targets``) and rows of different lengths padded (``PadExamples``, with the id ``padding_id`` finds)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import default_data_collator

from loramcl.data.formats import check_packing, prepare_dataset
from loramcl.mcl.nll import IGNORE_INDEX, examples_without_targets


class PadExamples:
    """The collator of an MCLTrainer given none: rows of one length are collated by transformers'
    ``default_data_collator``; rows of different lengths are right-padded, each field to its own longest row (as
    ``loramcl train`` pads): token ids with ``pad_token_id``, masks with 0 (made from the lengths where rows have
    none), labels with -100, so padding is never attended to nor predicted (any id in the vocabulary would do).
    Other fields go to ``default_data_collator``."""

    def __init__(self, pad_token_id: int | None) -> None:
        self.pad_token_id = pad_token_id
        self.padded = {"input_ids": pad_token_id, "attention_mask": 0, "labels": IGNORE_INDEX,
                       "decoder_input_ids": pad_token_id, "decoder_attention_mask": 0}

    def __call__(self, rows: list[dict]) -> dict:
        sequences = {name: [torch.as_tensor(row[name]) for row in rows] for name in self.padded if name in rows[0]}
        lengths = {name: {len(value) for value in values} for name, values in sequences.items()}
        if all(len(found) == 1 for found in lengths.values()):
            return default_data_collator(rows)
        for name in ("input_ids", "decoder_input_ids"):
            if self.pad_token_id is None and len(lengths.get(name, ())) > 1:
                raise ValueError(f"the rows of a batch have {name} of different lengths ({min(lengths[name])} to "
                                 f"{max(lengths[name])} tokens) and no padding id is known: give MCLTrainer the "
                                 "tokenizer (processing_class=tokenizer), set the model's config.pad_token_id, or "
                                 "pass a data_collator")
        if "attention_mask" not in sequences and "input_ids" in sequences:
            sequences["attention_mask"] = [torch.ones_like(ids) for ids in sequences["input_ids"]]
        batch = {name: nn.utils.rnn.pad_sequence(values, batch_first=True, padding_value=self.padded[name] or 0)
                 for name, values in sequences.items()}  # [B, longest row of that field]
        rest = [{name: value for name, value in row.items() if name not in self.padded} for row in rows]
        return {**(default_data_collator(rest) if rest[0] else {}), **batch}


def padding_id(processing_class, model: nn.Module) -> int | None:
    """The id that pads token rows: the tokenizer's padding (else end-of-sequence) id, else the model config's."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)  # a processor holds its tokenizer
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else None
    for source in (tokenizer, config, text_config):
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(source, name, None)
            value = value[0] if isinstance(value, list) and value else value
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def tokenized(dataset, processing_class, args, model: nn.Module, name: str):
    """``dataset`` as MCLTrainer trains on it: a ``datasets.Dataset`` of rows in one of TRL's formats (no
    ``input_ids``) prepared by ``prepare_dataset`` with the tokenizer (``args.max_length`` where the training
    arguments have one, as SFTConfig's); any other dataset as given. Packing (SFTConfig's) is refused."""
    check_packing(getattr(args, "packing", False))
    if isinstance(dataset, dict):
        return {key: tokenized(value, processing_class, args, model, f"{name}[{key!r}]")
                for key, value in dataset.items()}
    columns = getattr(dataset, "column_names", None)
    if not isinstance(columns, list) or "input_ids" in columns:
        return dataset
    if processing_class is None:
        raise ValueError(f"{name} holds rows of text (fields {', '.join(columns[:6])}) and MCLTrainer has no "
                         "tokenizer to prepare them: pass processing_class=tokenizer, or tokenized rows")
    tokenizer = getattr(processing_class, "tokenizer", processing_class)  # a processor holds its tokenizer
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    return prepare_dataset(dataset, tokenizer, getattr(args, "max_length", None), encoder_decoder=encoder_decoder,
                           source=name).select_columns(["input_ids", "labels"])


def check_targets(dataset, name: str, causal: bool) -> None:
    """Every example needs a target token (its mean NLL is 0/0 otherwise): checked on the whole dataset before
    training, so that the error names dataset indices instead of a position in some later batch."""
    empty = examples_without_targets(dataset, causal)
    if empty:
        shown = ", ".join(map(str, empty[:10])) + (f" ... ({len(empty)} in all)" if len(empty) > 10 else "")
        raise ValueError(f"{name} examples {shown} have no label token (every label is {IGNORE_INDEX} after the "
                         "causal shift), so their NLL is undefined: keep at least one target token per example "
                         "(e.g. truncate the prompt, not the target), or drop them")
