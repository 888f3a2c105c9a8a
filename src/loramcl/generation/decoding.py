"""K candidates per input: the K hypotheses of an MCL model in one batched ``generate``, and the single-model
baselines (beam search, diverse beam search, sampling, test-time augmentation) behind the same call.

MCL decoding (DESIGN decisions 2 and 9): the K' copies of every input are made by the model's one K-copy rule
(``repeat_examples``: hypothesis-major, copy c of a batch-first tensor at rows c*B ... (c+1)*B - 1, items
flattened over the batch repeated copy-major), and the model runs with one routing entry per copy
(``use_hypotheses(hypotheses, copies=True)``): every adapted layer splits its rows evenly among the copies. The
copies are identical, so this holds for the language model's K'*B*num_beams rows (transformers expands rows by
``repeat_interleave`` for beams: the beams of a row stay inside their hypothesis) and for a vision tower whose
patches per example vary alike (tested token for token against one hypothesis at a time).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from loramcl.copies import NOT_PER_EXAMPLE, batch_dim, batch_size_of, repeat_examples
from loramcl.model import MCLModel
from loramcl.token_ids import check_token_ids

MCL_STRATEGIES = ("greedy", "beam", "sample", "diverse_beam")
BASELINE_STRATEGIES = ("beam", "diverse_beam", "sample", "tta", "stochastic_router")
# generate() arguments that the strategy sets; passing them in **generate_kwargs would contradict it.
_SET_BY_STRATEGY = frozenset({"num_beams", "do_sample", "num_return_sequences", "return_dict_in_generate",
                              "output_logits"})
# Inputs whose K' copies we cannot make.
_UNSUPPORTED_INPUTS = frozenset({"cache", "past_key_values", "encoder_outputs"})


@dataclass
class Candidate:
    """One decoded output.

    text: the generated text (prompt excluded, special tokens skipped); None when no tokenizer was given.
    token_ids: the generated token ids, prompt and end-of-sequence token excluded.
    log_prob: log p(tokens | input) under the decoding model's own distribution: the sum over the generated
        tokens (end-of-sequence token included when one was generated) of the log-softmax of the model's raw
        logits, i.e. *before* repetition penalty, temperature, top-k/top-p/typical filtering or diversity
        penalty. For an MCL candidate it is the likelihood under hypothesis ``hypothesis``, so candidates of all
        strategies are comparable. None when ``log_probs=False``.
    hypothesis: the MCL hypothesis (adapter set) that produced it; None for a single-model baseline.
    score: p(k | c) of that hypothesis for this input, for an MCL model with hypothesis scores
        (``MCLConfig(scoring=True)``) when all K hypotheses are decoded; read from the prefill of the same generate.
    """

    text: str | None
    token_ids: list[int]
    log_prob: float | None
    hypothesis: int | None = None
    score: float | None = None


@dataclass(frozen=True)
class EqualBudget:
    """Beam sizes at an equal number of forward passes per decoding step (paper §4.1 and App. H)."""

    budget: int
    """B: sequences advanced per decoding step and per input, for every method."""
    num_hypotheses: int
    """K: candidates per input."""
    mle_num_beams: int
    """Beam search and diverse beam search of a single model returning K sequences: B."""
    mcl_num_beams: int
    """MCL, per hypothesis (each returns its best beam), with beam search or diverse MCL decoding: B / K."""
    tta_num_beams: int
    """Test-time augmentation, per perturbed context, and stochastic-router decoding of a LoRA-MoE model, per pass
    (each returns its best beam): B / K."""

    def num_beams(self, strategy: str, mcl: bool) -> int:
        """The beam size of ``strategy`` ('beam', 'diverse_beam', 'tta', 'stochastic_router') for an MCL
        (``mcl=True``) or a single model."""
        if strategy not in ("beam", "diverse_beam", "tta", "stochastic_router"):
            raise ValueError(f"a forward budget sets beam sizes; strategy {strategy!r} has none "
                             "(use 'beam', 'diverse_beam', 'tta' or 'stochastic_router', or give num_beams)")
        if mcl:
            if strategy not in ("beam", "diverse_beam"):
                raise ValueError(f"strategy {strategy!r} is a single-model baseline, not an MCL decoding")
            return self.mcl_num_beams
        return self.tta_num_beams if strategy in ("tta", "stochastic_router") else self.mle_num_beams


def prediction_record(item_id, candidates: Sequence[Candidate]) -> dict:
    """One line of a predictions file as `loramcl evaluate` reads it: {"id", "candidates", "log_probs"} (+
    "hypotheses" for an MCL model's candidates)."""
    record = {"id": item_id, "candidates": [c.text.strip() for c in candidates],
              "log_probs": [c.log_prob for c in candidates]}
    if candidates and candidates[0].hypothesis is not None:
        record["hypotheses"] = [c.hypothesis for c in candidates]
    return record


def equal_budget(budget: int, num_hypotheses: int) -> EqualBudget:
    """Beam sizes giving every method the same forward budget B for K candidates per input (paper §4.1).

    A single model (LoRA-MLE) decodes with beam B and returns its K best beams (needs B >= K); an MCL model
    decodes each of its K hypotheses with beam B/K and each returns one sequence; test-time augmentation decodes
    each of its K perturbed contexts with beam B/K. So B must be a multiple of K.
    """
    for name, value in (("budget", budget), ("num_hypotheses", num_hypotheses)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if budget % num_hypotheses:
        lower, upper = budget - budget % num_hypotheses, budget + num_hypotheses - budget % num_hypotheses
        raise ValueError(f"a forward budget of {budget} cannot be split among K={num_hypotheses} hypotheses (beam "
                         f"{budget}/{num_hypotheses} per hypothesis): choose a multiple of K, e.g. "
                         f"{lower or upper} or {upper}")
    per_hypothesis = budget // num_hypotheses
    return EqualBudget(budget, num_hypotheses, mle_num_beams=budget, mcl_num_beams=per_hypothesis,
                       tta_num_beams=per_hypothesis)


def generate_hypotheses(
    model: nn.Module,
    tokenizer=None,
    inputs: Sequence[str] | Mapping[str, torch.Tensor] | None = None,
    *,
    strategy: str = "greedy",
    num_beams: int | None = None,
    budget: int | None = None,
    num_sequences: int | None = None,
    hypotheses: Sequence[int] | None = None,
    max_new_tokens: int = 64,
    repetition_penalty: float = 1.0,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    typical_p: float = 1.0,
    seed: int | None = 0,
    num_beam_groups: int | None = None,
    diversity_penalty: float | None = None,
    augment: Callable[[dict, int], dict] | None = None,
    log_probs: bool = True,
    sort_by_score: bool = False,
    **generate_kwargs,
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
        (``loramcl.generation.spec_augment``; masks drawn from torch's RNG, which ``seed`` makes reproducible):
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
        strategy: see above.
        num_beams: beam size (per hypothesis for MCL, per context for TTA, per pass for 'stochastic_router', in
            all for a single model's 'beam'/'diverse_beam').
        budget: instead of ``num_beams``: a forward budget B, turned into beam sizes by ``equal_budget``
            (MCL: B/K per hypothesis; 'beam'/'diverse_beam': B; 'tta', 'stochastic_router': B/K).
        num_sequences: K for the single-model baselines (an MCL model gives one candidate per hypothesis).
        hypotheses: MCL hypotheses to decode (default: all K, in order).
        max_new_tokens, repetition_penalty: as in transformers' ``generate``.
        temperature, top_k, top_p, typical_p: sampling only; the defaults (1.0, 0, 1.0, 1.0) are pure ancestral
            sampling and override the model's ``generation_config``.
        seed: seeds torch's RNG for sampling and augmentation inside a forked RNG state (the global state is
            left as it was), so the same call with the same seed gives the same outputs. None: use the global RNG
            (for 'stochastic_router': draw the seed from it).
        num_beam_groups, diversity_penalty: 'diverse_beam' only (for an MCL model the groups are its hypotheses).
        augment: 'tta' only: ``augment(inputs, k) -> inputs``, called on the tokenized/processed batch.
        log_probs: compute ``Candidate.log_prob`` (keeps the raw logits of every step during generation).
        sort_by_score: MCL model with hypothesis scores: candidates of each input by decreasing p(k | c).
        generate_kwargs: other arguments of transformers' ``generate`` (e.g. ``min_new_tokens``,
            ``length_penalty``, ``no_repeat_ngram_size``, ``eos_token_id``).

    Decoding runs in eval mode (dropout off) under ``torch.no_grad``; the model's mode is restored after.
    """
    if strategy not in MCL_STRATEGIES + BASELINE_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: MCL models decode with {MCL_STRATEGIES}, single models "
                         f"with {BASELINE_STRATEGIES}")
    if strategy == "stochastic_router" and not hasattr(model, "stochastic_router"):
        raise ValueError("strategy 'stochastic_router' samples the experts of a LoRA-MoE model (loramcl.baselines."
                         f"get_moe_model); {type(model).__name__} has no router")
    clashing = sorted(_SET_BY_STRATEGY & set(generate_kwargs))
    if clashing:
        raise ValueError(f"{clashing} are set by generate_hypotheses: use its own arguments (strategy, num_beams, "
                         "num_sequences, num_beam_groups, diversity_penalty)")
    batch = _prepare_inputs(model, tokenizer, inputs)
    selected = _selected_hypotheses(model, hypotheses)
    mcl_path = selected is not None and strategy in MCL_STRATEGIES and num_sequences in (None, len(selected))
    if selected is not None and not mcl_path and len(selected) != 1:
        if strategy in MCL_STRATEGIES:
            raise ValueError(f"num_sequences={num_sequences} does not match the {len(selected)} hypotheses to decode "
                             f"({selected}): an MCL model gives one candidate per hypothesis. Leave num_sequences "
                             "out, or pass hypotheses=[k] to run a single-model baseline on hypothesis k.")
        raise ValueError(f"strategy {strategy!r} is a single-model baseline; an MCL model decodes with "
                         f"{MCL_STRATEGIES}. To run it on one hypothesis of this model, pass hypotheses=[k].")
    copies = len(selected) if mcl_path else num_sequences
    if mcl_path and strategy == "diverse_beam":
        _check_diverse_mcl(model, selected, num_beam_groups, diversity_penalty)
    if not mcl_path:
        if strategy == "greedy":
            raise ValueError("greedy decoding gives one sequence per input; a single model's K candidates come from "
                             f"{BASELINE_STRATEGIES} (with num_sequences=K)")
        if num_sequences is None:
            raise ValueError(f"strategy {strategy!r} on a single model needs num_sequences=K (candidates per input)")
        if isinstance(num_sequences, bool) or not isinstance(num_sequences, int) or num_sequences < 1:
            raise ValueError(f"num_sequences must be an integer >= 1, got {num_sequences!r}")
    num_beams = _beam_size(strategy, num_beams, budget, copies, mcl_path)
    if strategy in ("beam", "diverse_beam") and not mcl_path and num_beams < num_sequences:
        raise ValueError(f"beam search returns at most num_beams sequences: num_beams={num_beams} < "
                         f"num_sequences={num_sequences}; use num_beams >= {num_sequences}")
    if strategy != "diverse_beam" and (num_beam_groups is not None or diversity_penalty is not None):
        raise ValueError("num_beam_groups and diversity_penalty belong to strategy='diverse_beam'")
    if strategy != "tta" and augment is not None:
        raise ValueError("augment belongs to strategy='tta'")

    kwargs = _generate_kwargs(model, tokenizer, strategy, num_beams, max_new_tokens, repetition_penalty,
                              temperature, top_k, top_p, typical_p, log_probs, generate_kwargs)
    decoder = _Decoder(model, tokenizer, kwargs, seed, log_probs,
                       routing=selected[0] if selected is not None and not mcl_path else None)
    if sort_by_score:
        if not (mcl_path and getattr(model, "scoring_head", None) is not None
                and sorted(selected) == list(range(model.num_hypotheses))):
            raise ValueError("sort_by_score needs an MCL model with hypothesis scores (MCLConfig(scoring=True)) "
                             "decoding all of its hypotheses with an MCL strategy")
    if mcl_path:
        outs = decoder.mcl(batch, selected, diversity_penalty if strategy == "diverse_beam" else None)
        return [sorted(c, key=lambda x: -x.score) for c in outs] if sort_by_score else outs
    if strategy == "stochastic_router":
        return decoder.stochastic_router(batch, num_sequences)
    if strategy == "tta":
        if augment is None:
            raise ValueError("strategy='tta' needs augment: a function (inputs, k) -> perturbed inputs")
        return decoder.tta(batch, augment, num_sequences)
    if strategy == "diverse_beam":
        if diversity_penalty is None:
            raise ValueError("strategy='diverse_beam' needs diversity_penalty (λ of the Hamming diversity term; "
                             "the paper uses 0.8 or 1.0)")
        groups = num_sequences if num_beam_groups is None else num_beam_groups
        if num_beams % groups:
            raise ValueError(f"diverse beam search splits num_beams={num_beams} into num_beam_groups={groups} "
                             "groups of equal size: num_beams must be a multiple of num_beam_groups")
        return decoder.diverse_beam(batch, num_sequences, groups, diversity_penalty)
    return decoder.returned_sequences(batch, num_sequences)


# ---- checks and preparation ---------------------------------------------------------------------------------


def _selected_hypotheses(model: nn.Module, hypotheses: Sequence[int] | None) -> list[int] | None:
    """The MCL hypotheses to decode, checked; None for a model without hypotheses."""
    if not isinstance(model, MCLModel):
        if hypotheses is not None:
            raise ValueError(f"hypotheses= selects adapter sets of an MCLModel; {type(model).__name__} has none")
        return None
    k = model.num_hypotheses
    if hypotheses is None:
        return list(range(k))
    if isinstance(hypotheses, int) or torch.is_tensor(hypotheses) and hypotheses.dim() == 0:
        raise TypeError(f"hypotheses must be a list of indices, e.g. [{int(hypotheses)}]")
    selected = [int(h) for h in hypotheses]
    if not selected:
        raise ValueError("hypotheses is empty: leave it out to decode all hypotheses")
    bad = [h for h in selected if not 0 <= h < k]
    if bad:
        raise ValueError(f"hypotheses {bad} do not exist: this model has K={k} (0..{k - 1})")
    return selected


def _check_diverse_mcl(model: MCLModel, selected: list[int], num_beam_groups, diversity_penalty) -> None:
    if len(selected) < 2:
        raise ValueError(
            f"diverse MCL decoding (strategy 'diverse_beam' on an MCL model) makes hypotheses avoid each other's "
            f"tokens, so it needs 2 or more hypotheses; this call decodes {selected} (the model has "
            f"K={model.num_hypotheses}). To run diverse beam search on one hypothesis k as a single model, pass "
            "hypotheses=[k] and num_sequences.")
    if num_beam_groups is not None and num_beam_groups != len(selected):
        raise ValueError(f"in diverse MCL decoding the groups are the {len(selected)} hypotheses decoded: leave "
                         f"num_beam_groups ({num_beam_groups}) out")
    if diversity_penalty is None or isinstance(diversity_penalty, bool) or not diversity_penalty >= 0:
        raise ValueError("strategy='diverse_beam' needs diversity_penalty >= 0 (λ of the Hamming diversity term; "
                         f"0 gives beam search per hypothesis), got {diversity_penalty!r}")


def _beam_size(strategy: str, num_beams: int | None, budget: int | None, copies: int, mcl: bool) -> int:
    if num_beams is not None and budget is not None:
        raise ValueError("give num_beams or budget, not both (budget sets the beam sizes)")
    if budget is not None:
        return equal_budget(budget, copies).num_beams(strategy, mcl)
    if num_beams is None:
        if strategy in ("beam", "diverse_beam"):
            raise ValueError(f"strategy {strategy!r} needs num_beams (or a forward budget: budget=B)")
        return 1
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams must be an integer >= 1, got {num_beams!r}")
    if strategy in ("greedy", "sample") and num_beams != 1:
        raise ValueError(f"strategy {strategy!r} decodes one beam (num_beams=1); use strategy='beam' for beams")
    return num_beams


def _hf_model(model: nn.Module) -> nn.Module:
    """The object holding the transformers config and generation_config."""
    return model.base_model if isinstance(model, MCLModel) else model


def _is_encoder_decoder(model: nn.Module) -> bool:
    return bool(getattr(_hf_model(model).config, "is_encoder_decoder", False))


def _text_tokenizer(tokenizer):
    return getattr(tokenizer, "tokenizer", tokenizer)  # a processor holds its tokenizer


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
    tok = _text_tokenizer(tokenizer)
    saved_side, saved_pad = tok.padding_side, tok.pad_token
    try:
        tok.padding_side = "right" if _is_encoder_decoder(model) else "left"
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
    if (not _is_encoder_decoder(model) and torch.is_tensor(mask) and mask.dim() == 2 and mask.shape[1]
            and not bool(mask[:, -1].all())):
        raise ValueError("the batch is right-padded, but a decoder-only model continues the last position: pad on "
                         "the left (tokenizer.padding_side = 'left'), or pass the prompts as strings")
    parameter = next(_hf_model(model).parameters())
    embeddings = getattr(_hf_model(model), "get_input_embeddings", lambda: None)()
    dtype = embeddings.weight.dtype if embeddings is not None else parameter.dtype

    def place(value):
        if not torch.is_tensor(value):
            return value
        return value.to(parameter.device, dtype=dtype if value.is_floating_point() else None)

    return {name: place(value) for name, value in batch.items()}


def _repeat_batch(batch: dict, copies: int) -> dict:
    """K' copies of the batch, copy-major: [B, ...] -> [K'*B, ...], copy c at rows c*B ... (c+1)*B - 1 (the
    model's K-copy rule, ``repeat_examples``)."""
    rows = batch_size_of(batch)
    return {name: repeat_examples(value, copies, rows, name) for name, value in batch.items()}


def _concat_batches(batches: list[dict]) -> dict | None:
    """The perturbed batches concatenated copy-major along their batch dimension, or None if their shapes differ."""
    first = batches[0]
    if any(set(b) != set(first) for b in batches):
        return None
    merged = {}
    for name, value in first.items():
        values = [b[name] for b in batches]
        if torch.is_tensor(value) and value.dim() >= 1 and name not in NOT_PER_EXAMPLE:
            if any(not torch.is_tensor(v) or v.shape != value.shape for v in values):
                return None
            merged[name] = torch.cat(values, dim=batch_dim(name, value))
        elif all(v is value for v in values) or all(_same(v, value) for v in values):
            merged[name] = value
        else:
            return None
    return merged


def _same(a, b) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):
        return False


def _forward_parameters(model: nn.Module) -> set[str]:
    """Keyword arguments the underlying transformers model's forward accepts."""
    model = model.base_model if isinstance(model, MCLModel) else model
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    return set(inspect.signature(model.forward).parameters)


def _eos_ids(model: nn.Module, generate_kwargs: dict) -> list[int]:
    eos = generate_kwargs.get("eos_token_id")
    if eos is None:
        config = getattr(_hf_model(model), "generation_config", None)
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    if torch.is_tensor(eos):
        return [int(e) for e in eos.flatten().tolist()]
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def _generate_kwargs(model, tokenizer, strategy, num_beams, max_new_tokens, repetition_penalty, temperature, top_k,
                     top_p, typical_p, log_probs, extra) -> dict:
    kwargs = {"max_new_tokens": max_new_tokens, "repetition_penalty": repetition_penalty, "num_beams": num_beams,
              "do_sample": strategy == "sample", "return_dict_in_generate": True, "output_logits": log_probs,
              **extra}
    if strategy == "sample":
        kwargs.update(temperature=temperature, top_k=top_k, top_p=top_p, typical_p=typical_p)
    if "pad_token_id" not in kwargs:
        pad = getattr(_text_tokenizer(tokenizer), "pad_token_id", None) if tokenizer is not None else None
        if pad is None:
            pad = getattr(getattr(_hf_model(model), "generation_config", None), "pad_token_id", None)
        eos = _eos_ids(model, extra)
        if pad is None and eos:
            pad = eos[0]
        if pad is not None:
            kwargs["pad_token_id"] = pad
    return kwargs


# ---- decoding -----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """torch's RNG seeded for the block, and restored after it (HF generate draws from the global RNG)."""
    if seed is None:
        yield
        return
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


class _Decoder:
    """Runs ``generate`` for one call of ``generate_hypotheses`` and turns its output into candidates."""

    def __init__(self, model: nn.Module, tokenizer, kwargs: dict, seed: int | None, log_probs: bool,
                 routing: int | None) -> None:
        self.model, self.tokenizer, self.kwargs, self.seed, self.log_probs = model, tokenizer, kwargs, seed, log_probs
        self.routing = routing  # the one hypothesis of an MCL model that a baseline runs on
        self.eos = _eos_ids(model, kwargs)
        self.device = next(model.parameters()).device

    @contextlib.contextmanager
    def _routed(self, routing: int | torch.Tensor | None = None, copies: bool = False) -> Iterator[None]:
        """Eval mode, no grad, and the hypotheses of an MCL model routed (``routing``, else the baseline's one;
        ``copies``: one entry per copy of the batch)."""
        routing = self.routing if routing is None else routing
        route = self.model.use_hypotheses(routing, copies=copies) if routing is not None else contextlib.nullcontext()
        with torch.no_grad(), _eval_mode(self.model), route:
            yield

    def _generate(self, batch: dict, routing: int | torch.Tensor | None = None, copies: bool = False,
                  **extra) -> list[Candidate]:
        """One ``generate`` on ``batch``, as one candidate per output row."""
        if not isinstance(self.model, MCLModel):  # an MCLModel checks in its own generate
            check_token_ids(self.model, batch.get("input_ids"))
        with self._routed(routing, copies):
            output = self.model.generate(**batch, **self.kwargs, **extra)
            return self._candidates(output, batch, per_input=extra.get("num_return_sequences", 1))

    def mcl(self, batch: dict, selected: list[int], diversity_penalty: float | None = None) -> list[list[Candidate]]:
        """One generate over K'*B rows, hypothesis-major; candidate c of input i is row c*B + i. With
        ``diversity_penalty``: diverse MCL decoding, the copies being the groups of one diverse beam search."""
        rows, copies = batch_size_of(batch), len(selected)
        # One hypothesis: plain single routing; else one routing entry per copy of the batch.
        routing = selected[0] if copies == 1 else torch.tensor(selected)  # [K']
        head = getattr(self.model, "scoring_head", None)
        scoring = head is not None and sorted(selected) == list(range(self.model.num_hypotheses))
        capture = self.model.capture_context() if scoring else contextlib.nullcontext([])
        repeated = _repeat_batch(batch, copies)
        with _seeded(self.seed, self.device), capture as context:
            if diversity_penalty is None:
                candidates = self._generate(repeated, routing, copies=True)  # [K'*B], hypothesis-major
            else:
                from loramcl.generation.diverse_beam import generate_diverse_copies

                with self._routed(routing, copies=True):
                    output = generate_diverse_copies(self.model, repeated, copies=copies,
                                                     num_beams=self.kwargs["num_beams"],
                                                     diversity_penalty=diversity_penalty, **self._diverse_kwargs())
                    candidates = self._candidates(output, repeated, per_input=1)  # [K'*B], hypothesis-major
        probabilities = None
        if scoring and context:  # the prefill's last position: [K'*B*beams, d], beams of a row consecutive
            states = context[0].view(copies, rows, -1, context[0].shape[-1])[:, :, 0]  # [K', B, d], copy order
            order = torch.tensor(selected, device=states.device).argsort()  # copies in hypothesis order
            with torch.no_grad():
                probabilities = head(states[order]).exp()[:, torch.tensor(selected)].tolist()  # [B][K'] p(k | c)
        for c, k in enumerate(selected):
            for i in range(rows):
                candidates[c * rows + i].hypothesis = k
                if probabilities is not None:
                    candidates[c * rows + i].score = probabilities[i][c]
        return [[candidates[c * rows + i] for c in range(copies)] for i in range(rows)]

    def stochastic_router(self, batch: dict, copies: int) -> list[list[Candidate]]:
        """K stochastic-router passes in one generate over K*B rows, pass-major; candidate c of input i is row
        c*B + i, decoded with the router sampled from generator seed + c."""
        rows = batch_size_of(batch)
        seed = self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()).item())
        with self.model.stochastic_router(copies, seed):
            candidates = self._generate(_repeat_batch(batch, copies))  # [K*B], pass-major
        return [[candidates[c * rows + i] for c in range(copies)] for i in range(rows)]

    def returned_sequences(self, batch: dict, num_sequences: int) -> list[list[Candidate]]:
        """Beam search or sampling returning K sequences per input (rows of input i consecutive)."""
        with _seeded(self.seed, self.device):
            candidates = self._generate(batch, num_return_sequences=num_sequences)  # [B*K], input-major
        return self._per_input(candidates, batch_size_of(batch), num_sequences)

    def diverse_beam(self, batch: dict, num_sequences: int, groups: int, penalty: float) -> list[list[Candidate]]:
        from loramcl.generation.diverse_beam import generate_diverse_beam

        with self._routed():
            output = generate_diverse_beam(self.model, batch, num_beams=self.kwargs["num_beams"],
                                           num_beam_groups=groups, diversity_penalty=penalty,
                                           num_return_sequences=num_sequences, **self._diverse_kwargs())
            candidates = self._candidates(output, batch, per_input=num_sequences)  # [B*K], input-major
        return self._per_input(candidates, batch_size_of(batch), num_sequences)

    def _diverse_kwargs(self) -> dict:
        """The generate arguments of a diverse beam search: it sets its own beams and output, and keeps no step
        logits (its candidates' log-probs come from one teacher-forced forward, ``_rescore``)."""
        return {k: v for k, v in self.kwargs.items()
                if k not in ("num_beams", "do_sample", "output_logits", "return_dict_in_generate")}

    def tta(self, batch: dict, augment: Callable[[dict, int], dict], copies: int) -> list[list[Candidate]]:
        """K perturbed contexts, each decoded with num_beams beams and returning its best: one generate over K*B
        rows (context-major) when the perturbed batches have equal shapes, else one generate per context."""
        rows = batch_size_of(batch)
        with _seeded(self.seed, self.device):
            perturbed = [dict(augment(dict(batch), k)) for k in range(copies)]
            for k, p in enumerate(perturbed):
                if batch_size_of(p) != rows:
                    raise ValueError(f"augment(inputs, {k}) returned {batch_size_of(p)} examples instead of {rows}")
            merged = _concat_batches(perturbed)
            if merged is not None:
                candidates = self._generate(merged)  # [K*B], context-major
            else:
                candidates = [c for p in perturbed for c in self._generate(p)]
        return [[candidates[c * rows + i] for c in range(copies)] for i in range(rows)]

    @staticmethod
    def _per_input(candidates: list[Candidate], rows: int, per_input: int) -> list[list[Candidate]]:
        return [candidates[i * per_input:(i + 1) * per_input] for i in range(rows)]

    def _candidates(self, output, batch: dict, per_input: int) -> list[Candidate]:
        """One Candidate per row of ``output.sequences`` ([N, prompt + L], N = B * per_input, the rows of an input
        consecutive); ``batch``: the inputs of generate. Runs inside the routing that generated ``output``."""
        sequences = output.sequences
        steps = getattr(output, "logits", None)  # L' tensors [rows, V], rows = N x beams: raw logits
        beam_indices = getattr(output, "beam_indices", None)  # [N, L] flat row of each token's beam, -1 after the end
        if steps and beam_indices is not None and int(beam_indices.max()) >= steps[0].shape[0]:
            # The step logits do not cover every beam (Whisper's generate keeps only N rows of them): score the
            # candidates by teacher forcing instead.
            steps = None
        if beam_indices is not None:
            length = beam_indices.shape[1]
        elif steps is not None:
            length = len(steps)
        else:  # no step record (log_probs=False, diverse beam search): every position after the input is generated
            length = sequences.shape[1] - self._prompt_length(batch)
        generated = sequences[:, sequences.shape[1] - length:]  # [N, L]
        is_eos = torch.isin(generated, torch.tensor(self.eos, device=generated.device, dtype=generated.dtype))
        after_eos = (is_eos.long().cumsum(1) - is_eos.long()) > 0  # [N, L] positions past the first EOS
        alive = ~after_eos if beam_indices is None else (beam_indices >= 0) & ~after_eos  # tokens of the sequence
        log_prob = None
        if steps is not None and self.log_probs:
            source = beam_indices if beam_indices is not None else torch.arange(len(generated), device=generated.device
                                                                               ).unsqueeze(1).expand_as(generated)
            token_log_probs = torch.zeros(generated.shape, dtype=torch.float32, device=generated.device)
            for t in range(length):
                step = steps[t].float().log_softmax(dim=-1)  # [rows, V]
                token_log_probs[:, t] = step[source[:, t].clamp(min=0).long(), generated[:, t]]
            log_prob = (token_log_probs * alive).sum(dim=1).tolist()  # [N]
        elif self.log_probs:
            log_prob = self._rescore(batch, sequences, alive, per_input)
        keep = alive & ~is_eos
        token_ids = [row[mask].tolist() for row, mask in zip(generated.cpu(), keep.cpu(), strict=True)]
        texts = (_text_tokenizer(self.tokenizer).batch_decode(token_ids, skip_special_tokens=True)
                 if self.tokenizer is not None else [None] * len(token_ids))
        return [Candidate(text, ids, None if log_prob is None else log_prob[n], hypothesis=self.routing)
                for n, (text, ids) in enumerate(zip(texts, token_ids, strict=True))]

    def _rescore(self, batch: dict, sequences: torch.Tensor, alive: torch.Tensor, per_input: int) -> list[float]:
        """log p(generated tokens | input) by one teacher-forced forward, for outputs without step logits.

        sequences: [N, P + L] (N = B * per_input), alive: [N, L] the generated tokens of each sequence (EOS included).
        """
        rows, length = alive.shape
        prompt = sequences.shape[1] - length
        # The inputs' copies are made copy-major (images flattened over the batch cannot be interleaved), so the
        # sequences [N] (input-major) are scored in copy-major order and the scores put back.
        examples = rows // per_input
        to_copy_major = torch.arange(rows, device=sequences.device).view(examples, per_input).T.reshape(-1)  # [N]
        sequences, alive = sequences[to_copy_major], alive[to_copy_major]
        inputs = _repeat_batch(batch, per_input)  # [N, ...], copy-major
        accepted = _forward_parameters(self.model)
        if _is_encoder_decoder(self.model):
            inputs["decoder_input_ids"] = sequences[:, :-1]  # position t predicts sequences[:, t + 1]
        else:
            mask = inputs.get("attention_mask")
            mask = torch.ones_like(sequences[:, :prompt]) if mask is None else mask
            mask = torch.cat([mask, alive.to(mask.dtype)], dim=1)  # [N, P + L]
            inputs.update(input_ids=sequences, attention_mask=mask)
            if "position_ids" in accepted:  # as generate numbers left-padded prompts
                inputs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
        if "logits_to_keep" in accepted:
            inputs["logits_to_keep"] = length + 1
        mcl = isinstance(self.model, MCLModel)
        model = self.model.base_model if mcl else self.model
        # in the routing of the generate call (see _candidates); adapt_context=False: the adapters as it decoded
        masked = self.model.context_masked(inputs, prompt) if mcl else contextlib.nullcontext(inputs)
        with torch.no_grad(), masked as inputs:
            logits = model(**inputs, use_cache=False).logits  # [N, T', V]
        logits = logits[:, -length - 1:-1] if not _is_encoder_decoder(self.model) else logits[:, prompt - 1:]
        token_log_probs = logits.float().log_softmax(-1).gather(2, sequences[:, prompt:].unsqueeze(2)).squeeze(2)
        scores = (token_log_probs * alive).sum(dim=1)  # [N], copy-major
        return scores[torch.argsort(to_copy_major)].tolist()  # [N], input-major

    def _prompt_length(self, batch: dict) -> int:
        """Positions of ``sequences`` that are not generated (used only without step logits)."""
        if _is_encoder_decoder(self.model):
            decoder_ids = batch.get("decoder_input_ids")
            return decoder_ids.shape[1] if torch.is_tensor(decoder_ids) else 1  # or the decoder start token
        input_ids = batch.get("input_ids")
        return input_ids.shape[1] if torch.is_tensor(input_ids) else 0  # inputs_embeds only: new tokens only

