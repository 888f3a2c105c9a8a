"""K candidates per input: the K hypotheses of an MCL model in one batched ``generate``, and the single-model
baselines (beam search, diverse beam search, sampling, test-time augmentation) behind the same call.

MCL decoding (docs/architecture.md, "Decisions as implemented": "Routing" and "Where the K copies are made"): the K'
copies of every input are made by the model's one K-copy rule (``repeat_examples``: hypothesis-major, copy c of a
batch-first tensor at rows c*B ... (c+1)*B - 1, items flattened over the batch repeated copy-major), and the model
runs with one routing entry per copy (``use_hypotheses(hypotheses, copies=True)``): every adapted layer splits its
rows evenly among the copies. The copies are identical, so this holds for the language model's K'*B*num_beams rows
(transformers expands rows by ``repeat_interleave`` for beams: the beams of a row stay inside their hypothesis) and
for a vision tower whose patches per example vary alike (tested token for token against one hypothesis at a time).

This module checks and prepares a call; ``decoding.candidates`` runs each strategy's ``generate`` and reads its
output, ``decoding.budget`` gives the beam sizes of an equal forward budget.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from loramcl.decoding.candidates import Candidate, Decoder, eos_ids, hf_model, is_encoder_decoder, text_tokenizer
from loramcl.decoding.compiled import check_compilable, generate_options
from loramcl.decoding.options import DecodedModel, Decoding, plan, split_options
from loramcl.mcl.copies import batch_size_of
from loramcl.mcl.model import MCLModel
from loramcl.utils.inputs import position_limits
from loramcl.utils.validate import OptionError

# generate() arguments that the strategy sets; passing them as other options would contradict it.
_SET_BY_STRATEGY = frozenset({"num_beams", "do_sample", "num_return_sequences", "return_dict_in_generate",
                              "output_logits"})
# Inputs whose K' copies we cannot make.
_UNSUPPORTED_INPUTS = frozenset({"cache", "past_key_values", "encoder_outputs"})


def generate_hypotheses(
    model: nn.Module,
    tokenizer=None,
    inputs: Sequence[str] | Mapping[str, torch.Tensor] | None = None,
    *,
    decoding: Decoding | None = None,
    augment: Callable[[dict, int], dict] | None = None,
    log_probs: bool = True,
    sort_by_score: bool = False,
    **options,
) -> list[list[Candidate]]:
    """Decode K candidates per input: ``outs[i][k]`` is candidate k of input i (a ``Candidate``).

    MCL model (``MCLModel``): one candidate per hypothesis, all hypotheses in ONE ``generate`` call.
      - strategy 'greedy'; 'beam' (``num_beams`` beams per hypothesis, each returns its best);
        'sample' (temperature, top_k, top_p, typical_p; reproducible with ``seed``);
        'diverse_beam': diverse MCL decoding, a diverse beam search whose group k is hypothesis k with
        ``num_beams`` beams, penalised by ``diversity_penalty`` (λ) per beam of hypotheses decoded before it that
        chose the same token at the same step for the same input; each hypothesis returns its best. λ = 0 is
        'beam'. Needs 2 or more hypotheses; ``num_beam_groups``, if given, must be their number.
      - ``hypotheses=[k, ...]`` decodes only those hypotheses, in that order (``outs[i]`` has one entry each).
      - with hypothesis scores (``MCLConfig(scoring=True)``) and all K hypotheses decoded, each candidate carries
        ``score`` = p(k | c), read from the prefill of the same generate; ``sort_by_score=True`` returns each
        input's candidates most probable first (``Candidate.hypothesis`` still says which is which).
    Single model (a ``PreTrainedModel``, a PEFT ``PeftModel``, an MCL model with K=1, or one hypothesis of an MCL
    model chosen with ``hypotheses=[k]``): the baselines, with ``num_sequences=K`` required.
      - 'beam': beam search with ``num_beams >= K``, returns its K best beams (best first);
      - 'diverse_beam': diverse beam search, ``num_beam_groups`` groups (default K) with Hamming diversity penalty
        ``diversity_penalty`` (λ; the paper uses 0.8 or 1.0), returns its K best beams;
      - 'sample': K samples;
      - 'tta': test-time augmentation: ``augment(inputs, k)`` gives perturbed context k (k < K); each is decoded
        with ``num_beams`` beams (1: greedy) and returns its best. E.g. SpecAugment on audio features
        (``loramcl.decoding.spec_augment``; masks drawn from torch's RNG, which ``seed`` makes reproducible):
        ``augment=lambda x, k: {**x, "input_features": spec_augment(x["input_features"])}``.
      - 'stochastic_router' (a LoRA-MoE model, ``loramcl.baselines.moe``; Zuo et al. 2021, paper App. F): K passes,
        in each of which every MoE layer uses, per token, one expert drawn from its router's distribution; each pass
        is decoded with ``num_beams`` beams (1: greedy) and returns its best. All K passes run in one generate; pass
        c draws from a ``torch.Generator`` seeded ``seed + c``, so it equals a one-candidate call with that seed.
        ``log_prob`` is the likelihood under the pass's own sampled routing.

    Args:
        model: an ``MCLModel``, or a single model with a ``generate`` method.
        tokenizer: a tokenizer or processor; needed when ``inputs`` are strings, and to decode ``Candidate.text``.
        inputs: a non-empty list of prompt strings (tokenized here, left-padded for decoder-only models), or a
            processed batch (dict / BatchEncoding from a tokenizer or processor, e.g. with ``pixel_values`` or
            ``input_features``; decoder-only batches must be left-padded).
        decoding: the options of the decoding (``loramcl.decoding.Decoding``: strategy, num_beams or budget,
            num_sequences, hypotheses, max_new_tokens, repetition_penalty, the sampling settings, seed,
            num_beam_groups, diversity_penalty); its fields may also be given as keywords (they replace
            ``decoding``'s), e.g. ``strategy="beam", num_beams=2``.
        augment: 'tta' only: ``augment(inputs, k) -> inputs``, called on the tokenized/processed batch.
        log_probs: compute ``Candidate.log_prob`` (the chosen tokens' log-probabilities only: recorded step by step,
            or by one teacher-forced forward for diverse beam search).
        sort_by_score: MCL model with hypothesis scores: candidates of each input by decreasing p(k | c).
        options: fields of ``Decoding``, and other arguments of transformers' ``generate`` (e.g. ``min_new_tokens``,
            ``length_penalty``, ``no_repeat_ngram_size``, ``eos_token_id``).

    Decoding runs in eval mode (dropout off) under ``torch.no_grad``; the model's mode is restored after.
    """
    decoding, generate_kwargs = split_options(decoding, options)
    strategy, num_sequences = decoding.strategy, decoding.num_sequences
    clashing = sorted(_SET_BY_STRATEGY & set(generate_kwargs))
    if clashing:
        raise ValueError(f"{clashing} are set by generate_hypotheses: use its own arguments (strategy, num_beams, "
                         "num_sequences, num_beam_groups, diversity_penalty)")
    decoded = plan(decoding, decoded_model(model), augment=augment is not None, sort_by_score=sort_by_score)
    selected, mcl_path, num_beams = decoded.selected, decoded.mcl, decoded.num_beams
    batch = _prepare_inputs(model, tokenizer, inputs)
    _check_positions(model, batch, decoding.max_new_tokens)

    kwargs = _generate_kwargs(model, tokenizer, decoding, num_beams, log_probs, generate_kwargs)
    decoder = Decoder(model, tokenizer, kwargs, decoding.seed, log_probs,
                       routing=selected[0] if selected is not None and not mcl_path else None, compile=decoding.compile)
    if mcl_path:
        outs = decoder.mcl(batch, selected, decoding.diversity_penalty if strategy == "diverse_beam" else None)
        return [sorted(c, key=lambda x: -x.score) for c in outs] if sort_by_score else outs
    if strategy == "stochastic_router":
        return decoder.stochastic_router(batch, num_sequences)
    if strategy == "tta":
        return decoder.tta(batch, augment, num_sequences)
    if strategy == "diverse_beam":
        groups = num_sequences if decoding.num_beam_groups is None else decoding.num_beam_groups
        return decoder.diverse_beam(batch, num_sequences, groups, decoding.diversity_penalty)
    return decoder.returned_sequences(batch, num_sequences)


# ---- checks and preparation ---------------------------------------------------------------------------------


def decoded_model(model: nn.Module) -> DecodedModel:
    """What ``plan`` checks a decoding against, read off ``model``."""
    return DecodedModel(model.num_hypotheses if isinstance(model, MCLModel) else None,
                        router=hasattr(model, "stochastic_router"),
                        scoring=getattr(model, "scoring_head", None) is not None, name=type(model).__name__,
                        context_once=isinstance(model, MCLModel) and not model.mcl_config.adapt_context)


def _check_positions(model: nn.Module, batch: dict, max_new_tokens: int) -> None:
    """The prompts (their ``input_ids``, padded) and ``max_new_tokens`` fit the positions the model's configuration
    states, before any decoding: past them a position table runs out, or a rotary model reads where it never
    learned (transformers only reminds of it)."""
    config = getattr(hf_model(model), "config", None)
    ids = batch.get("input_ids")
    if config is None or not torch.is_tensor(ids):
        return
    limits = position_limits(config.to_dict(), f"the {type(config).__name__}")
    excess = limits.excess(ids.shape[-1], max_new_tokens)
    if excess is not None:
        raise OptionError("max_new_tokens", f"max_new_tokens {max_new_tokens} does not fit: prompts of "
                          f"{ids.shape[-1]} tokens and {max_new_tokens} new tokens need {excess}: lower "
                          "max_new_tokens or shorten the prompts")


def tokenize_prompts(model: nn.Module, tokenizer, prompts: Sequence[str], **tokenizer_kwargs) -> dict:
    """Tokenize ``prompts`` as generation needs them: left padding for a decoder-only model (the tokenizer's
    padding side and pad token are restored after); a missing pad token is taken from the end-of-sequence token."""
    if isinstance(prompts, str):
        raise TypeError("inputs must be a list of prompts, got one string: wrap it in a list")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("inputs is empty: give at least one prompt")
    if not all(isinstance(p, str) for p in prompts):
        raise TypeError("inputs must be a list of strings or a processed batch (dict of tensors)")
    if tokenizer is None:
        raise ValueError("string prompts need a tokenizer: generate_hypotheses(model, tokenizer, prompts, ...)")
    tok = text_tokenizer(tokenizer)
    saved_side, saved_pad = tok.padding_side, tok.pad_token
    try:
        tok.padding_side = "right" if is_encoder_decoder(model) else "left"
        if tok.pad_token is None:
            if tok.eos_token is None:
                raise ValueError("the tokenizer has no pad and no end-of-sequence token: set tokenizer.pad_token")
            tok.pad_token = tok.eos_token
        return dict(tok(prompts, return_tensors="pt", padding=True, **tokenizer_kwargs))
    finally:
        tok.padding_side = saved_side
        if saved_pad is None:
            tok.pad_token = None


def _prepare_inputs(model: nn.Module, tokenizer, inputs) -> dict:
    """A dict of tensors on the model's device (floating tensors in the embeddings' dtype), checked."""
    if inputs is None:
        raise ValueError("no inputs: give a list of prompts or a processed batch")
    if isinstance(inputs, Mapping):
        batch = dict(inputs)
    else:
        batch = tokenize_prompts(model, tokenizer, inputs)
    unsupported = sorted(_UNSUPPORTED_INPUTS & set(batch))
    if unsupported:
        raise ValueError(f"inputs {unsupported} cannot be copied per hypothesis: pass the raw inputs instead")
    rows = batch_size_of(batch)
    if rows == 0:
        raise ValueError("inputs is an empty batch: give at least one example")
    mask = batch.get("attention_mask")
    if (not is_encoder_decoder(model) and torch.is_tensor(mask) and mask.dim() == 2 and mask.shape[1]
            and not bool(mask[:, -1].all())):
        raise ValueError("the batch is right-padded, but a decoder-only model continues the last position: pad on "
                         "the left (tokenizer.padding_side = 'left'), or pass the prompts as strings")
    parameter = next(hf_model(model).parameters())
    embeddings = getattr(hf_model(model), "get_input_embeddings", lambda: None)()
    dtype = embeddings.weight.dtype if embeddings is not None else parameter.dtype

    def place(value):
        if not torch.is_tensor(value):
            return value
        return value.to(parameter.device, dtype=dtype if value.is_floating_point() else None)

    return {name: place(value) for name, value in batch.items()}


def _generate_kwargs(model, tokenizer, decoding: Decoding, num_beams: int, log_probs: bool, extra: dict) -> dict:
    sample = decoding.strategy == "sample"
    kwargs = {"max_new_tokens": decoding.max_new_tokens, "repetition_penalty": decoding.repetition_penalty,
              "num_beams": num_beams, "do_sample": sample, "return_dict_in_generate": True,
              # no step logits kept: the chosen tokens' log-probabilities are recorded as generate goes
              # (decoding.token_log_probs)
              "output_logits": False,
              **extra}
    if sample:
        kwargs.update(temperature=decoding.temperature, top_k=decoding.top_k, top_p=decoding.top_p,
                      typical_p=decoding.typical_p)
    if decoding.compile:  # transformers' generate allocates the static cache and compiles its steps
        check_compilable(hf_model(model))
        kwargs.update(generate_options())
    if "pad_token_id" not in kwargs:
        pad = getattr(text_tokenizer(tokenizer), "pad_token_id", None) if tokenizer is not None else None
        if pad is None:
            pad = getattr(getattr(hf_model(model), "generation_config", None), "pad_token_id", None)
        eos = eos_ids(model, extra)
        if pad is None and eos:
            pad = eos[0]
        if pad is not None:
            kwargs["pad_token_id"] = pad
    return kwargs
