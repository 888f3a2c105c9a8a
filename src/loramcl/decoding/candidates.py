"""From a ``generate`` call to ``Candidate``s: how each decoding strategy runs ``generate`` (the K hypotheses of an
MCL model in one call, K stochastic-router passes in one call, a single model's returned sequences, diverse beam
search, test-time augmentation), and each output row's token ids, text and log-probability (recorded as generate
went, ``decoding.token_log_probs``; or from one teacher-forced forward where nothing was recorded)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import LogitsProcessorList, StoppingCriteriaList

from loramcl.decoding.compiled import check_static_cache, compiled_steps
from loramcl.decoding.token_log_probs import BeamTokenLogProbs, ChosenTokenLogProbs, generating_module
from loramcl.mcl.compat import check_token_ids
from loramcl.mcl.copies import NOT_PER_EXAMPLE, batch_dim, batch_size_of, repeat_examples
from loramcl.mcl.model import MCLModel
from loramcl.mcl.nll import IGNORE_INDEX, token_log_probs


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
    hypothesis: the MCL hypothesis (adapter set) that produced it, where the model has several (K >= 2; also a
        single-model decoding of one of them, ``hypotheses=[k]``); None for a single model (K = 1 included).
    score: p(k | c) of that hypothesis for this input, for an MCL model with hypothesis scores
        (``MCLConfig(scoring=True)``) when all K hypotheses are decoded; read from the prefill of the same generate.
    """

    text: str | None
    token_ids: list[int]
    log_prob: float | None
    hypothesis: int | None = None
    score: float | None = None


def hf_model(model: nn.Module) -> nn.Module:
    """The object holding the transformers config and generation_config."""
    return model.base_model if isinstance(model, MCLModel) else model


def is_encoder_decoder(model: nn.Module) -> bool:
    return bool(getattr(hf_model(model).config, "is_encoder_decoder", False))


def text_tokenizer(tokenizer):
    return getattr(tokenizer, "tokenizer", tokenizer)  # a processor holds its tokenizer


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


def eos_ids(model: nn.Module, generate_kwargs: dict) -> list[int]:
    eos = generate_kwargs.get("eos_token_id")
    if eos is None:
        config = getattr(hf_model(model), "generation_config", None)
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    if torch.is_tensor(eos):
        return [int(e) for e in eos.flatten().tolist()]
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


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


class Decoder:
    """Runs ``generate`` for one call of ``generate_hypotheses`` and turns its output into candidates."""

    def __init__(self, model: nn.Module, tokenizer, kwargs: dict, seed: int | None, log_probs: bool,
                 routing: int | None, compile: bool = False) -> None:
        self.model, self.tokenizer, self.kwargs, self.seed, self.log_probs = model, tokenizer, kwargs, seed, log_probs
        self.compile = compile  # the steps of generate compiled, on a static cache (decoding.compiled)
        self.routing = routing  # the one hypothesis of an MCL model that a baseline runs on
        # which hypothesis made a candidate, said only where there were several to choose from
        self.named = isinstance(model, MCLModel) and model.num_hypotheses > 1
        self.eos = eos_ids(model, kwargs)
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
        kwargs, recorder, hook = {**self.kwargs, **extra}, None, None
        if self.log_probs and not kwargs.get("output_logits"):  # record the chosen tokens' log-probabilities only
            beams = kwargs.get("num_beams") or 1
            recorder = BeamTokenLogProbs(beams) if beams > 1 else ChosenTokenLogProbs()
            kwargs["stopping_criteria"] = StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), recorder])
            if beams > 1:
                kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), recorder])
            hook = generating_module(self.model).register_forward_hook(recorder.keep_logits)
        try:
            steps = compiled_steps(generating_module(self.model)) if self.compile else contextlib.nullcontext()
            with self._routed(routing, copies), steps:
                output = self.model.generate(**batch, **kwargs)
                if self.compile:
                    check_static_cache(output, hf_model(self.model))
                return self._candidates(output, batch, per_input=extra.get("num_return_sequences", 1),
                                        recorder=recorder)
        finally:
            if hook is not None:
                hook.remove()

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
                from loramcl.decoding.diverse_beam import generate_diverse_copies

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
                candidates[c * rows + i].hypothesis = k if self.named else None
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
        from loramcl.decoding.diverse_beam import generate_diverse_beam

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

    def _candidates(self, output, batch: dict, per_input: int, recorder: ChosenTokenLogProbs | None = None
                    ) -> list[Candidate]:
        """One Candidate per row of ``output.sequences`` ([N, prompt + L], N = B * per_input, the rows of an input
        consecutive); ``batch``: the inputs of generate; ``recorder``: what recorded the chosen tokens'
        log-probabilities during it. Runs inside the routing that generated ``output``."""
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
        else:  # no step logits (one row per row, diverse beam search): every position after the input is generated
            length = sequences.shape[1] - self._prompt_length(batch)
        generated = sequences[:, sequences.shape[1] - length:]  # [N, L]
        is_eos = torch.isin(generated, torch.tensor(self.eos, device=generated.device, dtype=generated.dtype))
        after_eos = (is_eos.long().cumsum(1) - is_eos.long()) > 0  # [N, L] positions past the first EOS
        alive = ~after_eos if beam_indices is None else (beam_indices >= 0) & ~after_eos  # tokens of the sequence
        log_prob = None
        recorded = recorder.sequence_log_probs(sequences, alive, per_input) if recorder is not None else None  # [N]
        if recorded is not None:
            log_prob = recorded.tolist()
        elif steps is not None and self.log_probs:  # generate kept its step logits (as before issue 41)
            source = beam_indices if beam_indices is not None else torch.arange(len(generated), device=generated.device
                                                                               ).unsqueeze(1).expand_as(generated)
            chosen = torch.stack([token_log_probs(steps[t], generated[:, t], source[:, t].clamp(min=0))
                                  for t in range(length)], dim=1) if length else torch.zeros(generated.shape)  # [N, L]
            log_prob = (chosen.to(alive.device) * alive).sum(dim=1).tolist()  # [N]
        elif self.log_probs:
            log_prob = self._rescore(batch, sequences, alive, per_input)
        keep = alive & ~is_eos
        token_ids = [[token for token, kept in zip(row, mask, strict=True) if kept]  # two host syncs, not one a row
                     for row, mask in zip(generated.tolist(), keep.tolist(), strict=True)]
        texts = (text_tokenizer(self.tokenizer).batch_decode(token_ids, skip_special_tokens=True)
                 if self.tokenizer is not None else [None] * len(token_ids))
        return [Candidate(text, ids, None if log_prob is None else log_prob[n],
                          hypothesis=self.routing if self.named else None)
                for n, (text, ids) in enumerate(zip(texts, token_ids, strict=True))]

    def _rescore(self, batch: dict, sequences: torch.Tensor, alive: torch.Tensor, per_input: int) -> list[float]:
        """log p(generated tokens | input) by one teacher-forced forward, for outputs without step logits.

        sequences: [N, P + L] (N = B * per_input), alive: [N, L] the generated tokens of each sequence (EOS included).
        The chosen tokens' log-probabilities only: an MCL model's forward with labels computes logits at the label
        positions alone; another model keeps the last L + 1 positions' (``logits_to_keep``) and they are read one
        position at a time, in blocks of rows (no fp32 or log-softmax copy of [N, L, V]).
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
        encoder_decoder = is_encoder_decoder(self.model)
        if encoder_decoder:
            inputs["decoder_input_ids"] = sequences[:, :-1]  # position t predicts sequences[:, t + 1]
        else:
            mask = inputs.get("attention_mask")
            mask = torch.ones_like(sequences[:, :prompt]) if mask is None else mask
            mask = torch.cat([mask, alive.to(mask.dtype)], dim=1)  # [N, P + L]
            inputs.update(input_ids=sequences, attention_mask=mask)
            if "position_ids" in accepted:  # as generate numbers left-padded prompts
                inputs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
        if isinstance(self.model, MCLModel):  # in the routing of the generate call (see _candidates)
            labels = sequences[:, prompt:].masked_fill(~alive, IGNORE_INDEX)  # [N, L]
            if not encoder_decoder:
                labels = torch.cat([torch.full_like(sequences[:, :prompt], IGNORE_INDEX), labels], dim=1)
            with torch.no_grad():
                nll = self.model(**inputs, labels=labels, use_cache=False).nll  # [N] mean over the alive tokens
            scores = -nll.float() * alive.sum(dim=1)  # [N], copy-major
        else:
            if "logits_to_keep" in accepted:
                inputs["logits_to_keep"] = length + 1
            with torch.no_grad():
                logits = self.model(**inputs, use_cache=False).logits  # [N, T', V]
            first = logits.shape[1] - length - 1 if not encoder_decoder else prompt - 1  # predicts token `prompt`
            chosen = torch.stack([token_log_probs(logits[:, first + t], sequences[:, prompt + t])
                                  for t in range(length)], dim=1)  # [N, L]
            scores = (chosen * alive).sum(dim=1)  # [N], copy-major
        return scores[torch.argsort(to_copy_major)].tolist()  # [N], input-major

    def _prompt_length(self, batch: dict) -> int:
        """Positions of ``sequences`` that are not generated (used only without step logits)."""
        if is_encoder_decoder(self.model):
            decoder_ids = batch.get("decoder_input_ids")
            return decoder_ids.shape[1] if torch.is_tensor(decoder_ids) else 1  # or the decoder start token
        input_ids = batch.get("input_ids")
        return input_ids.shape[1] if torch.is_tensor(input_ids) else 0  # inputs_embeds only: new tokens only
