"""Token ids outside the model's vocabulary, found before the model runs (torch's embedding lookup would end in
``IndexError: index out of range in self`` without saying which id)."""

from __future__ import annotations

import torch
from torch import nn


def check_token_ids(model: nn.Module, input_ids: torch.Tensor | None, name: str = "input_ids") -> None:
    """Raise a ValueError naming the first id of ``input_ids`` [B, T] outside [0, vocabulary size of ``model``'s
    input embeddings), its row and the vocabulary size. One comparison and one sync when they are fine."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.numel() == 0 or input_ids.is_floating_point():
        return
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    if weight is None or weight.dim() != 2:
        return
    vocabulary = weight.shape[0]
    bad = (input_ids < 0) | (input_ids >= vocabulary)
    placeholders = _placeholder_ids(getattr(model, "config", None), vocabulary)
    if placeholders:  # e.g. LLaVA's image token may lie past the text embeddings: the model replaces it first
        bad &= ~torch.isin(input_ids, torch.tensor(placeholders, device=input_ids.device))
    if not bad.any().item():
        return
    position = bad.nonzero()[0].tolist()
    value = input_ids[tuple(position)].item()
    where = f"row {position[0]}" + (f", position {position[1]}" if len(position) > 1 else "")
    raise ValueError(f"{name} holds {value} ({where}), outside this model's vocabulary of {vocabulary} tokens "
                     f"(ids 0..{vocabulary - 1}): were the inputs tokenized with another tokenizer? (-100 belongs in "
                     "labels, never in input_ids)")


def _placeholder_ids(config, vocabulary: int) -> list[int]:
    """The special ids a multimodal config names (``image_token_id``, ``audio_token_index``, ...) that lie outside
    ``[0, vocabulary)``: its model swaps them for its own features before the embedding lookup."""
    ids = []
    for owner in (config, getattr(config, "text_config", None)):
        for key, value in (vars(owner).items() if owner is not None else ()):
            if key.endswith(("_token_id", "_token_index")) and isinstance(value, int) and not isinstance(value, bool) \
                    and not 0 <= value < vocabulary:
                ids.append(value)
    return ids
