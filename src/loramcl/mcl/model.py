"""The MCL model: K LoRA hypotheses on any transformers model, routed by ``use_hypotheses``, and its forward.

Data flow of one MCL forward (labels given, all K hypotheses):
  inputs [B, ...] -> frozen modules that precede every adapter run once on B rows
  -> at the entry of the smallest transformers model holding all adapters, every per-example tensor is
     repeated K times, hypothesis-major [K*B, ...] (DESIGN decision 6; ``loramcl.mcl.copies``)
  -> adapted layers route row block k through hypothesis k (one bmm per layer, decision 2)
  -> the LM head sees only the hidden states at label positions (decision 5)
  -> nll [B, K] (scoring) -> loss (losses).

``MCLModel`` is this module's forward and routing, with its other responsibilities in their own modules:
the K copies' hooks (``loramcl.mcl.copies.BatchCopies``), the forward's memory devices (``loramcl.mcl.logits``),
generation (``loramcl.mcl.generate``), the files (``loramcl.mcl.adapter_files``), PEFT interoperability
(``loramcl.mcl.peft_interop``) and activation checkpointing (``loramcl.mcl.activation_checkpointing``).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.utils import ModelOutput

from loramcl.mcl.activation_checkpointing import ActivationCheckpointing
from loramcl.mcl.adapter_files import (
    SCORING_PREFIX,
    AdapterFiles,
    check_adapters_fit,
    check_scoring_fits,
    checked_mcl_config,
    read_adapter_files,
)
from loramcl.mcl.adapter_size import check_adapter_size
from loramcl.mcl.compat import cache_argument, check_token_ids, checkpointing_keeps_cache, given_cache
from loramcl.mcl.config import MCLConfig
from loramcl.mcl.context import check_context_read, check_split_inputs, is_shared_context, share_context, split_context
from loramcl.mcl.copies import (
    BatchCopies,
    RowsPerExampleUnknown,
    batch_size_of,
    find_branches,
    find_expansion_module,
    find_shared_modules,
)
from loramcl.mcl.fingerprint import base_fingerprint, check_base_weights, known_fingerprint
from loramcl.mcl.generate import HypothesisGeneration
from loramcl.mcl.layers import DISABLED, INDEXED, SINGLE, STACKED, HypothesisRouting, MCLLoraLinear, linear_features
from loramcl.mcl.logits import ForwardMemory
from loramcl.mcl.losses import mcl_loss
from loramcl.mcl.nll import IGNORE_INDEX, aligned_targets, check_targets, chunked_token_nll, mean_token_nll, row_means
from loramcl.mcl.peft_interop import (
    PeftInterop,
    matched_layer_names,
    output_layer_of,
    resolve_target_modules,
    target_layer_names,
)
from loramcl.mcl.scores import HypothesisScores, context_positions, mixture_nll

# Models of the baselines: method in mcl_config.json -> "module:function(base_model, path, saved, tensors,
# is_trainable)" rebuilding the model from checked files; imported on use (loramcl.baselines sits above this module).
_BASELINE_LOADERS = {"moe": "loramcl.baselines.moe:load_from_files",
                     "multihead": "loramcl.baselines.multihead:load_from_files"}


@dataclass
class MCLOutput(ModelOutput):
    """Output of ``MCLModel.forward``.

    loss: the configured MCL loss (scalar), when labels are given.
    nll: [B, K] mean NLL over the label tokens of each example under each hypothesis; [B] when the
        forward ran one hypothesis per example (``hypotheses=``).
    weights: [B, K] the detached assignment q of the loss (one-hot for vanilla WTA).
    logits: [B, K, T, V] when no labels are given.
    log_scores: [B, K] log p(k | c) with ``MCLConfig(scoring=True)`` (all K hypotheses run, labels given).
    mixture_nll: [B] -log sum_k p(k | c) p_k(x | c) per target token, with scores.
    scoring_loss: the scoring head's loss (mean mixture NLL with the hypotheses' NLLs detached); ``loss`` includes
        scoring_weight times it.
    """

    loss: torch.Tensor | None = None
    nll: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    log_scores: torch.Tensor | None = None
    mixture_nll: torch.Tensor | None = None
    scoring_loss: torch.Tensor | None = None


@dataclass
class _PendingForward:
    """What the hooks must do during the next base-model call (cleared by the hook that does it)."""

    expand_batch: int | None = None  # B: repeat per-example inputs K times at the expansion module
    logit_positions: torch.Tensor | None = None  # [rows, T] bool: hidden states the LM head must see
    context_positions: torch.Tensor | None = None  # [rows]: the last context position, whose state the scores read
    context_states: torch.Tensor | None = None  # [rows, d]: those states (detached), filled by the output-layer hook
    # logits in chunks: the output-layer hook keeps the hidden states at label positions [N, d] here and gives the
    # layer only the first of them (a probe row: checks that logits_of reproduces what the model does to them)
    chunked: bool = False
    label_states: torch.Tensor | None = None


class MCLModel(BatchCopies, ForwardMemory, HypothesisGeneration, AdapterFiles, PeftInterop, ActivationCheckpointing,
               nn.Module):
    """A frozen transformers model with K LoRA hypotheses. Build it with ``get_mcl_model``."""

    # Our loss is a mean over examples: let Trainer divide it for gradient accumulation.
    accepts_loss_kwargs = False

    def __init__(self, model: nn.Module, config: MCLConfig, routing: HypothesisRouting,
                 layer_names: list[str]) -> None:
        super().__init__()
        self.base_model = model
        self.mcl_config = config
        self.routing = routing
        self.layer_names = layer_names
        self.training_step = 0  # optimizer step, for the annealed temperature; MCLTrainer keeps it current
        self._pending = _PendingForward()
        self._explicit_routing = 0
        self._adapters_disabled = 0
        self._detached: str | None = None  # how the adapters left the base model: 'merged in place' / 'unloaded'
        self._main_rows: int | None = None  # rows of the base model's main input in the current call
        self._base_requires_grad: list[tuple[nn.Parameter, bool]] = []  # the base's flags before it was frozen
        self.expansion_module_name = find_expansion_module(model, layer_names)
        self.branch_names = find_branches(model, self.expansion_module_name, layer_names)
        output_layer = output_layer_of(model)
        self._output_layer_name = next((n for n, m in model.named_modules() if m is output_layer), None)
        self.shared_module_names = find_shared_modules(model, self.expansion_module_name, layer_names,
                                                        self._output_layer_name)
        # Decoding K copies of a batch runs each shared module (a frozen tower before the adapters) once, on one
        # copy; False runs it on all K copies (the same result, K times the work; for benchmarks).
        self.share_frozen_modules = True
        # adapt_context=False: run the context once on B rows and the targets on K*B rows (loramcl.mcl.context); False
        # computes the same on the full sequence with the adapters masked on the context (the reference, for tests
        # and benchmarks).
        self.context_once = True
        self._shared_calls: dict[int, int] = {}  # id(shared module) -> copies its running call was given
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._generation_context: list[torch.Tensor] | None = None  # armed by capture_context()
        self._unchunkable: str | None = None  # why this model's logits cannot be computed in chunks, once found
        self._whole_batch_warned = False  # examples_per_block met inputs it cannot cut (warned once)
        self.scoring_head = self._build_scoring_head(output_layer) if config.scoring else None
        self._install_hooks()


    @property
    def num_hypotheses(self) -> int:
        return self.mcl_config.num_hypotheses

    @property
    def config(self):  # the base model's transformers config, as Trainer and PEFT users expect
        return self.base_model.config

    def mcl_layers(self) -> Iterator[tuple[str, MCLLoraLinear]]:
        for name in self.layer_names:
            yield name, self.base_model.get_submodule(name)

    def parameter_counts(self) -> tuple[int, int]:
        """(trainable, total) parameter counts."""
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        return trainable, sum(p.numel() for p in self.parameters())

    def print_trainable_parameters(self) -> None:
        trainable, total = self.parameter_counts()
        print(f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f}"
              f" || hypotheses: {self.num_hypotheses}")


    @contextlib.contextmanager
    def use_hypotheses(self, hypotheses: int | torch.Tensor, copies: bool = False) -> Iterator[None]:
        """Run the base model with hypothesis ``k`` on every row (an int), or with ``index[i]`` on example i
        (a LongTensor); e.g. ``with model.use_hypotheses(1): model.generate(...)``. A forward inside the block runs
        those hypotheses too, as PEFT's active adapter: ``model(**inputs)`` gives hypothesis 1's ``logits`` [B, T, V].

        ``copies=True``: the batch is ``len(index)`` identical copies of one batch, copy-major (as
        ``repeat_examples`` makes them), and copy c runs hypothesis ``index[c]``. This routes every adapted layer,
        including towers whose rows per example vary; one hypothesis per example is checked and may be refused
        there (``RowsPerExampleUnknown``).
        """
        self._check_usable()
        saved = copy.copy(self.routing)
        self._set_routing(hypotheses, rows=None, copies=copies)
        self._explicit_routing += 1
        try:
            yield
        finally:
            self._explicit_routing -= 1
            vars(self.routing).update(vars(saved))  # the same object: every layer holds it

    @contextlib.contextmanager
    def disable_adapters(self) -> Iterator[None]:
        """Run the frozen base model, every hypothesis off (as PEFT's ``disable_adapter``), e.g. for a reference
        pass: inside the block, ``model(**inputs, labels=labels)`` returns the base model's ``nll`` [B] and
        ``model.generate(...)`` decodes with the base model."""
        self._check_usable()
        saved = copy.copy(self.routing)
        self.routing.mode, self.routing.index = DISABLED, None
        self._explicit_routing += 1
        self._adapters_disabled += 1
        try:
            yield
        finally:
            self._adapters_disabled -= 1
            self._explicit_routing -= 1
            vars(self.routing).update(vars(saved))

    def _set_routing(self, hypotheses: int | torch.Tensor | None, rows: int | None, copies: bool = False) -> None:
        routing, k_max = self.routing, self.num_hypotheses
        routing.per_copy, routing.rows, routing.copies, self._main_rows = False, None, None, None
        routing.positions = None
        if hypotheses is None:
            routing.mode, routing.index = STACKED, None
        elif isinstance(hypotheses, int) and not isinstance(hypotheses, bool):
            self._check_hypothesis(hypotheses)
            routing.mode, routing.hypothesis, routing.index = SINGLE, hypotheses, None
        elif torch.is_tensor(hypotheses) and not hypotheses.is_floating_point():
            index = hypotheses.flatten().long()
            routing.copies = index.numel() if copies else None
            if rows is not None and index.numel() != rows:
                raise ValueError(f"hypotheses must give one hypothesis per example ({rows}), got {index.numel()}")
            if index.numel() == 0 or int(index.min()) < 0 or int(index.max()) >= k_max:
                raise ValueError(f"hypothesis indices must be in [0, {k_max - 1}], got {hypotheses.tolist()}")
            if bool((index == index[0]).all()):  # one hypothesis for every row: no per-row routing to check
                routing.mode, routing.hypothesis, routing.index = SINGLE, int(index[0]), None
            else:
                routing.mode, routing.index = INDEXED, index.to(self._adapter_device())
                routing.per_copy = copies
        else:
            raise TypeError(f"hypotheses must be None, an int or a LongTensor, got {type(hypotheses).__name__}")

    def _check_hypothesis(self, k: int) -> None:
        if not (isinstance(k, int) and 0 <= k < self.num_hypotheses):
            raise ValueError(f"hypothesis {k!r} does not exist: this model has K={self.num_hypotheses} "
                             f"(0..{self.num_hypotheses - 1})")

    def _adapter_device(self) -> torch.device:
        return next(iter(self.base_model.get_submodule(self.layer_names[0]).adapter_tensors().values())).device

    # ---- forward ----------------------------------------------------------------------------------------

    def forward(self, labels: torch.Tensor | None = None, hypotheses: int | torch.Tensor | None = None,
                examples_per_block: int | None = None, **inputs) -> MCLOutput:
        """Run the hypotheses on a batch.

        labels: [B, T] token ids, -100 where nothing is predicted. With labels, returns ``nll`` and ``loss``.
            An encoder-decoder derives its ``decoder_input_ids`` from them, as the model itself does.
        hypotheses: None runs all K hypotheses on every example (the MCL forward); an int k runs hypothesis
            k only; a LongTensor [B] runs hypothesis ``hypotheses[b]`` on example b (then ``nll`` is [B]).
            Inside ``use_hypotheses(...)`` None runs the hypotheses chosen there (as a PEFT model runs its active
            adapter: ``logits`` [B, T, V], ``nll`` [B]; with ``copies=True`` copy c of the batch runs ``index[c]``).
            Inside ``disable_adapters()``: None, and the frozen base model runs (``nll`` [B]).
        examples_per_block: a forward without gradient of all K hypotheses (labels given, ``hypotheses=None``) runs
            the batch this many examples at a time, K*n rows per call instead of K*B: the same outputs (to float
            rounding) at the peak memory of one block. Two-pass WTA's scoring pass (``MCLTrainer``) uses it. Where
            the inputs cannot be cut by example (items flattened over the batch, e.g. Qwen2-VL's image patches) the
            batch runs whole, with a warning once. None: the batch at once.
        inputs: every other input of the base model (input_ids, attention_mask, pixel_values,
            input_features, decoder_input_ids, ...), passed through untouched.
        """
        self._check_usable()
        check_token_ids(self.base_model, inputs.get("input_ids"))
        if self._adapters_disabled and hypotheses is not None:
            raise ValueError("the adapters are disabled in this block (disable_adapters): leave hypotheses out")
        copies = False
        if hypotheses is None and self._explicit_routing and not self._adapters_disabled:
            hypotheses, copies = self._chosen_hypotheses()
        if examples_per_block is not None:
            self._check_examples_per_block(examples_per_block, labels, hypotheses)
        if labels is None:
            return self._forward_logits(hypotheses, inputs, copies)
        base = self.base_model
        causal = not getattr(base.config, "is_encoder_decoder", False)
        if not causal and "decoder_input_ids" not in inputs and "decoder_inputs_embeds" not in inputs:
            inputs["decoder_input_ids"] = decoder_input_ids_from_labels(base, labels)
        targets = aligned_targets(labels, causal)  # [B, T]
        check_targets(targets)
        positions = targets != IGNORE_INDEX  # [B, T]
        batch = labels.shape[0]
        stacked = hypotheses is None and not self._adapters_disabled
        if not self._adapters_disabled:
            self._set_routing(hypotheses, rows=None if copies else batch, copies=copies)
        if torch.is_tensor(hypotheses) and self.routing.mode == INDEXED:
            try:
                return self._forward_nll(inputs, targets, positions, stacked=False)
            except RowsPerExampleUnknown as error:
                # Exact without knowing the rows of each example: run all K hypotheses (K times the compute)
                # and keep each example's own; the gradient is the same as that of the per-example forward.
                warnings.warn(f"{error} Running all K hypotheses instead and keeping each example's own.",
                              stacklevel=4)  # the caller of model(...), past nn.Module's call wrappers
                index = self.routing.index.to(labels.device)
                self._set_routing(None, rows=batch)
                nll = self._forward_nll(inputs, targets, positions, stacked=True).nll  # [B, K]
                nll = nll.gather(1, index.unsqueeze(1)).squeeze(1)  # [B]
                return MCLOutput(loss=nll.mean(), nll=nll)
        return self._forward_nll(inputs, targets, positions, stacked, examples_per_block)

    def _forward_nll(self, inputs: dict, targets: torch.Tensor, positions: torch.Tensor, stacked: bool,
                     examples_per_block: int | None = None) -> MCLOutput:
        """nll of every example under the routing already set: [B, K] (stacked, with the loss) or [B]; stacked, the
        examples run ``examples_per_block`` at a time (the loss and the scores see them all at once)."""
        if not stacked:
            nll = self._nll_of_rows(inputs, targets, positions, stacked=False)[0]  # [B]
            return MCLOutput(loss=nll.mean(), nll=nll)
        k, batch = self.num_hypotheses, targets.shape[0]
        nll, states = [], []
        for block, block_inputs in self._example_blocks(inputs, batch, examples_per_block):
            block_nll, block_states = self._nll_of_rows(block_inputs, targets[block], positions[block], stacked=True)
            nll.append(block_nll.view(k, -1))  # [K, n]: rows are hypothesis-major within the block
            if block_states is not None:
                states.append(block_states.view(k, -1, block_states.shape[-1]))  # [K, n, d]
        nll = torch.cat(nll, dim=1).T  # [B, K]
        loss, weights = mcl_loss(nll, self.mcl_config, self.training_step)
        if self.scoring_head is None:
            return MCLOutput(loss=loss, nll=nll, weights=weights)
        # The head learns even inside the trainer's no-grad scoring pass of two-pass WTA (its inputs are detached).
        with torch.enable_grad() if self.training else contextlib.nullcontext():
            log_scores = self.scoring_head(torch.cat(states, dim=1))  # [B, K]
            scoring_loss = mixture_nll(log_scores, nll.detach(), positions.sum(dim=1)).mean()
        mixture = mixture_nll(log_scores.detach(), nll.detach(), positions.sum(dim=1))  # [B]
        return MCLOutput(loss=loss + self.mcl_config.scoring_weight * scoring_loss, nll=nll, weights=weights,
                         log_scores=log_scores.detach(), mixture_nll=mixture, scoring_loss=scoring_loss)

    def _nll_of_rows(self, inputs: dict, targets: torch.Tensor, positions: torch.Tensor, stacked: bool
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(nll [rows], with hypothesis scores the hidden states they read [rows, d] else None) of one call of the
        base model under the routing already set: rows K*B hypothesis-major (stacked) or B."""
        base, k, batch = self.base_model, self.num_hypotheses, targets.shape[0]
        given = inputs, targets, positions  # the arguments as passed: an unchunked retry starts again from them
        keep_cache = contextlib.nullcontext()
        if not self.mcl_config.adapt_context and not self._adapters_disabled:
            inputs, targets, positions = self._without_context(inputs, targets, positions, k if stacked else 1)
            keep_cache = checkpointing_keeps_cache(base)
        row_positions = positions.repeat(k, 1) if stacked else positions  # [rows, T]
        scoring = stacked and self.scoring_head is not None
        chunked = self._logits_in_chunks()
        with keep_cache:
            outputs, states, label_states = self._call_base(
                {**inputs, "use_cache": False}, expand_batch=batch if stacked else None,
                logit_positions=row_positions if self._output_layer_name else None,
                context_positions=context_positions(row_positions) if scoring else None, chunked=chunked)
        logits = getattr(outputs, "logits", None)
        if logits is None:
            raise ValueError(f"{type(base).__name__} returns no logits: LoRA-MCL needs a model with a language-"
                             "modeling head (e.g. AutoModelForCausalLM, AutoModelForSeq2SeqLM)")
        token_targets = targets[positions]  # [N_B] in (example, position) order
        if stacked:
            token_targets = token_targets.repeat(k)  # [K*N_B], hypothesis-major like the rows
        rows = row_positions.nonzero()[:, 0]  # [N]
        if chunked:
            logits_of = self._logits_of()
            if not self._reproduces_logits(logits_of, label_states, logits):
                return self._nll_of_rows(*given, stacked)  # again, unchunked from now on
            token_nll = chunked_token_nll(label_states, token_targets, logits_of, self.mcl_config.logits_chunk_size)
            nll = row_means(token_nll, rows, row_positions.shape[0])  # [rows]
        else:
            token_logits = logits if self._output_layer_name else logits[row_positions]  # [N, V]
            nll = mean_token_nll(token_logits, token_targets, rows, row_positions.shape[0])  # [rows]
        return nll, (states if scoring else None)

    def _without_context(self, inputs: dict, targets: torch.Tensor, positions: torch.Tensor, copies: int
                         ) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """adapt_context=False: (inputs, targets [B, L], positions [B, L]) of a call that runs only the target
        positions, attending to the context run once on B rows without adapters (loramcl.mcl.context); or, with
        ``context_once=False``, the full sequence with the adapters masked on the context."""
        base = self.base_model
        if getattr(base.config, "is_encoder_decoder", False):  # the encoder is the context
            return self._encoder_once(inputs), targets, positions
        check_split_inputs(inputs, type(base).__name__)
        lengths = context_positions(positions)  # [B] c_b: positions before the first that predicts a label
        if not self.context_once:
            steps = torch.arange(positions.shape[1], device=positions.device)
            mask = (steps >= lengths.unsqueeze(1)).repeat(copies, 1)  # [rows, T]
            self.routing.positions = mask.unsqueeze(-1).to(self._adapter_dtype())  # [rows, T, 1]
            return inputs, targets, positions
        if int(lengths.max()) == 0:  # every row predicts from its first position: there is no context
            return inputs, targets, positions
        context_inputs, target_inputs, index = split_context(inputs, lengths)
        nothing = torch.zeros_like(context_inputs["input_ids"], dtype=torch.bool)  # no logits on the context
        cache, name = DynamicCache(config=base.config), cache_argument(base)
        with torch.no_grad(), self.disable_adapters(), checkpointing_keeps_cache(base):
            self._call_base({**context_inputs, name: cache, "use_cache": True}, expand_batch=None,
                            logit_positions=nothing if self._output_layer_name else None)
        # recomputing a checkpointed layer finds the shared cache as the forward did
        cache = share_context(cache, copies, length=context_inputs["input_ids"].shape[1])
        targets = torch.where(index >= 0, targets.gather(1, index.clamp(min=0)), IGNORE_INDEX)  # [B, L]
        return {**target_inputs, name: cache}, targets, targets != IGNORE_INDEX

    def _encoder_once(self, inputs: dict) -> dict:
        """An encoder-decoder's inputs with the encoder run once, on B rows without adapters: its outputs go to the
        decoder in place of the encoder's inputs (and are made K-fold where the hypotheses start)."""
        if inputs.get("encoder_outputs") is not None:
            return inputs
        decoder = {name: value for name, value in inputs.items() if name.startswith("decoder_") or name in (
            "use_cache", "attention_mask", "cache", "past_key_values")}
        encoder_inputs = {name: value for name, value in inputs.items() if name not in decoder or
                          name == "attention_mask"}
        with torch.no_grad(), self.disable_adapters():
            encoded = self.base_model.get_encoder()(**encoder_inputs, return_dict=True)
        return {**decoder, "encoder_outputs": encoded}

    def _adapter_dtype(self) -> torch.dtype:
        return next(iter(self.base_model.get_submodule(self.layer_names[0]).adapter_tensors().values())).dtype

    def _chosen_hypotheses(self) -> tuple[int | torch.Tensor, bool]:
        """(hypotheses, copies) that the enclosing ``use_hypotheses`` block set: what a forward inside it runs."""
        routing = self.routing
        if routing.mode == SINGLE:
            return routing.hypothesis, False
        return routing.index, routing.per_copy

    def _forward_logits(self, hypotheses: int | torch.Tensor | None, inputs: dict, copies: bool = False
                        ) -> MCLOutput:
        if not self.mcl_config.adapt_context and not self._adapters_disabled:
            raise ValueError("adapt_context=False: the adapters act from the first position that predicts a label on, "
                             "so the forward needs labels to know where the context ends; pass labels (the output "
                             "then holds nll), or decode with generate")
        batch = batch_size_of(inputs)
        stacked = hypotheses is None and not self._adapters_disabled
        if not self._adapters_disabled:
            self._set_routing(hypotheses, rows=None if copies else batch, copies=copies)
        logits = self._call_base(inputs, expand_batch=batch if stacked else None)[0].logits  # [K*B|B, T, V]
        if stacked:
            logits = logits.view(self.num_hypotheses, batch, *logits.shape[1:]).transpose(0, 1)  # [B, K, T, V]
        return MCLOutput(logits=logits)

    def _call_base(self, inputs: dict, expand_batch: int | None, logit_positions: torch.Tensor | None = None,
                   context_positions: torch.Tensor | None = None, chunked: bool = False) -> tuple:
        """Run the base model with the hooks armed for this call, and check that they fired: (outputs, the hidden
        states at ``context_positions`` [rows, d] or None, with ``chunked`` the hidden states at ``logit_positions``
        [N, d] else None)."""
        self._pending = _PendingForward(expand_batch, logit_positions, context_positions, chunked=chunked)
        try:
            outputs = self.base_model(**inputs)
            self._check_hooks_ran()
            cache = given_cache(inputs)
            if is_shared_context(cache):
                check_context_read(cache, self.base_model)
            return outputs, self._pending.context_states, self._pending.label_states
        finally:
            self._pending = _PendingForward()

    def _check_hooks_ran(self) -> None:
        if self._pending.expand_batch is not None:
            raise RuntimeError(
                f"the batch was never duplicated for the K hypotheses: module '{self.expansion_module_name}' did not "
                "run during this forward. Please report this model class to loramcl.")
        if self._pending.logit_positions is not None:
            raise RuntimeError(f"the output layer '{self._output_layer_name}' did not run during this forward")

    def _build_scoring_head(self, output_layer: nn.Module | None) -> HypothesisScores:
        if output_layer is None or getattr(output_layer, "weight", None) is None or output_layer.weight.dim() != 2:
            raise ValueError(f"scoring=True reads the hidden state the output layer receives; "
                             f"{type(self.base_model).__name__} has no output layer with a weight matrix")
        hidden_size = output_layer.weight.shape[1]  # nn.Linear's weight is [V, d]
        return HypothesisScores(self.num_hypotheses, hidden_size, device=self._adapter_device())

    def _check_usable(self) -> None:
        if self._detached:
            raise RuntimeError(f"this MCLModel's adapters were {self._detached}; use the returned base model, or "
                               "load the adapters again with load_mcl_model")


def decoder_input_ids_from_labels(model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """The decoder inputs an encoder-decoder builds itself when given only labels (teacher forcing): its
    ``prepare_decoder_input_ids_from_labels`` (T5, BART, Marian, mBART, Pegasus), else its module's
    ``shift_tokens_right(labels, pad_token_id, decoder_start_token_id)`` as its forward calls it (Whisper)."""
    if hasattr(model, "prepare_decoder_input_ids_from_labels"):
        return model.prepare_decoder_input_ids_from_labels(labels=labels)
    shift = getattr(sys.modules.get(type(model).__module__), "shift_tokens_right", None)
    config = model.config
    start, pad = getattr(config, "decoder_start_token_id", None), getattr(config, "pad_token_id", None)
    if shift is not None and len(inspect.signature(shift).parameters) == 3:
        if start is None or pad is None:
            raise ValueError(f"{type(model).__name__} derives decoder inputs from labels with its config's "
                             f"decoder_start_token_id ({start}) and pad_token_id ({pad}): set both in its config, "
                             "or pass decoder_input_ids")
        return shift(labels, pad, start)
    raise ValueError(f"pass decoder_input_ids: {type(model).__name__} has no rule to derive them from labels")


def get_mcl_model(model: nn.Module, config: MCLConfig) -> MCLModel:
    """Give ``model`` (any transformers model, modified in place) K LoRA hypotheses on the target layers.

    Every base parameter is frozen; only the adapters train. Quantized base layers are refused. If anything fails,
    the model is left as it was.
    """
    routing = HypothesisRouting()
    adapter_dtype = torch.float32 if config.adapter_dtype == "float32" else None
    names = target_layer_names(model, config)
    check_adapter_size(model, names, config)
    return replace_modules(model, names, lambda layer: MCLLoraLinear(
        layer, routing, config.num_hypotheses, config.r, config.alpha, config.dropout, adapter_dtype=adapter_dtype,
        use_rslora=config.use_rslora), lambda names: MCLModel(model, config, routing, names))


def replace_modules(model: nn.Module, names: list[str], make_module, make_model):
    """Freeze ``model``, replace each module ``names[i]`` with ``make_module(module)`` and return
    ``make_model(names)``; if anything fails, the model is left as it was."""
    originals = {name: model.get_submodule(name) for name in names}
    fingerprint = base_fingerprint(model)  # of the base weights as they are now, before any adapter is added
    trainable = [(param, param.requires_grad) for param in model.parameters()]
    try:
        for param in model.parameters():
            param.requires_grad_(False)
        for name, module in originals.items():
            model.set_submodule(name, make_module(module))
        wrapped = make_model(names)
        wrapped._base_requires_grad = trainable  # for unload(): the base model as it was
        wrapped._base_fingerprint = fingerprint  # written by save_pretrained, checked by load_adapters
        return wrapped
    except BaseException:
        for name, module in originals.items():  # roll back: the caller's model must not stay half-wrapped
            model.set_submodule(name, module)
        for param, flag in trainable:
            param.requires_grad_(flag)
        raise


def load_mcl_model(model: nn.Module, path: str | os.PathLike, is_trainable: bool = False,
                   verify: bool = True, fit_scores: bool = False, strict: bool = False) -> MCLModel:
    """Rebuild the MCL model saved in ``path`` on top of ``model`` (the same base model it was trained on).

    As with PEFT, the adapters are frozen unless ``is_trainable=True`` (to continue training). The files are read
    and checked against ``model`` (layer names and shapes, the weights' checksum unless ``verify=False``, finite
    values) before ``model`` is touched, so a failed load leaves it as it was.

    ``fit_scores=True``: to learn the hypothesis scores p(k | c) of a run trained without them (or to refit them):
    the scoring head is trainable (a new zero one, p uniform, when the run has none) and the hypotheses stay frozen.
    The head's loss never reaches the hypotheses (docs/scores.md), so this fits the scores that joint training would
    fit for the final hypotheses.

    Adapters saved on a base model of the same class but other weights (their ``base_fingerprint`` differs from
    ``model``'s, see ``loramcl.mcl.fingerprint``) give a warning naming both; so do files that cannot be verified (no
    checksum of the weights or of the settings, no fingerprint) and tensors converted after save
    (``loramcl.mcl.adapter_files``). ``strict=True`` makes each of these an error. An edited setting that changes the
    outputs (alpha, use_rslora, adapt_context, ...) is always an error.
    """
    saved, tensors = read_adapter_files(path, verify, strict)
    if isinstance(model, MCLModel):
        raise ValueError("this model already has MCL adapters: load onto the plain base model")
    if saved.get("base_model_class") not in (None, type(model).__name__):
        warnings.warn(f"adapters were trained on a {saved['base_model_class']}, loading onto a "
                      f"{type(model).__name__}", stacklevel=2)
    method = saved.get("method", "mcl")
    if method in _BASELINE_LOADERS:  # a baseline (loramcl.baselines) checks and rebuilds its own layers
        module, _, loader = _BASELINE_LOADERS[method].partition(":")
        return getattr(importlib.import_module(module), loader)(model, path, saved, tensors, is_trainable, strict)
    config = checked_mcl_config(path, saved, tensors)
    if fit_scores and not config.scoring:
        config = replace(config, scoring=True)
        tensors = {name: value for name, value in tensors.items() if not name.startswith(f"{SCORING_PREFIX}.")}
    targets = resolve_target_modules(model, config)
    names = matched_layer_names(model, targets, config)
    check_adapters_fit(path, saved, config, tensors, names,
                        {name: linear_features(model.get_submodule(name)) for name in names})
    if config.scoring:
        check_scoring_fits(path, tensors, None, hidden_size=output_layer_of(model).weight.shape[1])
    fingerprint = check_base_weights(path, saved, model, strict)  # shapes fit: are the values the same?
    with known_fingerprint(model, fingerprint):
        mcl = get_mcl_model(model, config)
    with torch.no_grad():
        for name, layer in mcl.mcl_layers():
            layer.lora_A.copy_(tensors[f"{name}.lora_A"])
            layer.lora_B.copy_(tensors[f"{name}.lora_B"])
            layer.lora_A.requires_grad_(is_trainable)
            layer.lora_B.requires_grad_(is_trainable)
    mcl._copy_scoring_head(tensors)
    if mcl.scoring_head is not None:
        mcl.scoring_head.requires_grad_(is_trainable or fit_scores)
    return mcl


