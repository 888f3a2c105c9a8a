"""The context computed once (``MCLConfig(adapt_context=False)``, docs/architecture.md).

With adapters acting only from the first position whose output predicts a label on, every position before it (the
context) has the base model's hidden states, the same for all K hypotheses. A causal LM then runs in two calls:

  1. the context, positions 0 .. C-1 of the batch (C = the longest context), on B rows without adapters and without
     gradient, keeping its keys and values (a transformers ``DynamicCache``); row b's own context is its first c_b
     positions, the rest of its C are masked out (right padding inside the cache);
  2. the targets, positions c_b .. c_b + L - 1 of each row gathered to the left of a [B, L] block (right padding,
     L = T - min_b c_b), on K*B rows with the adapters, attending to the shared cache: attention mask [B, C + L] =
     the context's mask then the targets', position ids the ones the full sequence gives them. Causality holds with
     the standard mask: every cached position precedes every target position.

The cache's keys and values are made K-fold only where attention needs them, by the concatenation with the targets'
own keys that every cache update does anyway (``SharedContextLayer``): one copy, as in the full K*B forward.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from loramcl.mcl.compat import cache_argument, checkpointing_keeps_cache, upstream_error
from loramcl.mcl.nll import IGNORE_INDEX
from loramcl.mcl.scope import ForwardCall
from loramcl.mcl.scores import context_positions

# The inputs of a causal LM that the context / target split knows how to cut; anything else (images, audio, embeddings,
# token types) may carry positions of its own, so it is refused rather than misplaced.
SPLIT_INPUTS = frozenset({"input_ids", "attention_mask", "position_ids", "use_cache"})


class SharedContextLayer(DynamicLayer):
    """A cache layer holding the context's keys and values for B rows, read by ``copies`` copies of the batch
    (copy-major, as ``repeat_examples``): an update returns [copies*B*beams, heads, C + L, d], the context laid under
    each row's new keys.

    keep: decoding, where the cache grows: the first update stores its result, and the layer is an ordinary
        ``DynamicLayer`` of copies*B*beams rows from then on. Training keeps nothing: activation checkpointing
        recomputes a layer's forward, which must find the cache as the first forward did.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, copies: int, keep: bool) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values  # [B, heads, C, d]
        self.copies: int | None = copies
        self.keep = keep
        self.reads = 0  # updates seen: a model that never reads the cache it was given is found by check_context_read

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        if self.copies is None:
            return super().update(key_states, value_states, *args, **kwargs)
        keys = _after_copies(self.keys, key_states, self.copies)
        values = _after_copies(self.values, value_states, self.copies)
        if self.keep:
            self.keys, self.values, self.copies = keys, values, None
        return keys, values


def _after_copies(shared: torch.Tensor, new: torch.Tensor, copies: int) -> torch.Tensor:
    """[B, h, C, d] shared by every copy, [copies*B*beams, h, L, d] new -> [copies*B*beams, h, C + L, d]: row
    (c, b, j) reads example b's context (beams j of a row consecutive, as generate makes them); one copy, no repeat."""
    batch = shared.shape[0]
    if new.shape[0] % (copies * batch):
        raise RuntimeError(f"the shared context has {batch} rows but the targets come on {new.shape[0]} rows, not a "
                           f"multiple of {copies} copies of the batch")
    beams = new.shape[0] // (copies * batch)
    grouped = new.unflatten(0, (copies, batch, beams))  # [copies, B, beams, h, L, d]
    context = shared[None, :, None].expand(copies, batch, beams, *shared.shape[1:])  # a view
    return torch.cat([context, grouped], dim=-2).flatten(0, 2)


def share_context(cache: Cache, copies: int, length: int, keep: bool = False) -> Cache:
    """Make the context's ``cache`` (B rows, ``length`` positions written by the context's forward) serve ``copies``
    copies of the batch (``keep``: as the start of a growing decoding cache, see ``SharedContextLayer``); refuse
    layers of another kind, and a cache the forward did not fill."""
    if not cache.layers or cache.get_seq_length() != length:
        raise upstream_error(f"the context's forward left {cache.get_seq_length()} of its {length} positions in the "
                             "cache it was given", "use MCLConfig(adapt_context=True)")
    for i, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            raise ValueError(f"adapt_context=False shares a context cache of full-attention layers; layer {i} keeps "
                             f"a {type(layer).__name__} (sliding window, linear attention...), not supported yet: "
                             "use adapt_context=True for this model")
        written = layer.get_seq_length()
        shared = SharedContextLayer(layer.keys, layer.values, copies, keep) if written == length else None
        if shared is None or shared.get_seq_length() != length:
            raise upstream_error(f"the context's forward left {written} of its {length} positions in layer {i} of the "
                                 "cache it was given", "use MCLConfig(adapt_context=True)")
        cache.layers[i] = shared
    return cache


def check_context_read(cache: Cache, model: nn.Module) -> None:
    """After a forward given a shared context: every layer of ``model`` read it (a cache passed under a name the model
    does not take, or dropped by a layer, would leave the targets attending to themselves alone)."""
    unread = [i for i, layer in enumerate(cache.layers) if isinstance(layer, SharedContextLayer) and layer.reads == 0]
    if unread:
        raise upstream_error(f"{type(model).__name__} did not read the shared context in layer"
                             f"{'s' if len(unread) > 1 else ''} {', '.join(map(str, unread[:8]))}"
                             f"{', ...' if len(unread) > 8 else ''} of its cache", "use MCLConfig(adapt_context=True)")


def is_shared_context(value) -> bool:
    """Whether ``value`` is a cache made by ``share_context`` whose copies are still to be made."""
    return isinstance(value, Cache) and any(isinstance(layer, SharedContextLayer) and layer.copies is not None
                                            for layer in getattr(value, "layers", ()))


def check_split_inputs(inputs: dict, model_name: str) -> None:
    """Refuse inputs the split would cut wrongly."""
    other = sorted(name for name, value in inputs.items() if value is not None and name not in SPLIT_INPUTS)
    if other:
        raise ValueError(f"adapt_context=False runs the context once for causal LMs given input_ids, attention_mask "
                         f"and position_ids; {model_name} was also given {other}, not supported yet (images, audio "
                         "and embeddings are not split): use adapt_context=True")
    if inputs.get("input_ids") is None:
        raise ValueError("adapt_context=False needs input_ids (inputs_embeds are not supported yet)")


def split_context(inputs: dict, context_lengths: torch.Tensor) -> tuple[dict, dict, torch.Tensor]:
    """Cut a causal LM's batch into its context and its targets.

    inputs: input_ids [B, T] and optional attention_mask [B, T], position_ids [B, T] or [1, T].
    context_lengths: [B] c_b, the number of positions of row b before its first target position (C = max > 0).
    Returns (context inputs on [B, C], target inputs on [B, L] whose attention mask covers cache + targets
    [B, C + L], index [B, L] of each target-block position in the full sequence, -1 on the block's padding).
    """
    input_ids = inputs["input_ids"]  # [B, T]
    batch, length = input_ids.shape
    device = input_ids.device
    mask = inputs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask  # [B, T]
    positions = inputs.get("position_ids")
    # Without position ids the model numbers the positions 0..T-1 whatever the padding; keep that numbering.
    positions = (torch.arange(length, device=device) if positions is None else positions).expand(batch, length)
    context, longest = int(context_lengths.max()), int(context_lengths.min())
    steps = torch.arange(length - longest, device=device)  # [L]
    raw = context_lengths.unsqueeze(1) + steps  # [B, L]
    index = raw.clamp(max=length - 1)
    in_sequence = (raw < length).to(mask.dtype)  # [B, L]
    context_mask = mask[:, :context] * (torch.arange(context, device=device) < context_lengths.unsqueeze(1))  # [B, C]
    target_mask = mask.gather(1, index) * in_sequence  # [B, L]
    context_inputs = {"input_ids": input_ids[:, :context], "attention_mask": context_mask,
                      "position_ids": positions[:, :context]}
    target_inputs = {"input_ids": input_ids.gather(1, index), "position_ids": positions.gather(1, index),
                     "attention_mask": torch.cat([context_mask, target_mask], dim=1)}  # [B, C + L]
    return context_inputs, target_inputs, torch.where(raw < length, index, -1)


def without_context(model, inputs: dict, targets: torch.Tensor, positions: torch.Tensor, copies: int
                     ) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """adapt_context=False: (inputs, targets [B, L], positions [B, L]) of a call of ``model`` (an MCLModel) that runs
    only the target positions, attending to the context run once on B rows without adapters; or, with
    ``model.context_once = False``, the full sequence with the adapters masked on the context."""
    base = model.base_model
    if getattr(base.config, "is_encoder_decoder", False):  # the encoder is the context
        return encoder_once(model, inputs), targets, positions
    check_split_inputs(inputs, type(base).__name__)
    lengths = context_positions(positions)  # [B] c_b: positions before the first that predicts a label
    if not model.context_once:
        steps = torch.arange(positions.shape[1], device=positions.device)
        mask = (steps >= lengths.unsqueeze(1)).repeat(copies, 1)  # [rows, T]
        model.routing.positions = mask.unsqueeze(-1).to(model.adapter_dtype())  # [rows, T, 1]
        return inputs, targets, positions
    if int(lengths.max()) == 0:  # every row predicts from its first position: there is no context
        return inputs, targets, positions
    context_inputs, target_inputs, index = split_context(inputs, lengths)
    nothing = torch.zeros_like(context_inputs["input_ids"], dtype=torch.bool)  # no logits on the context
    cache, name = DynamicCache(config=base.config), cache_argument(base)
    with torch.no_grad(), model.disable_adapters(), checkpointing_keeps_cache(base):
        model.run_base({**context_inputs, name: cache, "use_cache": True}, ForwardCall(
            logit_positions=nothing if model.label_logits.output_layer_name is not None else None))
    # recomputing a checkpointed layer finds the shared cache as the forward did
    cache = share_context(cache, copies, length=context_inputs["input_ids"].shape[1])
    targets = torch.where(index >= 0, targets.gather(1, index.clamp(min=0)), IGNORE_INDEX)  # [B, L]
    return {**target_inputs, name: cache}, targets, targets != IGNORE_INDEX


def encoder_once(model, inputs: dict) -> dict:
    """An encoder-decoder's inputs with the encoder run once, on B rows without adapters: its outputs go to the
    decoder in place of the encoder's inputs (and are made K-fold where the hypotheses start)."""
    if inputs.get("encoder_outputs") is not None:
        return inputs
    decoder = {name: value for name, value in inputs.items() if name.startswith("decoder_") or name in (
        "use_cache", "attention_mask", "cache", "past_key_values")}
    encoder_inputs = {name: value for name, value in inputs.items() if name not in decoder or
                      name == "attention_mask"}
    with torch.no_grad(), model.disable_adapters():
        encoded = model.base_model.get_encoder()(**encoder_inputs, return_dict=True)
    return {**decoder, "encoder_outputs": encoded}
