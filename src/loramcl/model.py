"""Wrap any transformers model with K LoRA hypotheses: routing, the MCL forward, and the files.

Data flow of one MCL forward (labels given, all K hypotheses):
  inputs [B, ...] -> frozen modules that precede every adapter run once on B rows
  -> at the entry of the smallest transformers model holding all adapters, every per-example tensor is
     repeated K times, hypothesis-major [K*B, ...] (DESIGN decision 6)
  -> adapted layers route row block k through hypothesis k (one bmm per layer, decision 2)
  -> the LM head sees only the hidden states at label positions (decision 5)
  -> nll [B, K] (scoring) -> loss (losses).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib
import inspect
import json
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import safetensors.torch
import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.pytorch_utils import Conv1D
from transformers.utils import ModelOutput

from loramcl.config import MCLConfig
from loramcl.context import check_context_read, check_split_inputs, is_shared_context, share_context, split_context
from loramcl.fingerprint import base_fingerprint, check_base_weights
from loramcl.layers import DISABLED, INDEXED, SINGLE, STACKED, HypothesisRouting, MCLLoraLinear, linear_features
from loramcl.losses import mcl_loss
from loramcl.scores import HypothesisScores, context_positions, mixture_nll
from loramcl.scoring import IGNORE_INDEX, aligned_targets, check_targets, chunked_token_nll, mean_token_nll, row_means
from loramcl.token_ids import check_token_ids
from loramcl.upstream import (
    cache_argument,
    checkpointing_keeps_cache,
    given_cache,
    peft_default_targets,
    peft_targets,
    upstream_error,
)

CONFIG_NAME = "mcl_config.json"
WEIGHTS_NAME = "mcl_adapters.safetensors"
FORMAT_VERSION = 1
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"
SCORING_PREFIX = "scoring"  # the scoring head's tensors in mcl_adapters.safetensors: scoring.weight, scoring.bias

# Models of the baselines: method in mcl_config.json -> "module:function(base_model, path, saved, tensors,
# is_trainable)" rebuilding the model from checked files; imported on use (loramcl.baselines sits above this module).
_BASELINE_LOADERS = {"moe": "loramcl.baselines.moe:load_from_files",
                     "multihead": "loramcl.baselines.multihead:load_from_files"}
# Keyword inputs that never carry a batch dimension even when one of their sizes happens to equal B.
_NOT_PER_EXAMPLE = frozenset({"cache_position"})
_ADAPTABLE = (nn.Linear, Conv1D)


def _batch_dim(name: str | None, value: torch.Tensor) -> int:
    """The dimension of a per-example model input that runs over the examples.

    transformers' inputs are batch-first, except multimodal rotary positions (M-RoPE, Qwen2-VL and its
    successors): ``position_ids`` of shape [3 or 4, B, T]. This is the rule transformers itself applies when it
    copies inputs for beam search (``GenerationMixin._expand_inputs_for_generation``).
    """
    return 1 if name is not None and name.endswith("position_ids") and value.dim() == 3 else 0


def _map_input(value, leaf, name: str | None = None):
    """``leaf(item, name)`` for every item of a model input, through dicts, lists, tuples (namedtuples too) and
    ``ModelOutput``s, each item named by its key (a list's items by the list's name)."""
    if isinstance(value, ModelOutput):
        return type(value)(**{key: _map_input(item, leaf, key) for key, item in value.items()})
    if isinstance(value, dict):
        return type(value)((key, _map_input(item, leaf, key)) for key, item in value.items())
    if isinstance(value, list | tuple):
        items = [_map_input(item, leaf, name) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return leaf(value, name)


def _examples_dim(value: torch.Tensor, name: str | None, batch: int) -> int | None:
    """The dimension of a tensor input that runs over the ``batch`` examples (``_batch_dim``); None where the tensor is
    not per example: 0-dimensional, named in ``_NOT_PER_EXAMPLE``, or a broadcast (size 1 there while B > 1)."""
    if value.dim() == 0 or name in _NOT_PER_EXAMPLE:
        return None
    dim = _batch_dim(name, value)
    return None if value.shape[dim] == 1 and batch != 1 else dim


def repeat_examples(value, copies: int, batch: int, name: str | None = None):
    """``copies`` copies of a model input, copy-major: copy c of a batch-first tensor [B, ...] is rows
    c*B ... (c+1)*B - 1 of the result [copies*B, ...]. The one K-copy rule (DESIGN decision 9), for any input:

    - dicts, lists, tuples and ``ModelOutput``s: every element (e.g. Gemma3's dict of attention masks);
    - a tensor: repeated along its batch dimension (``_batch_dim``), except when it has size 1 there while
      B > 1 (broadcast over the batch, e.g. positions [1, T]) or is named in ``_NOT_PER_EXAMPLE``. A tensor
      whose first size is not B holds per-example items flattened over the batch in example order (Qwen2-VL's
      image patches [N, d] with ``image_grid_thw`` [n_images, 3]; all images or crops of a LLaVA batch):
      repeating it copy-major keeps copy c's items in the order of copy c's placeholder tokens;
    - anything else (None, numbers, strings, an empty cache) as it is. A cache holding past keys and values is
      refused: its layout is the model's own.
    """
    if copies == 1:
        return value

    def repeat(item, key: str | None):
        if torch.is_tensor(item):
            dim = _examples_dim(item, key, batch)
            if dim is None:
                return item
            if dim != 0 and item.shape[dim] != batch:
                raise ValueError(f"input {key!r} of shape {tuple(item.shape)} should have the batch ({batch}) on "
                                 f"dimension {dim}: its K copies cannot be made")
            return item.repeat(*(copies if d == dim else 1 for d in range(item.dim())))
        if is_shared_context(item):  # the context computed once: its cache makes its copies itself (loramcl.context)
            return item
        if isinstance(item, Cache) and item.get_seq_length() > 0:
            raise ValueError(f"input {key!r} is a cache of past keys and values: its K copies cannot be made; run "
                             "the hypotheses on the full inputs instead")
        return item

    return _map_input(value, repeat, name)


def select_examples(value, block: slice, batch: int, name: str | None = None):
    """Examples ``block`` of a model input of ``batch`` examples (two-pass WTA's scoring pass in blocks), by the
    rules of ``repeat_examples``: a tensor is sliced along its batch dimension, kept where it is not per example;
    anything else stays as it is. Raises ``ExamplesNotSeparable`` where the examples' rows cannot be told apart: a
    tensor whose batch dimension is not ``batch`` (items flattened over the batch, e.g. Qwen2-VL's image patches)
    or a cache.
    """
    def select(item, key: str | None):
        if torch.is_tensor(item):
            dim = _examples_dim(item, key, batch)
            if dim is None:
                return item
            if item.shape[dim] != batch:
                raise ExamplesNotSeparable(f"input {key!r} of shape {tuple(item.shape)} has {item.shape[dim]} rows "
                                           f"for {batch} examples (items flattened over the batch)")
            return item[(slice(None),) * dim + (block,)]
        if isinstance(item, Cache):
            raise ExamplesNotSeparable(f"input {key!r} is a cache, whose rows are the model's own")
        return item

    return _map_input(value, select, name)


class ExamplesNotSeparable(ValueError):
    """The inputs of a batch cannot be cut into blocks of examples from their shapes."""


class RowsPerExampleUnknown(RuntimeError):
    """Rows of an adapted module cannot be assigned to examples (e.g. a different number of image patches per
    example in a vision tower), so one hypothesis per example cannot be routed there."""


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


class MCLModel(nn.Module):
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
        self.expansion_module_name = _expansion_module_name(model, layer_names)
        self.branch_names = _branch_names(model, self.expansion_module_name, layer_names)
        output_layer = _output_layer(model)
        self._output_layer_name = next((n for n, m in model.named_modules() if m is output_layer), None)
        self.shared_module_names = _shared_module_names(model, self.expansion_module_name, layer_names,
                                                        self._output_layer_name)
        # Decoding K copies of a batch runs each shared module (a frozen tower before the adapters) once, on one
        # copy; False runs it on all K copies (the same result, K times the work; for benchmarks).
        self.share_frozen_modules = True
        # adapt_context=False: run the context once on B rows and the targets on K*B rows (loramcl.context); False
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

    # ---- properties -------------------------------------------------------------------------------------

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

    # ---- routing ----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def use_hypotheses(self, hypotheses: int | torch.Tensor, copies: bool = False) -> Iterator[None]:
        """Run the base model with hypothesis ``k`` on every row (an int), or with ``index[i]`` on example i
        (a LongTensor); e.g. ``with model.use_hypotheses(1): model.generate(...)``.

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

    # ---- hooks ------------------------------------------------------------------------------------------

    def _install_hooks(self) -> None:
        expansion = self.base_model.get_submodule(self.expansion_module_name)
        self._hooks.append(self.base_model.register_forward_pre_hook(self._record_main_rows, with_kwargs=True))
        self._hooks.append(expansion.register_forward_pre_hook(self._expand_rows, with_kwargs=True))
        for name in self.shared_module_names:
            module = self.base_model.get_submodule(name)
            self._hooks.append(module.register_forward_pre_hook(self._run_on_one_copy, with_kwargs=True))
            self._hooks.append(module.register_forward_hook(self._copy_outputs, with_kwargs=True))
        for name in self.branch_names:
            check = functools.partial(self._check_rows_per_example, name)
            self._hooks.append(self.base_model.get_submodule(name).register_forward_pre_hook(check, with_kwargs=True))
        if self._output_layer_name is not None:
            output_layer = self.base_model.get_submodule(self._output_layer_name)
            self._hooks.append(output_layer.register_forward_pre_hook(self._keep_label_positions))

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _expand_rows(self, module: nn.Module, args: tuple, kwargs: dict):
        """Make the K copies of every per-example input, hypothesis-major: [B, ...] -> [K*B, ...]."""
        batch = self._pending.expand_batch
        if batch is None:
            return None
        self._pending.expand_batch = None
        k = self.num_hypotheses
        self.routing.rows = k * batch
        return repeat_examples(args, k, batch), {n: repeat_examples(v, k, batch, n) for n, v in kwargs.items()}

    def _run_on_one_copy(self, module: nn.Module, args: tuple, kwargs: dict):
        """While the batch is C identical copies (decoding, ``use_hypotheses(index, copies=True)``), give a shared
        module only the first copy: every per-example input [C*N, ...] -> [N, ...] (a size-1 broadcast stays). The
        copies are checked to be equal, so the module runs on all of them whenever they are not (no silent
        misroute): e.g. inputs that differ per hypothesis."""
        copies = self.routing.copies
        self._shared_calls[id(module)] = 1
        if not self.share_frozen_modules or not copies or copies < 2:
            return None
        tensors = list(_tensor_inputs(args, kwargs))
        one_copy = all(value.shape[0] == 1 or value.shape[0] % copies == 0 and _equal_copies(value, copies)
                       for _, value in tensors) and any(value.shape[0] > 1 for _, value in tensors)
        if not one_copy:
            return None
        self._shared_calls[id(module)] = copies
        return _first_copy(args, copies), _first_copy(kwargs, copies)

    def _copy_outputs(self, module: nn.Module, args: tuple, kwargs: dict, output):
        """The shared module's outputs on one copy, repeated for the C copies (copy-major, as ``repeat_examples``)."""
        copies = self._shared_calls.pop(id(module), 1)
        if copies == 1:
            return None
        rows = next((v.shape[0] for _, v in _tensor_inputs(args, kwargs) if v.shape[0] > 1), 1)  # of one copy
        return repeat_examples(output, copies, rows)

    def _record_main_rows(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = kwargs if kwargs else dict(zip(("input_ids",), args, strict=False))
        self._main_rows = _batch_size(inputs, strict=False)

    def _check_rows_per_example(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """With one hypothesis per example (indexed routing, not copies), the adapted layers of ``name`` give each
        example rows/E consecutive rows. That is right only if the module's main input (its first per-example
        tensor that is not a broadcast: hidden states, pixel values, audio features) has one row per example (E, or
        the E*beams rows of beam search); image patches or crops whose number varies per example cannot be assigned
        to their examples from their shapes, so they are refused, not misrouted."""
        routing = self.routing
        if routing.mode != INDEXED or routing.per_copy:
            return
        examples = routing.index.numel()
        for input_name, value in _tensor_inputs(args, kwargs):
            size = value.shape[_batch_dim(input_name, value)]
            if size == 1:  # a broadcast over the batch tells nothing
                continue
            if size not in (examples, self._main_rows or examples):
                raise RowsPerExampleUnknown(
                    f"one hypothesis per example cannot be routed in '{name}': its input {input_name or '#0'} has "
                    f"{size} rows for {examples} examples (e.g. image patches or crops whose number varies per "
                    "example), so its rows cannot be assigned to examples. Decode all hypotheses at once "
                    "(generate_hypotheses, use_hypotheses(index, copies=True)), one hypothesis for every row "
                    "(use_hypotheses(k)), or keep adapters out of that module (target_modules).")
            return

    def _keep_label_positions(self, module: nn.Module, args: tuple):
        """Give the LM head only the hidden states that predict a label: [rows, T, d] -> [N, d]."""
        hidden = args[0]
        if self._generation_context is not None and not self._generation_context:
            # the prefill of a generate: the last position is the last context position of every row
            self._generation_context.append(hidden[:, -1].detach())  # [rows, d]
        positions = self._pending.logit_positions
        if positions is None:
            return None
        self._pending.logit_positions = None
        if tuple(hidden.shape[:2]) != tuple(positions.shape):
            raise RuntimeError(
                f"the output layer received hidden states of shape {tuple(hidden.shape)} but the labels give "
                f"{tuple(positions.shape)} (rows, positions); labels must be aligned with the sequence the model "
                "processes (e.g. image/audio tokens already expanded in input_ids, as current processors do).")
        if self._pending.context_positions is not None:
            rows = torch.arange(hidden.shape[0], device=hidden.device)
            self._pending.context_states = hidden[rows, self._pending.context_positions].detach()  # [rows, d]
        if self._pending.chunked:
            self._pending.label_states = hidden[positions]  # [N, d]
            return (self._pending.label_states[:1], *args[1:])  # the probe row
        return (hidden[positions], *args[1:])

    # ---- forward ----------------------------------------------------------------------------------------

    def forward(self, labels: torch.Tensor | None = None, hypotheses: int | torch.Tensor | None = None,
                examples_per_block: int | None = None, **inputs) -> MCLOutput:
        """Run the hypotheses on a batch.

        labels: [B, T] token ids, -100 where nothing is predicted. With labels, returns ``nll`` and ``loss``.
            An encoder-decoder derives its ``decoder_input_ids`` from them, as the model itself does.
        hypotheses: None runs all K hypotheses on every example (the MCL forward); an int k runs hypothesis
            k only; a LongTensor [B] runs hypothesis ``hypotheses[b]`` on example b (then ``nll`` is [B]).
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
        if examples_per_block is not None:
            self._check_examples_per_block(examples_per_block, labels, hypotheses)
        if labels is None:
            return self._forward_logits(hypotheses, inputs)
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
            self._set_routing(hypotheses, rows=batch)
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

    def _check_examples_per_block(self, examples_per_block, labels: torch.Tensor | None, hypotheses) -> None:
        if isinstance(examples_per_block, bool) or not isinstance(examples_per_block, int) or examples_per_block < 1:
            raise ValueError(f"examples_per_block must be a number of examples >= 1 or None, got "
                             f"{examples_per_block!r}")
        if labels is None or hypotheses is not None or self._adapters_disabled:
            raise ValueError("examples_per_block cuts the forward of all K hypotheses with labels (hypotheses=None, "
                             "adapters enabled) into blocks of examples; leave it out here")
        if torch.is_grad_enabled():
            raise ValueError("examples_per_block lowers the peak memory of a forward without gradient (two-pass "
                             "WTA's scoring pass); with gradients every block's activations stay alive until the "
                             "backward, so blocks save nothing: run it under torch.no_grad(), or leave it out")

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

    def _example_blocks(self, inputs: dict, batch: int, examples_per_block: int | None
                        ) -> list[tuple[slice, dict]]:
        """(examples, their inputs) of each block; the whole batch where it is one block or cannot be cut."""
        if examples_per_block is None or examples_per_block >= batch:
            return [(slice(None), inputs)]
        blocks = [slice(start, start + examples_per_block) for start in range(0, batch, examples_per_block)]
        try:
            return [(block, select_examples(inputs, block, batch)) for block in blocks]
        except ExamplesNotSeparable as error:
            if not self._whole_batch_warned:
                self._whole_batch_warned = True
                warnings.warn(f"{error}: the forward of all K hypotheses runs the batch whole, not "
                              f"{examples_per_block} example{'s' if examples_per_block > 1 else ''} at a time (the "
                              "same result, a higher peak memory); examples_per_block=None (MCLTrainer: "
                              "scoring_examples_per_block=None) asks for the whole batch", stacklevel=5)
            return [(slice(None), inputs)]

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
        positions, attending to the context run once on B rows without adapters (loramcl.context); or, with
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

    def _forward_logits(self, hypotheses: int | torch.Tensor | None, inputs: dict) -> MCLOutput:
        if not self.mcl_config.adapt_context and not self._adapters_disabled:
            raise ValueError("adapt_context=False: the adapters act from the first position that predicts a label on, "
                             "so the forward needs labels to know where the context ends; pass labels (the output "
                             "then holds nll), or decode with generate")
        batch = _batch_size(inputs)
        stacked = hypotheses is None and not self._adapters_disabled
        if not self._adapters_disabled:
            self._set_routing(hypotheses, rows=batch)
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

    # ---- logits in chunks (MCLConfig.logits_chunk_size) --------------------------------------------------------

    def _logits_in_chunks(self) -> bool:
        """Whether this forward computes the vocabulary logits and their cross-entropy chunk by chunk: asked for, an
        output layer that is found and frozen (its weight would get no gradient), and no transformation of the
        logits that ``_logits_of`` fails to reproduce."""
        if self.mcl_config.logits_chunk_size is None or self._output_layer_name is None or self._unchunkable:
            return False
        layer = self.base_model.get_submodule(self._output_layer_name)
        return not any(param.requires_grad for param in layer.parameters())

    def _logits_of(self):
        """hidden states at label positions [n, d] -> the logits [n, V] the model returns for them: its output layer,
        then what transformers' models apply after it: BART-family ``final_logits_bias`` (added), Gemma-family
        ``final_logit_softcapping`` (cap * tanh(logits / cap)), in their own order of operations."""
        base = self.base_model
        layer = base.get_submodule(self._output_layer_name)
        bias = getattr(base, "final_logits_bias", None)  # [1, V]
        text_config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
        cap = getattr(text_config, "final_logit_softcapping", None)

        def logits_of(states: torch.Tensor) -> torch.Tensor:
            logits = layer(states)  # [n, V]
            if torch.is_tensor(bias):
                logits = logits + bias.to(logits.device)
            if cap is not None:
                logits = torch.tanh(logits / cap) * cap
            return logits

        return logits_of

    def _reproduces_logits(self, logits_of, label_states: torch.Tensor, probe: torch.Tensor) -> bool:
        """Whether ``logits_of`` gives exactly the logits the model returned for the probe row (the first label
        position); if not, warn once and compute the full logits from now on (any other post-processing of the
        logits, e.g. Cohere's logit_scale or Granite's logits_scaling, is the model's own)."""
        with torch.no_grad():
            ours = logits_of(label_states[:1])  # [1, V]
        # NaN where the model's logits are NaN too (a diverged step is the NaN guard's business, not a different model)
        if probe.numel() == ours.numel() and torch.allclose(probe.detach().reshape(ours.shape).to(ours.dtype), ours,
                                                            rtol=0, atol=0, equal_nan=True):
            return True
        self._unchunkable = (f"{type(self.base_model).__name__} transforms the output of its output layer in a way "
                             "loramcl does not reproduce")
        warnings.warn(f"{self._unchunkable}: its logits are computed whole ([N label tokens, V]), not in chunks of "
                      f"MCLConfig.logits_chunk_size={self.mcl_config.logits_chunk_size}. Please report this model "
                      "class to loramcl.", stacklevel=4)
        return False

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

    @contextlib.contextmanager
    def capture_context(self) -> Iterator[list[torch.Tensor]]:
        """Record the hidden state at the last position of every row of the next output-layer call (a generate's
        prefill: the last context position), without another forward; the list holds [rows, d] after the block."""
        captured: list[torch.Tensor] = []
        self._generation_context = captured
        try:
            yield captured
        finally:
            self._generation_context = None

    def _check_usable(self) -> None:
        if self._detached:
            raise RuntimeError(f"this MCLModel's adapters were {self._detached}; use the returned base model, or "
                               "load the adapters again with load_mcl_model")

    def generate(self, *args, **kwargs):
        """``base_model.generate`` with the hypotheses chosen by an enclosing ``use_hypotheses`` block."""
        self._check_usable()
        check_token_ids(self.base_model, kwargs.get("input_ids", args[0] if args else None))
        if not self._explicit_routing:
            raise RuntimeError("choose the hypotheses to decode: `with model.use_hypotheses(k): model.generate(...)`")
        if self.mcl_config.adapt_context or self._adapters_disabled:
            return self.base_model.generate(*args, **kwargs)
        return self._generate_without_context(*args, **kwargs)

    def _generate_without_context(self, input_ids: torch.Tensor | None = None, **kwargs):
        """adapt_context=False decoding: the adapters act from the prompt's last position (whose output predicts the
        first new token) on. The prompt minus its last token is run once, on one copy of the batch when it holds
        identical copies (decoding K hypotheses at once), without adapters; generate goes on from that shared cache
        for every copy and beam. ``context_once=False``: the full prefill with the adapters masked on the context."""
        if getattr(self.base_model.config, "is_encoder_decoder", False):
            return self._generate_encoder_once(input_ids, **kwargs)
        check_split_inputs({"input_ids": input_ids, **{n: v for n, v in kwargs.items() if torch.is_tensor(v)}},
                           type(self.base_model).__name__)
        if given_cache(kwargs) is not None or kwargs.get("use_cache") is False:
            raise ValueError("adapt_context=False decodes from its own cache of the prompt: leave the cache "
                             "(cache / past_key_values) and use_cache out")
        rows, length = input_ids.shape
        mask = kwargs.get("attention_mask")
        mask = torch.ones_like(input_ids) if mask is None else mask  # [R, T], prompts left-padded
        if not self.context_once:
            hook = self.base_model.register_forward_pre_hook(
                functools.partial(self._mask_prompt, length, generating=True), with_kwargs=True)
            try:
                return self.base_model.generate(input_ids=input_ids, **kwargs)
            finally:
                hook.remove()
                self.routing.positions = None
        if length == 1:  # the prompt is its last token: no context
            return self.base_model.generate(input_ids=input_ids, **kwargs)
        copies = self.routing.copies or 1
        if copies > 1 and not (rows % copies == 0 and _equal_copies(input_ids, copies) and _equal_copies(mask, copies)):
            copies = 1
        batch = rows // copies
        positions = kwargs.get("position_ids")
        if positions is None:  # as generate numbers left-padded prompts
            positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        cache, name = DynamicCache(config=self.base_model.config), cache_argument(self.base_model)
        context = {"input_ids": input_ids[:batch, :-1], "attention_mask": mask[:batch, :-1],
                   "position_ids": positions[:batch, :-1], name: cache, "use_cache": True}
        nothing = torch.zeros_like(context["input_ids"], dtype=torch.bool)  # no logits on the context
        capture, self._generation_context = self._generation_context, None  # scores read the last prompt position
        try:
            with torch.no_grad(), self.disable_adapters():
                self._call_base(context, expand_batch=None,
                                logit_positions=nothing if self._output_layer_name else None)
        finally:
            self._generation_context = capture
        cache = share_context(cache, copies, length=length - 1, keep=True)
        def check_first_step(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
            check.remove()
            _check_first_step(cache, length - 1, module, args, kwargs)

        check = self.base_model.register_forward_hook(check_first_step, with_kwargs=True)
        try:
            return self.base_model.generate(input_ids=input_ids, **{name: cache}, **kwargs)
        finally:
            check.remove()

    @contextlib.contextmanager
    def context_masked(self, inputs: dict, prompt_length: int) -> Iterator[dict]:
        """A teacher-forced forward of prompts (left-padded to ``prompt_length``) followed by generated tokens, as
        adapt_context=False decodes them: yields the inputs to give the base model inside the block (the adapters
        masked before the prompt's last position; an encoder-decoder's encoder run without them). As it is with
        adapt_context=True."""
        if self.mcl_config.adapt_context or self._adapters_disabled:
            yield inputs
        elif getattr(self.base_model.config, "is_encoder_decoder", False):
            yield self._encoder_once(inputs)
        else:
            saved = self.routing.positions
            self._mask_prompt(prompt_length, self.base_model, (), inputs)
            try:
                yield inputs
            finally:
                self.routing.positions = saved

    def _mask_prompt(self, prompt_length: int, module: nn.Module, args: tuple, kwargs: dict,
                     generating: bool = False) -> None:
        """Before each forward of a generate (``generating``) or of a teacher-forced sequence: the adapters masked on
        the positions before the prompt's last."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        past = given_cache(kwargs)
        start = past.get_seq_length() if past is not None else 0
        if generating and start == 0 and ids.shape[1] < prompt_length:
            # a step after the prefill whose cache we cannot see: positions would be counted from 0
            raise upstream_error(f"generate gave {type(module).__name__} {ids.shape[1]} new token(s) of a "
                                 f"{prompt_length}-token prompt and no cache under any of cache / past_key_values",
                                 "decode with MCLModel.context_once = True (the default)")
        adapted = torch.arange(start, start + ids.shape[1], device=ids.device) >= prompt_length - 1  # [n]
        self.routing.positions = None if bool(adapted.all()) else (
            adapted.expand(ids.shape[0], -1).unsqueeze(-1).to(self._adapter_dtype()))  # [rows, n, 1]

    def _generate_encoder_once(self, input_ids: torch.Tensor | None = None, **kwargs):
        """An encoder-decoder: the encoder runs once without adapters (on one copy of identical copies), the decoder
        with them."""
        if kwargs.get("encoder_outputs") is not None:
            raise ValueError("adapt_context=False runs the encoder itself: leave encoder_outputs out")
        encoder_inputs = {n: v for n, v in kwargs.items() if torch.is_tensor(v) and not n.startswith("decoder_")}
        if input_ids is not None:
            encoder_inputs["input_ids"] = input_ids
        copies = self.routing.copies or 1
        rows = _batch_size(encoder_inputs)
        if copies > 1 and not all(v.shape[0] == rows and rows % copies == 0 and _equal_copies(v, copies)
                                  for v in encoder_inputs.values()):
            copies = 1
        with torch.no_grad(), self.disable_adapters():
            encoded = self.base_model.get_encoder()(**_first_copy(encoder_inputs, copies), return_dict=True)
        encoded = repeat_examples(encoded, copies, rows // copies)
        rest = {n: v for n, v in kwargs.items() if n not in encoder_inputs or n == "attention_mask"}
        return self.base_model.generate(encoder_outputs=encoded, **rest)

    # ---- training helpers -------------------------------------------------------------------------------

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None, **kwargs) -> None:
        """Activation checkpointing in the base model (what Trainer calls for ``activation_checkpointing=True``;
        ``kwargs`` such as ``every_n_layers`` go to the base model). The frozen embeddings then must emit
        grad-requiring outputs so that reentrant checkpointing still reaches the adapters (as PEFT does)."""
        base = self.base_model
        if hasattr(base, "activation_checkpointing_enable"):
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=activation_checkpointing_kwargs,
                                                 **kwargs)
        else:  # transformers releases before the rename
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=activation_checkpointing_kwargs)
        base.enable_input_require_grads()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None, **kwargs) -> None:
        """The former name of ``activation_checkpointing_enable``."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def activation_checkpointing_disable(self) -> None:
        base = self.base_model
        getattr(base, "activation_checkpointing_disable", base.gradient_checkpointing_disable)()

    @property
    def is_activation_checkpointing(self) -> bool:
        return any(getattr(m, "gradient_checkpointing", False) is True for m in self.base_model.modules())

    # ---- files ------------------------------------------------------------------------------------------

    def adapter_state_dict(self, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """{'<layer>.lora_A': [K, d_in, r], '<layer>.lora_B': [K, r, d_out]} on CPU, from ``state_dict`` (e.g.
        one Trainer gathered from DeepSpeed/FSDP) when given, else from this model. Adapters sharded by FSDP2
        (``fully_shard``: DTensors) are gathered whole, a collective that every rank must call."""
        tensors = {}
        for name, layer in self.mcl_layers():
            for part, param in layer.adapter_tensors().items():
                key = f"{name}.{part}"
                value = (param if state_dict is None else state_dict[f"base_model.{key}"]).detach()
                tensors[key] = _full_tensor(value).to("cpu").contiguous()
        if self.scoring_head is not None:  # 'scoring.weight' [K, d], 'scoring.bias' [K]
            for part, param in self.scoring_head.named_parameters():
                value = (param if state_dict is None else state_dict[f"scoring_head.{part}"]).detach()
                tensors[f"{SCORING_PREFIX}.{part}"] = _full_tensor(value).to("cpu").contiguous()
        return tensors

    def save_pretrained(self, path: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None) -> str:
        """Write the K hypotheses: ``mcl_adapters.safetensors`` and ``mcl_config.json`` (no pickle), each file
        written under a temporary name and renamed when whole. The config records the weights' SHA-256, which
        loading verifies."""
        tensors = self.adapter_state_dict(state_dict)
        if _sharded(self) and torch.distributed.get_rank() != 0:
            return str(path)  # FSDP2: every rank gathers the shards (above), rank 0 writes
        os.makedirs(path, exist_ok=True)
        weights = os.path.join(path, WEIGHTS_NAME)
        _write_atomically(weights, lambda tmp: safetensors.torch.save_file(
            tensors, tmp, metadata={"format": "pt", "loramcl_format": str(FORMAT_VERSION)}))
        meta = {
            "loramcl_format": FORMAT_VERSION,
            **self._config_metadata(),
            "base_model_name_or_path": getattr(self.config, "_name_or_path", None) or None,
            "base_model_class": type(self.base_model).__name__,
            "adapted_modules": self.layer_names,
            "weights_sha256": _sha256(weights),
            "base_fingerprint": getattr(self, "_base_fingerprint", None),
        }
        _write_atomically(os.path.join(path, CONFIG_NAME),
                          lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8"))
        return str(path)

    def _config_metadata(self) -> dict:
        """What ``save_pretrained`` writes to rebuild the model: its method's configuration."""
        return {"mcl_config": self.mcl_config.to_dict()}

    def load_adapters(self, path: str | os.PathLike, verify: bool = True, strict: bool = False) -> None:
        """Load adapter weights written by ``save_pretrained`` into this model (same layers, K, r and alpha).

        Everything is checked before any weight is copied (see ``read_adapters``; ``verify=False`` skips only the
        checksum), so a failed load leaves the model as it was. Adapters saved on other base weights warn (raise
        with ``strict=True``), as in ``load_mcl_model``."""
        saved, config, tensors = read_adapters(path, verify)
        ours = self.mcl_config
        if (config.num_hypotheses, config.r, config.alpha) != (ours.num_hypotheses, ours.r, ours.alpha):
            raise ValueError(f"{path} holds K={config.num_hypotheses}, r={config.r}, alpha={config.alpha:g} "
                             f"adapters; this model has K={ours.num_hypotheses}, r={ours.r}, alpha={ours.alpha:g}")
        layers = dict(self.mcl_layers())
        _check_adapters_fit(path, saved, config, tensors, self.layer_names,
                            {name: (layer.in_features, layer.out_features) for name, layer in layers.items()})
        if config.scoring != ours.scoring:
            raise ValueError(f"{path} {'has' if config.scoring else 'has no'} hypothesis scores (scoring="
                             f"{config.scoring}); this model was built with scoring={ours.scoring}")
        _check_scoring_fits(path, tensors, self.scoring_head)
        check_base_weights(path, saved, self.base_model, getattr(self, "_base_fingerprint", None), strict)
        with torch.no_grad():
            for name, layer in layers.items():
                layer.lora_A.copy_(tensors[f"{name}.lora_A"])
                layer.lora_B.copy_(tensors[f"{name}.lora_B"])
            self._copy_scoring_head(tensors)

    def _copy_scoring_head(self, tensors: dict[str, torch.Tensor]) -> None:
        """The saved head's values, if ``tensors`` has one (else the head keeps its zero initialisation)."""
        if self.scoring_head is not None and f"{SCORING_PREFIX}.weight" in tensors:
            with torch.no_grad():
                for part, param in self.scoring_head.named_parameters():
                    param.copy_(tensors[f"{SCORING_PREFIX}.{part}"])

    def export_hypothesis(self, k: int, path: str | os.PathLike) -> str:
        """Write hypothesis k as a standard PEFT LoRA adapter folder (``PeftModel.from_pretrained`` loads it)."""
        from peft import LoraConfig

        self._check_hypothesis(k)
        self._refuse_position_dependent("exported as a PEFT LoRA adapter")
        cfg = self.mcl_config
        is_conv1d = [isinstance(layer.base_layer, Conv1D) for _, layer in self.mcl_layers()]
        if any(is_conv1d) and not all(is_conv1d):
            raise ValueError("cannot export a mix of nn.Linear and Conv1D layers as one PEFT adapter")
        targets = self._peft_target_modules()
        by_short_names = targets != sorted(self.layer_names)  # then PEFT must apply the same selection options
        lora_config = LoraConfig(
            r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, bias="none", use_rslora=cfg.use_rslora,
            target_modules=targets, fan_in_fan_out=all(is_conv1d), task_type=_peft_task_type(self.base_model),
            exclude_modules=cfg.exclude_modules if by_short_names else None,
            layers_to_transform=cfg.layers_to_transform if by_short_names else None,
            layers_pattern=cfg.layers_pattern if by_short_names else None,
            base_model_name_or_path=getattr(self.config, "_name_or_path", None) or None,
        )
        os.makedirs(path, exist_ok=True)
        lora_config.save_pretrained(path)
        tensors = {}
        for name, layer in self.mcl_layers():  # PEFT stores lora_A as [r, d_in] and lora_B as [d_out, r]
            tensors[f"base_model.model.{name}.lora_A.weight"] = layer.lora_A[k].detach().T.contiguous().cpu()
            tensors[f"base_model.model.{name}.lora_B.weight"] = layer.lora_B[k].detach().T.contiguous().cpu()
        safetensors.torch.save_file(tensors, os.path.join(path, PEFT_WEIGHTS_NAME), metadata={"format": "pt"})
        return str(path)

    def _peft_target_modules(self) -> list[str]:
        """Short layer names (q_proj, ...) when PEFT's matching of them selects exactly our layers, else full names."""
        ours = set(self.layer_names)
        original = [n for n, _ in self.base_model.named_modules()
                    if n and not any(n.startswith(layer + ".") for layer in ours)]
        short = sorted({n.rsplit(".", 1)[-1] for n in ours})
        if {n for n in original if peft_targets(self.mcl_config, short, n)} == ours:
            return short
        return sorted(ours)

    def merge_hypothesis(self, k: int, inplace: bool = False) -> nn.Module:
        """The base model with hypothesis k merged into its weights (W + alpha/r * (A_k B_k)^T), adapters removed.

        By default the base model is copied first, so this MCLModel stays usable (e.g. to merge another k);
        ``inplace=True`` saves the copy's memory on large models and leaves this MCLModel unusable.
        """
        self._check_hypothesis(k)
        self._refuse_position_dependent("merged into the base weights")
        return self._remove_adapters(k, inplace, "merged in place (merge_hypothesis(..., inplace=True))")

    def _refuse_position_dependent(self, what: str) -> None:
        if not self.mcl_config.adapt_context:
            raise ValueError(
                f"these hypotheses were trained with adapt_context=False: they act only from the first target "
                f"position on, so hypothesis weights {what} (applied at every position, the context included) "
                "would compute another model. Decode with this MCLModel (generate_hypotheses), or train with "
                "adapt_context=True to export standard LoRA adapters")

    def unload(self) -> nn.Module:
        """Remove every adapter and return the base model as it was before ``get_mcl_model`` (its original layers,
        untouched weights, the ``requires_grad`` flags it had), as PEFT's ``unload``. This MCLModel is unusable
        afterwards."""
        model = self._remove_adapters(None, True, "unloaded (unload())")
        for param, flag in self._base_requires_grad:
            param.requires_grad_(flag)
        return model

    def get_base_model(self) -> nn.Module:
        """The transformers model holding the adapted layers (as PEFT's ``get_base_model``)."""
        return self.base_model

    def _remove_adapters(self, k: int | None, inplace: bool, how: str) -> nn.Module:
        """Put the original layers back, hypothesis k merged into them (None: unchanged)."""
        self._check_usable()
        self._remove_hooks()
        try:
            model = self.base_model if inplace else copy.deepcopy(self.base_model)
            with torch.no_grad():
                for name in self.layer_names:
                    layer = model.get_submodule(name)
                    if k is not None:
                        layer.base_layer.weight.add_(layer.delta_weight(k))
                    model.set_submodule(name, layer.base_layer)
        finally:
            if not inplace:
                self._install_hooks()
        if inplace:
            self._detached = how
        return model


def _batch_size(inputs: dict, strict: bool = True) -> int | None:
    for name in ("input_ids", "inputs_embeds", "decoder_input_ids", "input_features", "input_values", "pixel_values"):
        if torch.is_tensor(inputs.get(name)):
            return inputs[name].shape[0]
    if not strict:
        return None
    raise ValueError(f"cannot tell the batch size from the inputs {sorted(inputs)}: pass input_ids or inputs_embeds")


def _tensor_inputs(args: tuple, kwargs: dict) -> Iterator[tuple[str | None, torch.Tensor]]:
    """(name, tensor) for every per-example tensor of a module call, nested ones included (named by their key)."""
    def walk(name, value):
        if torch.is_tensor(value):
            if value.dim() > 0 and name not in _NOT_PER_EXAMPLE:
                yield name, value
        elif isinstance(value, dict):
            for key, item in value.items():
                yield from walk(key, item)
        elif isinstance(value, list | tuple):
            for item in value:
                yield from walk(name, item)

    for value in args:
        yield from walk(None, value)
    for name, value in kwargs.items():
        yield from walk(name, value)


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


def _expansion_module_name(model: nn.Module, layer_names: list[str]) -> str:
    """The smallest transformers model (e.g. LlamaModel, T5Stack, a vision tower) holding every adapted layer:
    the K copies are made at its entry, where per-example inputs are batch-first. The whole model if none."""
    parts = [name.split(".") for name in layer_names]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    while common:
        name = ".".join(common)
        if isinstance(model.get_submodule(name), PreTrainedModel):
            return name
        common.pop()
    return ""


def _branch_names(model: nn.Module, expansion_name: str, layer_names: list[str]) -> list[str]:
    """The modules inside the expansion module through which the adapted layers are reached: its children that
    hold adapters (a list of blocks gives its blocks), e.g. the vision tower and the language model of a VLM, the
    encoder and decoder of T5, the decoder blocks of Llama. Their inputs tell whether each example has its own
    rows (``MCLModel._check_rows_per_example``)."""
    branches = []

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if not any(layer == name or layer.startswith(name + ".") for layer in layer_names):
                continue
            if isinstance(child, nn.ModuleList | nn.ModuleDict):
                visit(name, child)
            else:
                branches.append(name)

    visit(expansion_name, model.get_submodule(expansion_name))
    return branches


def _shared_module_names(model: nn.Module, expansion_name: str, layer_names: list[str],
                         output_layer_name: str | None) -> list[str]:
    """The frozen modules beside the path from the model's root to the expansion module (their siblings along it),
    without adapters and other than the output layer: e.g. the vision tower and projector of a VLM whose adapters
    are in its language model, an audio tower, an encoder without adapters. They run before the K copies in training;
    ``MCLModel._run_on_one_copy`` runs them once when decoding copies of a batch too."""
    if not expansion_name:
        return []
    # A module also used inside the expansion module (T5's `shared` embeddings are its decoder's embed_tokens) sees
    # per-hypothesis inputs there: not shared.
    inside = {id(module) for module in model.get_submodule(expansion_name).modules()}
    names, prefix = [], ""
    for part in expansion_name.split("."):
        for child_name, _ in model.get_submodule(prefix).named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if child_name == part or name == output_layer_name:
                continue
            if output_layer_name and output_layer_name.startswith(name + "."):
                continue
            if any(layer == name or layer.startswith(name + ".") for layer in layer_names):
                continue
            if id(model.get_submodule(name)) in inside:
                continue
            names.append(name)
        prefix = f"{prefix}.{part}" if prefix else part
    return names


def _check_first_step(cache, context_length: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
    """After the first forward of a generate that decodes from a shared context: the model was handed that cache
    (under the name it takes, generate starting no cache of its own), read it in every layer, and it grew by the
    step's tokens."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if given_cache(kwargs) is not cache:
        raise upstream_error(f"generate did not hand {type(module).__name__} the shared context's cache at its first step "
                             "(another cache or none)", "use MCLConfig(adapt_context=True), or MCLModel.context_once = False")
    check_context_read(cache, module)
    if ids is not None and cache.get_seq_length() != context_length + ids.shape[1]:
        raise upstream_error(f"after generate's first step the cache holds {cache.get_seq_length()} positions, not the "
                             f"context's {context_length} and the step's {ids.shape[1]}",
                             "use MCLConfig(adapt_context=True), or MCLModel.context_once = False")


def _equal_copies(value: torch.Tensor, copies: int) -> bool:
    """Whether ``value`` [C*N, ...] is C equal blocks along dim 0."""
    blocks = value.view(copies, value.shape[0] // copies, -1) if value.is_contiguous() else value.reshape(
        copies, value.shape[0] // copies, -1)  # [C, N, rest]
    return all(torch.equal(blocks[0], blocks[c]) for c in range(1, copies))


def _first_copy(value, copies: int):
    """The first of C copies of a module input, nested containers walked: a tensor [C*N, ...] -> [N, ...]."""
    if torch.is_tensor(value):
        return value[:value.shape[0] // copies] if value.dim() > 0 and value.shape[0] > 1 else value
    if isinstance(value, dict):
        return type(value)((key, _first_copy(item, copies)) for key, item in value.items())
    if isinstance(value, list | tuple):
        items = [_first_copy(item, copies) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def _peft_task_type(model: nn.Module) -> str | None:
    """The PEFT task type whose model class passes this model's inputs through: PEFT's language-model wrappers
    take ``input_ids`` as their first input, which suits text models only; others (Whisper's ``input_features``,
    BLIP-2's ``pixel_values``) get PEFT's plain ``PeftModel``, which forwards every input as it is."""
    if getattr(model, "main_input_name", "input_ids") != "input_ids":
        return None
    return "SEQ_2_SEQ_LM" if getattr(model.config, "is_encoder_decoder", False) else "CAUSAL_LM"


def _resolve_target_modules(model: nn.Module, config: MCLConfig) -> list[str] | str:
    targets = config.target_modules
    if targets is None:
        defaults = peft_default_targets()
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in defaults:
            raise ValueError(f"PEFT has no default target modules for model_type={model_type!r}; set "
                             f"MCLConfig.target_modules, e.g. from the linear layers: {_candidate_names(model)}")
        targets = list(defaults[model_type])
    return targets


def _output_layer(model: nn.Module) -> nn.Module | None:
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def _candidate_names(model: nn.Module) -> list[str]:
    output_layer = _output_layer(model)
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, _ADAPTABLE) and module is not output_layer})


def _quantized_reason(module: nn.Module) -> str | None:
    """Why ``module`` is a quantized (or otherwise non-float) layer that adapters must not wrap, or None.

    A quantized layer cannot take W + alpha/r * (A B)^T when merging, and its ``weight`` may not be the matrix
    that its forward uses (packed integers, a quantized tensor subclass): wrapping it silently would give wrong
    merges and exports. Recognised: torch's quantized modules (dynamic or static), layers of quantization
    libraries (bitsandbytes, GPTQ, AWQ, HQQ, quanto, torchao) and any layer whose weight is not a plain
    floating-point tensor.
    """
    origin = type(module).__module__
    libraries = ("bitsandbytes", "auto_gptq", "gptqmodel", "awq", "hqq", "optimum.quanto", "torchao", "fp_quant",
                 "compressed_tensors", "aqlm", "eetq", "vptq", "higgs")
    if origin.startswith(("torch.ao.nn.quantized", "torch.nn.quantized", "torch.ao.nn.intrinsic.quantized")):
        return f"torch quantized module {type(module).__name__}"
    if any(origin == lib or origin.startswith(lib + ".") for lib in libraries):
        return f"{type(module).__name__} from {origin.split('.')[0]}"
    weight = getattr(module, "weight", None)
    if isinstance(module, _ADAPTABLE) and torch.is_tensor(weight):
        if not weight.is_floating_point():
            return f"{type(module).__name__} with {weight.dtype} weights"
        if type(weight) not in (torch.Tensor, nn.Parameter):
            return f"{type(module).__name__} whose weight is a {type(weight).__name__}"
    return None


def _refuse_quantized(model: nn.Module, names: list[str] | None = None) -> None:
    """A clear error for quantized layers among ``names`` (default: every module of ``model``)."""
    modules = model.named_modules() if names is None else ((n, model.get_submodule(n)) for n in names)
    found: list[tuple[str, str]] = []
    for name, module in modules:
        if not any(name.startswith(outer + ".") for outer, _ in found) and (reason := _quantized_reason(module)):
            found.append((name, reason))
    if found:
        name, reason = found[0]
        raise ValueError(f"{type(model).__name__} has quantized layers ({len(found)}, e.g. '{name}': {reason}). "
                         "LoRA-MCL adapters need floating-point base layers: merging a hypothesis into packed "
                         "integer weights would be wrong. Load the base model unquantized (e.g. dtype="
                         "torch.bfloat16, without quantization_config) or dequantize it first.")


def _matched_layer_names(model: nn.Module, targets: list[str] | str, config: MCLConfig) -> list[str]:
    output_layer = _output_layer(model)
    if targets == "all-linear":
        candidates = [name for name, module in model.named_modules()
                      if isinstance(module, _ADAPTABLE) and module is not output_layer]
        # matched by their short names, so that exclude_modules and layers_to_transform apply as in PEFT
        names = [name for name in candidates if peft_targets(config, [name.rsplit(".", 1)[-1]], name)]
        _refuse_quantized(model, names)
        return names
    names = [name for name, _ in model.named_modules() if name and peft_targets(config, targets, name)]
    _refuse_quantized(model, names)
    for name in names:
        module = model.get_submodule(name)
        if module is output_layer:
            raise ValueError(f"'{name}' is the output layer: LoRA-MCL adapts hidden layers, not the LM head")
        if isinstance(module, nn.Embedding):
            raise ValueError(f"target '{name}' is an Embedding: embedding LoRA is not supported, MCL adapters wrap "
                             f"nn.Linear and transformers Conv1D layers. Linear layers of this model: "
                             f"{_candidate_names(model)}")
        if not isinstance(module, _ADAPTABLE):
            raise ValueError(f"target '{name}' is a {type(module).__name__}; MCL adapters wrap nn.Linear and "
                             f"transformers Conv1D layers only. Linear layers of this model: {_candidate_names(model)}")
    return names


def _full_tensor(value: torch.Tensor) -> torch.Tensor:
    """``value`` whole: a DTensor (a parameter sharded by FSDP2's ``fully_shard``) gathered from every rank."""
    return value.full_tensor() if hasattr(value, "full_tensor") and hasattr(value, "placements") else value


def _sharded(model: nn.Module) -> bool:
    """Whether some trainable tensor of ``model`` is an FSDP2 shard (a DTensor) in an initialised process group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() and any(
        hasattr(p, "placements") for p in model.parameters() if p.requires_grad)


def get_mcl_model(model: nn.Module, config: MCLConfig) -> MCLModel:
    """Give ``model`` (any transformers model, modified in place) K LoRA hypotheses on the target layers.

    Every base parameter is frozen; only the adapters train. Quantized base layers are refused. If anything fails,
    the model is left as it was.
    """
    routing = HypothesisRouting()
    adapter_dtype = torch.float32 if config.adapter_dtype == "float32" else None
    return replace_modules(model, target_layer_names(model, config), lambda layer: MCLLoraLinear(
        layer, routing, config.num_hypotheses, config.r, config.alpha, config.dropout, adapter_dtype=adapter_dtype,
        use_rslora=config.use_rslora), lambda names: MCLModel(model, config, routing, names))


def target_layer_names(model: nn.Module, config: MCLConfig) -> list[str]:
    """The layers of ``model`` that ``config.target_modules`` selects (PEFT's matching), checked non-empty."""
    if isinstance(model, MCLModel):
        raise ValueError("this model already has MCL adapters")
    targets = _resolve_target_modules(model, config)
    names = _matched_layer_names(model, targets, config)
    if not names:
        _refuse_quantized(model)
        raise ValueError(f"target_modules={targets!r} matched no layer of {type(model).__name__}. Its linear "
                         f"layers are named: {_candidate_names(model)}")
    return names


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
    ``model``'s, see ``loramcl.fingerprint``) give a warning naming both; ``strict=True`` raises instead. Files saved
    without a fingerprint load silently.
    """
    saved, tensors = read_adapter_files(path, verify)
    if isinstance(model, MCLModel):
        raise ValueError("this model already has MCL adapters: load onto the plain base model")
    if saved.get("base_model_class") not in (None, type(model).__name__):
        warnings.warn(f"adapters were trained on a {saved['base_model_class']}, loading onto a "
                      f"{type(model).__name__}", stacklevel=2)
    method = saved.get("method", "mcl")
    if method in _BASELINE_LOADERS:  # a baseline (loramcl.baselines) checks and rebuilds its own layers
        module, _, loader = _BASELINE_LOADERS[method].partition(":")
        return getattr(importlib.import_module(module), loader)(model, path, saved, tensors, is_trainable, strict)
    config = _mcl_part(path, saved, tensors)
    if fit_scores and not config.scoring:
        config = replace(config, scoring=True)
        tensors = {name: value for name, value in tensors.items() if not name.startswith(f"{SCORING_PREFIX}.")}
    targets = _resolve_target_modules(model, config)
    names = _matched_layer_names(model, targets, config)
    _check_adapters_fit(path, saved, config, tensors, names,
                        {name: linear_features(model.get_submodule(name)) for name in names})
    if config.scoring:
        _check_scoring_fits(path, tensors, None, hidden_size=_output_layer(model).weight.shape[1])
    check_base_weights(path, saved, model, base_fingerprint(model), strict)  # shapes fit: are the values the same?
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


def read_adapters(path: str | os.PathLike, verify: bool = True) -> tuple[dict, MCLConfig, dict[str, torch.Tensor]]:
    """(saved metadata, MCLConfig, tensors) of a folder written by ``MCLModel.save_pretrained``, checked on its own:
    a well-formed config, the weights' SHA-256 against the one recorded at save (``verify=False`` skips it, e.g.
    for a file repaired by hand), one lora_A [K, d_in, r] and lora_B [K, r, d_out] per adapted layer, finite.
    Every error names the file and what is wrong."""
    saved, tensors = read_adapter_files(path, verify)
    return saved, _mcl_part(path, saved, tensors), tensors


def _mcl_part(path: str | os.PathLike, saved: dict, tensors: dict[str, torch.Tensor]) -> MCLConfig:
    """The MCLConfig of checked LoRA-MCL files, after checking the adapters' shapes against it."""
    config_file = os.path.join(path, CONFIG_NAME)
    method = saved.get("method", "mcl")
    if method != "mcl":
        raise ValueError(f"{config_file} holds a {method!r} model, not LoRA-MCL adapters: load it with load_mcl_model")
    if "mcl_config" not in saved:
        raise ValueError(f"{config_file} lacks ['mcl_config']: not a complete file written by "
                         "MCLModel.save_pretrained")
    if not isinstance(saved["mcl_config"], dict):
        raise ValueError(f"{config_file}: mcl_config must be a JSON object, got {saved['mcl_config']!r}")
    try:
        config = MCLConfig.from_dict(saved["mcl_config"])
    except (TypeError, ValueError) as error:
        raise ValueError(f"{config_file}: {error}") from None
    _check_adapter_tensors(os.path.join(path, WEIGHTS_NAME), config, saved["adapted_modules"], tensors)
    return config


def read_adapter_files(path: str | os.PathLike, verify: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """(saved metadata, tensors) of a folder written by ``save_pretrained`` (LoRA-MCL or a baseline), checked for
    what every method shares: a well-formed config with its adapted modules, the weights' SHA-256 (unless
    ``verify=False``), readable safetensors, every tensor floating point and finite."""
    config_file = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"no {CONFIG_NAME} in {path}: not a folder written by MCLModel.save_pretrained")
    try:
        saved = json.loads(Path(config_file).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{config_file} is not valid JSON ({error}); it was damaged or edited: save the adapters "
                         "again, or restore the file") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{config_file} must hold a JSON object (as MCLModel.save_pretrained writes), got a "
                         f"{type(saved).__name__}")
    if saved.get("loramcl_format") != FORMAT_VERSION:
        raise ValueError(f"{config_file} has format {saved.get('loramcl_format')!r}; "
                         f"this loramcl reads format {FORMAT_VERSION}")
    if "adapted_modules" not in saved:
        raise ValueError(f"{config_file} lacks ['adapted_modules']: not a complete file written by "
                         "MCLModel.save_pretrained")
    modules = saved["adapted_modules"]
    if not (isinstance(modules, list) and modules and all(isinstance(m, str) and m for m in modules)):
        raise ValueError(f"{config_file}: adapted_modules must be a non-empty list of layer names, got {modules!r}")
    weights = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(weights):
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in {path}: not a folder written by MCLModel.save_pretrained")
    if verify and saved.get("weights_sha256") is not None and _sha256(weights) != saved["weights_sha256"]:
        raise ValueError(f"{weights} does not match the SHA-256 recorded in {CONFIG_NAME} at save: the file was "
                         "damaged or changed afterwards. Restore it (or an earlier checkpoint); verify=False loads "
                         "it anyway")
    try:
        tensors = safetensors.torch.load_file(weights)
    except Exception as error:  # safetensors raises its own error type without the path
        raise ValueError(f"{weights} cannot be read as safetensors ({error}): the file is damaged") from None
    for key, value in tensors.items():
        if not value.is_floating_point() or not torch.isfinite(value).all():
            raise ValueError(f"{weights}: {key} holds NaN or infinite values (or is not floating point): these "
                             "adapters were saved from a diverged run or damaged; use an earlier checkpoint")
    return saved, tensors


def _check_scoring_fits(path, tensors: dict[str, torch.Tensor], head: HypothesisScores | None,
                        hidden_size: int | None = None) -> None:
    """The saved scoring head must have the width of this model's output layer input."""
    if f"{SCORING_PREFIX}.weight" not in tensors:
        return
    width = head.weight.shape[1] if head is not None else hidden_size
    saved = tensors[f"{SCORING_PREFIX}.weight"].shape[1]
    if saved != width:
        raise ValueError(f"the scoring head in {path} reads hidden states of width {saved}, this model's are {width}: "
                         "were the adapters saved from another base model?")


def _check_adapter_tensors(weights: str, config: MCLConfig, modules: list[str],
                           tensors: dict[str, torch.Tensor]) -> None:
    expected = {f"{name}.{part}" for name in modules for part in ("lora_A", "lora_B")}
    if config.scoring:
        expected |= {f"{SCORING_PREFIX}.weight", f"{SCORING_PREFIX}.bias"}
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(f"{weights} does not hold the adapters its {CONFIG_NAME} lists: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    k, r = config.num_hypotheses, config.r
    for name in modules:
        a, b = tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"]
        if a.dim() != 3 or b.dim() != 3 or a.shape[0] != k or b.shape[0] != k or a.shape[2] != r or b.shape[1] != r:
            raise ValueError(f"{weights}: {name} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; K={k}, r={r} "
                             f"needs [{k}, d_in, {r}] and [{k}, {r}, d_out]")
    if config.scoring:
        weight, bias = tensors[f"{SCORING_PREFIX}.weight"], tensors[f"{SCORING_PREFIX}.bias"]
        if weight.dim() != 2 or weight.shape[0] != k or tuple(bias.shape) != (k,):
            raise ValueError(f"{weights}: the scoring head has weight {tuple(weight.shape)} and bias "
                             f"{tuple(bias.shape)}; K={k} needs [{k}, d] and [{k}]")


def _check_adapters_fit(path, saved: dict, config: MCLConfig, tensors: dict[str, torch.Tensor], names: list[str],
                        features: dict[str, tuple[int, int]]) -> None:
    """Raise unless the adapters read from ``path`` fit the layers ``names`` of shapes ``features`` (d_in, d_out)."""
    ours, theirs = set(names), set(saved["adapted_modules"])
    if ours != theirs:
        raise ValueError(f"the adapters in {path} are on {len(theirs)} layers, this model's layers matching its "
                         f"target_modules={config.target_modules!r} are {len(ours)}: in the file only "
                         f"{sorted(theirs - ours)[:5]}, in the model only {sorted(ours - theirs)[:5]}. Load them onto "
                         "the base architecture they were trained on")
    for name in names:
        d_in, d_out = features[name]
        a, b = tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"]
        if (a.shape[1], b.shape[2]) != (d_in, d_out):
            raise ValueError(f"{name}: the file in {path} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                             f"this model's layer maps {d_in} -> {d_out} features; were they saved from another base "
                             "model (another width)?")


def _sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_atomically(path: str | os.PathLike, write) -> None:
    """``write(temporary_path)``, then rename onto ``path``: a reader finds the old file or the new one, never half."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
