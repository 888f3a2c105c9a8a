"""Diverse (group) beam search, Vijayakumar et al. 2018 ("Diverse Beam Search", AAAI), for transformers >= 5.

The ``num_beams`` beams of each example are split into G = ``num_beam_groups`` groups of S = num_beams / G beams.
At every step the groups are decoded one after the other; group g runs one ordinary beam-search step over its S beams
on log-probabilities from which the Hamming diversity term is subtracted:

    log p(y | beam) - lambda * #{beams of groups 0..g-1 of the same example that chose y at this step}

(the paper's Hamming diversity, lambda = ``diversity_penalty``; App. F of the LoRA-MCL paper uses it as the
diverse-decoding baseline). lambda = 0 gives G identical copies of a beam search with S beams.

Why a ``custom_generate`` callable, not our own generation loop: transformers >= 4.57 moved group beam search out of
its core (to a Hub repository that needs the network), but ``model.generate(custom_generate=<callable>)`` still runs
the whole input preparation offline and hands the callable everything a decoding loop needs: the inputs already
expanded to batch x beams (encoder outputs included), the KV cache, the logits processors built from the generation
config (``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``, ...), the stopping criteria
(``max_new_tokens``, eos, stop strings) and the special tokens. So ``diverse_beam_search`` below is only the decoding
step; everything model-specific stays transformers' job, for causal, encoder-decoder and multimodal models alike.
The price: the processors after the diversity term run once per group and step, on all B x N rows (so that each sees
the rows it was built for), of which only the group's rows are kept.

Semantics follow transformers 4.56.2 (the last release with the algorithm built in), so that outputs match it token
for token (``tests/decoding/test_diverse_beam.py`` checks this against a committed fixture):
- beams are scored by their summed processed log-probabilities; the diversity term is part of that sum;
- the Hamming term is applied after ``sequence_bias``/classifier-free guidance and before the other processors;
- of a group's candidates, those ending in eos that rank in its top S become finished hypotheses, and the S best
  non-eos ones keep running; each group keeps its own S best finished hypotheses, scored
  sum / generated_length ** length_penalty (the eos counts in the length, it is not stored in the hypothesis);
- a group is finished once its list is full and, for ``early_stopping=False``, no running beam can beat the worst
  kept hypothesis at the current length (``True``: as soon as it is full; ``"never"``: using the longest possible
  length when length_penalty > 0); finished groups emit ``pad_token_id``, which later groups still see in the Hamming
  count, exactly as 4.56.2 did;
- decoding stops when every group of every example is finished or a stopping criterion holds for every row;
- the hypotheses of all groups of an example are then ranked together and the best ``num_return_sequences`` returned.

One difference is inherited from transformers 5: its ``repetition_penalty`` ignores left-padding positions of the
prompt, whereas 4.56.2 also penalised the pad token id found there.

Groups as copies of the batch (``copies=G``, ``generate_diverse_copies``): the batch given to ``generate`` is G copies
of B examples, copy-major (copy g at rows g*B ... (g+1)*B - 1, as ``loramcl.mcl.copies.repeat_examples`` makes
them), each expanded by ``generate`` to ``num_beams`` beams; group g of example b is copy g's beams of example b. The
step above is unchanged (group g is penalised by the tokens of groups 0..g-1 of the same example), but each group
returns its own best hypotheses, copy-major, where the classic mode ranks all groups together. With an MCL model
routed per copy (``MCLModel.use_hypotheses(index, copies=True)``), group g decodes through hypothesis g: diverse MCL
decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.generation.logits_process import (
    LogitsProcessorList,
    SequenceBiasLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)
from transformers.generation.utils import (
    ALL_CACHE_NAMES,
    GenerateBeamDecoderOnlyOutput,
    GenerateBeamEncoderDecoderOutput,
)

from loramcl.mcl.compat import check_generation_steps, upstream_error

# Processors that transformers 4.56.2 applied before the Hamming diversity term; every other one comes after it.
_BEFORE_DIVERSITY = (UnbatchedClassifierFreeGuidanceLogitsProcessor, SequenceBiasLogitsProcessor)
# Generation arguments that only act when sampling, with the values at which they do nothing.
_SAMPLING_FLAGS = {"do_sample": (False,), "temperature": (1.0,), "top_k": (0,), "top_p": (1.0,), "typical_p": (1.0,),
                   "min_p": (), "top_h": (), "epsilon_cutoff": (0.0,), "eta_cutoff": (0.0,)}
_NOT_RETURNED = ("output_logits", "output_attentions", "output_hidden_states")
# The steps of transformers' generation loop (GenerationMixin's private methods) that diverse beam search drives.
_GENERATION_STEPS = ("_prefill", "prepare_inputs_for_generation", "_update_model_kwargs_for_generation")


def generate_diverse_beam(model: nn.Module, inputs: dict, *, num_beams: int, num_beam_groups: int,
                          diversity_penalty: float, num_return_sequences: int, **generate_kwargs):
    """Decode ``inputs`` with diverse beam search through ``model.generate``.

    model: a transformers model with a generation head, or a PEFT model wrapping one.
    inputs: the tokenizer/processor output (input_ids, attention_mask, pixel_values, input_features, ...); causal
        models need left padding.
    num_beams: beams per example, split into ``num_beam_groups`` groups of ``num_beams // num_beam_groups``.
    diversity_penalty: lambda >= 0, subtracted from a token's log-probability once per beam of an earlier group of the
        same example that chose it at this step.
    num_return_sequences: hypotheses returned per example (<= num_beams), best first.
    generate_kwargs: any other ``generate`` argument: max_new_tokens, repetition_penalty, length_penalty,
        early_stopping, eos_token_id, pad_token_id, ...

    Returns transformers' ``GenerateBeamDecoderOnlyOutput`` (``GenerateBeamEncoderDecoderOutput`` for encoder-decoder
    models): ``sequences`` [B * num_return_sequences, L], the rows of example i consecutive and best first (prompt
    included for causal models), and ``sequences_scores`` [B * num_return_sequences], the length-penalised scores.
    """
    _refuse_sampling(generate_kwargs)
    _check_settings(num_beams, num_beam_groups, diversity_penalty, num_return_sequences)
    return model.generate(**inputs, num_beams=num_beams, num_beam_groups=num_beam_groups,
                          diversity_penalty=float(diversity_penalty), num_return_sequences=num_return_sequences,
                          custom_generate=diverse_beam_search, return_dict_in_generate=True, **generate_kwargs)


def generate_diverse_copies(model: nn.Module, inputs: dict, *, copies: int, num_beams: int, diversity_penalty: float,
                            num_return_sequences: int = 1, **generate_kwargs):
    """Diverse beam search whose G = ``copies`` groups are the copies of a batch: group g is copy g, decoded with
    ``num_beams`` beams, penalised by the tokens that copies 0..g-1 of the same example chose at the same step
    (Hamming diversity, lambda = ``diversity_penalty``), and returning its own best ``num_return_sequences``.

    inputs: G copies of B examples, copy-major (copy g at rows g*B ... (g+1)*B - 1;
        ``loramcl.mcl.copies.repeat_examples`` makes them). What makes the copies differ is the caller's: e.g. an MCL
        model inside ``use_hypotheses(index, copies=True)`` runs copy g through hypothesis ``index[g]``.
    generate_kwargs: as for ``generate_diverse_beam``.

    Returns a ``GenerateBeam*Output``: ``sequences`` [G*B*R, L], copy-major (row (g*B + b)*R + r is the r-th best of
    example b in group g), as ``generate`` lays out the outputs of the copies' batch; ``sequences_scores`` [G*B*R].
    With lambda = 0, copy g's rows are those of transformers' beam search of copy g alone.
    """
    _refuse_sampling(generate_kwargs)
    _check_settings(num_beams, 1, diversity_penalty, num_return_sequences)
    return model.generate(**inputs, num_beams=num_beams, copies=copies, diversity_penalty=float(diversity_penalty),
                          num_return_sequences=num_return_sequences, custom_generate=diverse_beam_search,
                          return_dict_in_generate=True, **generate_kwargs)


def _refuse_sampling(generate_kwargs: dict) -> None:
    sampling = sorted(name for name, neutral in _SAMPLING_FLAGS.items()
                      if generate_kwargs.get(name) not in (None, *neutral))
    if sampling:
        raise ValueError(f"diverse beam search is deterministic: remove the sampling arguments {sampling}")


def _check_copies(copies, num_beam_groups, rows: int, num_beams: int) -> None:
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"copies must be a positive integer (the groups: copies of the batch), got {copies!r}")
    if num_beam_groups not in (None, 1):
        raise ValueError(f"with copies={copies} the groups are the copies of the batch: leave num_beam_groups "
                         f"({num_beam_groups}) out")
    if rows % (copies * num_beams):
        raise ValueError(f"{rows} rows are not {copies} copies of a batch expanded to {num_beams} beams")


def _check_settings(num_beams, num_beam_groups, diversity_penalty, num_return_sequences, do_sample=False) -> None:
    if not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams must be a positive integer, got {num_beams!r}")
    if not isinstance(num_beam_groups, int) or num_beam_groups < 1 or num_beams % num_beam_groups:
        raise ValueError(f"num_beams ({num_beams}) must be divisible by num_beam_groups ({num_beam_groups!r}): each "
                         "group holds num_beams // num_beam_groups beams")
    if diversity_penalty is None or not diversity_penalty >= 0:
        raise ValueError(f"diversity_penalty must be >= 0 (0 makes the groups identical), got {diversity_penalty!r}")
    if not 1 <= num_return_sequences <= num_beams:
        raise ValueError(f"num_return_sequences ({num_return_sequences}) must be between 1 and num_beams "
                         f"({num_beams}): beam search keeps num_beams hypotheses per example")
    if do_sample:
        raise ValueError("diverse beam search is deterministic: set do_sample=False")


class _FinishedHypotheses:
    """The best ``size`` finished hypotheses of one (example, group), in insertion order."""

    def __init__(self, size: int, length_penalty: float, early_stopping: bool | str, longest: int) -> None:
        self.size = size
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.longest = longest  # the most tokens a hypothesis can generate (max_length - prompt length)
        self.entries: list[tuple[float, torch.Tensor]] = []  # (score, tokens [T])

    def worst(self) -> float:
        return min(score for score, _ in self.entries)

    def add(self, tokens: torch.Tensor, sum_logprobs: float, generated_len: int) -> None:
        score = sum_logprobs / generated_len ** self.length_penalty
        if len(self.entries) < self.size:
            self.entries.append((score, tokens))
        elif score > self.worst():
            self.entries.append((score, tokens))
            # drop the worst (the earliest one among equals)
            del self.entries[min(range(len(self.entries)), key=lambda i: self.entries[i][0])]

    def is_done(self, best_sum_logprobs: float, generated_len: int) -> bool:
        """Whether no running beam, whose best summed score is ``best_sum_logprobs``, can still enter the list."""
        if len(self.entries) < self.size:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0:
            generated_len = self.longest  # a longer hypothesis divides by more: the best it could still reach
        return self.worst() >= best_sum_logprobs / generated_len ** self.length_penalty


@dataclass
class _Step:
    """What one group chose at one step, for every example."""

    source: torch.Tensor  # [B, S] beam (0..S-1 within the group) that each new beam continues
    tokens: torch.Tensor  # [B, S]
    scores: torch.Tensor  # [B, S] summed processed log-probabilities
    best: list[float]  # per example, the best continuation (eos or not): what the group can still reach


def _reorder_cache(model: nn.Module, model_kwargs: dict, rows: torch.Tensor) -> None:
    """Make row i of the KV cache hold what row ``rows[i]`` held, as transformers' own beam search does."""
    cache_key = next((key for key in ALL_CACHE_NAMES if model_kwargs.get(key) is not None), None)
    if cache_key is None:
        if model_kwargs.get("use_cache"):  # a cache under a name we do not know would keep the old beams' rows
            raise upstream_error("generate's model kwargs hold no cache under any of "
                                 f"{', '.join(ALL_CACHE_NAMES)} although use_cache is on",
                                 "pass use_cache=False to decode with diverse beam search")
        return
    if hasattr(model, "_reorder_cache"):
        model_kwargs[cache_key] = model._reorder_cache(model_kwargs[cache_key], rows)
    elif hasattr(model_kwargs[cache_key], "reorder_cache"):
        model_kwargs[cache_key].reorder_cache(rows)
    else:
        raise ValueError(f"{type(model).__name__} cannot reorder its cache for beam search; pass use_cache=False")


def diverse_beam_search(model, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList,
                        stopping_criteria, generation_config, copies: int | None = None, **model_kwargs):
    """Diverse beam search as a transformers ``custom_generate`` callable.

    Use ``model.generate(..., num_beams=N, num_beam_groups=G, diversity_penalty=lam,
    custom_generate=diverse_beam_search)``, or ``generate_diverse_beam``. ``generate`` calls it with ``input_ids``
    [B*N, T] (each example repeated N times, consecutively) and the prepared processors, criteria and model kwargs.
    ``copies=G`` (a ``generate`` argument that ``generate`` hands to this callable): the batch is G copies of the
    examples, copy-major, and group g is copy g with its ``num_beams`` beams (see the module docstring;
    ``generate_diverse_copies``). Returns the sequences, or with ``return_dict_in_generate=True`` a
    ``GenerateBeam*Output`` holding ``sequences`` and ``sequences_scores`` (per-step scores, logits, attentions and
    beam indices are not kept).
    """
    config = generation_config
    penalty = config.diversity_penalty or 0.0
    rows, prompt_len = input_ids.shape
    device = input_ids.device
    if copies is None:
        num_beams, num_groups = config.num_beams, config.num_beam_groups or 1
        _check_settings(num_beams, num_groups, penalty, config.num_return_sequences, config.do_sample)
        group_size = num_beams // num_groups
        batch = rows // num_beams
        group_rows = torch.arange(rows, device=device).view(batch, num_groups, group_size)  # [B, G, S]
    else:
        group_size, num_groups = config.num_beams, copies
        _check_copies(copies, config.num_beam_groups, rows, group_size)
        _check_settings(group_size, 1, penalty, config.num_return_sequences, config.do_sample)
        batch = rows // (copies * group_size)
        # [B, G, S]: row (g*B + b)*S + j is beam j of copy g of example b (generate expanded each row to S beams)
        group_rows = torch.arange(rows, device=device).view(num_groups, batch, group_size).transpose(0, 1).contiguous()
    check_generation_steps(model, _GENERATION_STEPS, "diverse beam search", "decode with another strategy")
    asked = [name for name in _NOT_RETURNED if getattr(config, name, False)]
    if asked:
        raise NotImplementedError(f"diverse_beam_search does not return {asked}")
    eos = config._eos_token_tensor  # [n_eos] or None
    eos = None if eos is None else eos.to(device).reshape(-1)
    pad = config._pad_token_tensor
    pad_id = int(pad) if pad is not None else (int(eos[0]) if eos is not None else 0)
    n_candidates = max(2, 1 + (0 if eos is None else eos.numel())) * group_size  # enough to keep S beams without eos
    early_stopping = False if config.early_stopping is None else config.early_stopping
    max_length = config.max_length

    n_before = 0  # leading processors that run before the diversity term
    while n_before < len(logits_processor) and isinstance(logits_processor[n_before], _BEFORE_DIVERSITY):
        n_before += 1
    before, after = LogitsProcessorList(logits_processor[:n_before]), LogitsProcessorList(logits_processor[n_before:])

    finished = [[_FinishedHypotheses(group_size, config.length_penalty, early_stopping, max_length - prompt_len)
                 for _ in range(num_groups)] for _ in range(batch)]
    group_done = torch.zeros(batch, num_groups, dtype=torch.bool)
    # Only the first beam of each group is live at the start; the others would duplicate it.
    beam_scores = torch.full((batch, num_groups, group_size), -1e9, dtype=torch.float, device=device)
    beam_scores[:, :, 0] = 0
    sequences = input_ids  # [B*N, T]; group_rows[b, g, j] is the row of beam j of group g of example b
    row_order = group_rows.reshape(-1)  # [B*N]: the rows in (example, group, beam) order

    outputs = model._prefill(input_ids, config, model_kwargs, is_first_iteration=not config.is_assistant)
    first_step = True
    while True:
        if not first_step:
            model_inputs = model.prepare_inputs_for_generation(
                sequences, next_sequence_length=1 if model_kwargs["use_cache"] else None, **model_kwargs)
            outputs = model(**model_inputs, return_dict=True)
        first_step = False
        model_kwargs = model._update_model_kwargs_for_generation(
            outputs, model_kwargs, is_encoder_decoder=model.config.is_encoder_decoder)
        logits = outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32, device=device)  # [B*N, V]
        del outputs
        log_probs = before(sequences, nn.functional.log_softmax(logits, dim=-1))  # [B*N, V]
        vocab = log_probs.shape[-1]
        generated_len = sequences.shape[1] + 1 - prompt_len  # counting the token chosen now

        step_tokens = torch.full((batch, num_groups, group_size), pad_id, dtype=torch.long, device=device)
        reorder = group_rows.clone()  # [B, G, S]
        shared = None  # processed log-probs when no diversity term applies (group 0, or lambda = 0)
        penalised = None  # [B*N, V], one buffer for the groups of this step, not a clone per group
        for g in range(num_groups):
            if g == 0 or penalty == 0:
                if shared is None:
                    shared = after(sequences, log_probs.clone())
                processed = shared
            else:
                # Hamming term: how often each token was chosen at this step by the groups before g
                counts = torch.zeros(batch, vocab, dtype=torch.long, device=device)
                counts.scatter_add_(1, step_tokens[:, :g].reshape(batch, -1), torch.ones_like(step_tokens[:, :g])
                                    .reshape(batch, -1))  # [B, V]
                penalised = log_probs.clone() if penalised is None else penalised.copy_(log_probs)
                penalised[group_rows[:, g]] -= (penalty * counts)[:, None, :]  # rows [B, S] of group g
                # every processor sees all B*N rows, laid out as when it was built; only group g's rows are kept
                processed = after(sequences, penalised)
            group_scores = processed[group_rows[:, g]]  # [B, S, V]
            step = _group_step(group_scores + beam_scores[:, g, :, None], sequences, group_rows[:, g], eos,
                               n_candidates, finished, group_done, g, generated_len)
            live = ~group_done[:, g]  # [B] on the host: groups finished before this step keep their rows, emit pad
            on_device = live.to(device, non_blocking=True)[:, None]  # [B, 1], no wait for the device
            step_tokens[:, g] = torch.where(on_device, step.tokens, pad_id)
            reorder[:, g] = torch.where(on_device, group_rows[:, g].gather(1, step.source), group_rows[:, g])
            beam_scores[:, g] = torch.where(on_device, step.scores, 0.0)
            for b in live.nonzero().flatten().tolist():
                group_done[b, g] = finished[b][g].is_done(step.best[b], generated_len)

        # from (example, group, beam) order to row order; the identity map unless the groups are copies
        reorder = torch.empty_like(row_order).index_copy_(0, row_order, reorder.view(rows))  # [B*N]
        step_tokens = torch.empty_like(row_order).index_copy_(0, row_order, step_tokens.view(rows))  # [B*N]
        sequences = torch.cat([sequences[reorder], step_tokens.unsqueeze(1)], dim=1)  # [B*N, T+1]
        _reorder_cache(model, model_kwargs, reorder)
        if bool(group_done.all()) or bool(stopping_criteria(sequences, None).all()):
            break

    # Groups still running at the end contribute their beams as they are.
    for b, g in (~group_done).nonzero().tolist():
        for j in range(group_size):
            row = int(group_rows[b, g, j])
            finished[b][g].add(sequences[row], beam_scores[b, g, j].item(), sequences.shape[1] - prompt_len)
    if copies is not None:  # each group its own best, copy-major: what generate returns for the copies' batch
        finished = [[finished[b][g]] for g in range(num_groups) for b in range(batch)]
    return _best_hypotheses(model, finished, config, eos, pad, max_length)


def _group_step(candidate_scores: torch.Tensor, sequences: torch.Tensor, rows: torch.Tensor, eos: torch.Tensor | None,
                n_candidates: int, finished: list, group_done: torch.Tensor, g: int, generated_len: int) -> _Step:
    """One beam-search step of group g: candidate_scores [B, S, V] are the summed scores of every continuation."""
    batch, group_size, vocab = candidate_scores.shape
    top_scores, top_ids = candidate_scores.view(batch, group_size * vocab).topk(n_candidates, dim=1)  # [B, C], sorted
    top_beams, top_tokens = top_ids // vocab, top_ids % vocab  # [B, C]
    is_eos = torch.isin(top_tokens, eos) if eos is not None else torch.zeros_like(top_tokens, dtype=torch.bool)
    # What the host needs, read in one transfer (not one per finished candidate): per example the best score, and
    # for the top S candidates whether each ends in eos, its row and its score.
    eos_rows = rows.gather(1, top_beams[:, :group_size])  # [B, S]
    host = torch.cat([top_scores[:, :1].double(), is_eos[:, :group_size].double(), eos_rows.double(),
                      top_scores[:, :group_size].double()], dim=1).cpu()  # [B, 1 + 3S]
    best, ends = host[:, 0].tolist(), host[:, 1:1 + group_size].bool() & ~group_done[:, g, None]  # [B, S]
    # A candidate ending in eos is a finished hypothesis if it ranks in the top S; the S best others keep running.
    for b, rank in ends.nonzero().tolist():
        row = int(host[b, 1 + group_size + rank])
        finished[b][g].add(sequences[row].clone(), float(host[b, 1 + 2 * group_size + rank]), generated_len)
    running = torch.argsort(is_eos.to(torch.int8), dim=1, stable=True)[:, :group_size]  # [B, S] first S non-eos
    return _Step(source=top_beams.gather(1, running), tokens=top_tokens.gather(1, running),
                 scores=top_scores.gather(1, running), best=best)


def _best_hypotheses(model, finished: list, config, eos: torch.Tensor | None, pad: torch.Tensor | None,
                     max_length: int):
    """Rank the hypotheses of each entry of ``finished`` (the groups of an example, or one group when the groups are
    copies) together and pad the best ``num_return_sequences`` of each entry into one [len(finished)*R, L] tensor."""
    num_return = config.num_return_sequences
    chosen, scores = [], []
    for groups in finished:
        candidates = [entry for group in groups for entry in group.entries]
        # best first; among equal scores the later candidate first (4.56.2 sorted ascending and popped from the end)
        ranked = sorted(candidates, key=lambda entry: entry[0])[::-1][:num_return]
        chosen += [tokens for _, tokens in ranked]
        scores += [score for score, _ in ranked]
    lengths = [len(tokens) for tokens in chosen]
    length = min(max(lengths) + (eos is not None), max_length)  # room for the eos of the longest if it has one
    if min(lengths) != max(lengths) and pad is None:
        raise ValueError("hypotheses of different lengths need a pad_token_id")
    device = chosen[0].device
    fill = int(pad) if pad is not None else 0
    sequences = torch.full((len(chosen), length), fill, dtype=torch.long, device=device)  # [B*R, L]
    for i, tokens in enumerate(chosen):
        sequences[i, :len(tokens)] = tokens
        if len(tokens) < length:  # ended by eos, which the hypothesis does not store
            sequences[i, len(tokens)] = eos[0]
    if not config.return_dict_in_generate:
        return sequences
    sequences_scores = torch.tensor(scores, dtype=torch.float32, device=device)  # [B*R]
    output_class = (GenerateBeamEncoderDecoderOutput if model.config.is_encoder_decoder
                    else GenerateBeamDecoderOnlyOutput)
    return output_class(sequences=sequences, sequences_scores=sequences_scores)
