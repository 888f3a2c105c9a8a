"""The tiny Llama of the checks and studies, its word-level tokenizer and token rows: one builder, changed by keyword
where a script needs another size.

Its default is the tests' tiny Llama (tests/tiny_models.py's ``build_model("llama")``: 2 layers, width 32, vocabulary
97, random weights), with the same word tokenizer (w3 ... w96) and token rows (both the library's,
``loramcl.models.tiny``), so that a benchmark and a test built from the same seed hold the same weights. The tests keep
their own builder: their helper scripts run in processes (torchrun, a killed checkpoint writer) that only see tests/
on their path.
"""

from __future__ import annotations

import torch

from loramcl.models.tiny import token_rows, word_tokenizer  # noqa: F401  (the scripts take them from here)

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
