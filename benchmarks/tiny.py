"""The tiny Llama of the checks and studies, its word-level tokenizer and token rows: one builder, changed by keyword
where a script needs another size.

Its default is the tests' tiny Llama (tests/tiny_models.py's ``build_model("llama")``: 2 layers, width 32, vocabulary
97, random weights), with the same word tokenizer (w3 ... w96) and token rows, so that a benchmark and a test built from
the same seed hold the same weights. The tests keep their own copy: their helper scripts run in processes (torchrun,
a killed checkpoint writer) that only see tests/ on their path.
"""

from __future__ import annotations

import torch

VOCAB = 97


def tiny_llama_config(**changes):
    """The tiny Llama's ``LlamaConfig``; ``changes`` override its fields (``hidden_size=64``, ``vocab_size=128``...)."""
    from transformers import LlamaConfig

    return LlamaConfig(**(dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128) | changes))


def tiny_llama(**changes) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` of ``tiny_llama_config(**changes)`` with random weights (torch's current seed)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(tiny_llama_config(**changes))


def word_tokenizer():
    """A word-level tokenizer over the tiny Llama's vocabulary: w3 ... w96, with <pad>=0, <s>=1, </s>=2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def token_rows(n: int = 16, length: int = 8, seed: int = 0, prompt: int = 2) -> list[dict]:
    """``n`` random token sequences as training rows, the first ``prompt`` positions unlabelled (-100)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, 80, (length,), generator=g)
        labels = ids.clone()
        labels[:prompt] = -100
        rows.append({"input_ids": ids, "attention_mask": torch.ones(length, dtype=torch.long), "labels": labels})
    return rows
