"""The MCL model: K LoRA hypotheses on any transformers model, routed by ``use_hypotheses``, and its forward.

Data flow of one MCL forward (labels given, all K hypotheses; docs/architecture.md, "One MCL forward", whose
"Decisions as implemented" are quoted below):
  inputs [B, ...] -> frozen modules that precede every adapter run once on B rows
  -> at the entry of the smallest transformers model holding all adapters, every per-example tensor is
     repeated K times, hypothesis-major [K*B, ...] ("Where the K copies are made"; ``loramcl.mcl.copies``)
  -> adapted layers route row block k through hypothesis k (one bmm per layer, "Routing")
  -> the LM head sees only the hidden states at label positions ("Logits only where labels are")
  -> nll [B, K] (``loramcl.mcl.rows``, scoring) -> loss (losses).

``MCLModel`` is this module's forward and routing; building it is ``loramcl.mcl.build`` (``get_mcl_model``), loading
it from files ``loramcl.models.mcl`` (``load_mcl_model``). It owns two components, each made with explicit arguments and
holding its own state: the K copies' hooks (``loramcl.mcl.copies.CopyHooks``) and the output layer's hook with the
forward's memory devices (``loramcl.mcl.logits.LabelLogits``); both read the call in progress from one
``CallScope``. Generation (``loramcl.mcl.generate``), the files (``loramcl.mcl.adapter_files``) and PEFT
interoperability (``loramcl.mcl.peft_interop``) are free functions of the model, each behind a one-line method.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import ModelOutput

from loramcl.mcl import adapter_files, peft_interop
from loramcl.mcl import generate as generation
from loramcl.mcl.activation_checkpointing import ActivationCheckpointing
from loramcl.mcl.batch import checked_target_index, decoder_input_ids_from_labels, flat_index
from loramcl.mcl.compat import check_token_ids, given_cache
from loramcl.mcl.config import MCLConfig
from loramcl.mcl.context import check_context_read, is_shared_context
from loramcl.mcl.copies import (
    CopyHooks,
    RowsPerExampleUnknown,
    batch_size_of,
    find_branches,
    find_expansion_module,
    find_shared_modules,
)
from loramcl.mcl.fingerprint import FrozenBase
from loramcl.mcl.layers import DISABLED, INDEXED, SINGLE, HypothesisRouting, MCLLoraLinear
from loramcl.mcl.logits import LabelLogits, output_layer_of
from loramcl.mcl.losses import mcl_loss
from loramcl.mcl.nll import IGNORE_INDEX, aligned_targets
from loramcl.mcl.routing import check_hypothesis, set_routing
from loramcl.mcl.rows import nll_of_rows
from loramcl.mcl.scope import CallScope, ForwardCall
from loramcl.mcl.scores import mixture_nll, scoring_head_for


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


class MCLModel(ActivationCheckpointing, nn.Module):
    """A frozen transformers model with K LoRA hypotheses. Build it with ``get_mcl_model`` (``loramcl.mcl.build``).

    What a method built on it (``loramcl.baselines``) declares: its adapted modules (the layer class it puts in
    place with ``replace_modules``: ``adapter_tensors()`` and the shared ``HypothesisRouting``), ``method`` and
    ``method_config`` (what ``save_pretrained`` writes: ``{"method": m, "<m>_config": ...}``), and
    ``export_refusal`` / ``merge_refusal`` (why its hypotheses are not LoRA adapters PEFT can hold, None where they
    are). Logits in chunks follow from the modules: never when the output layer is one of them.
    """

    # Our loss is a mean over examples: let Trainer divide it for gradient accumulation.
    accepts_loss_kwargs = False
    # The base's layer classes (its decoder layers): accelerate's FSDP auto-wrap makes each one a unit of its own.
    _no_split_modules = property(lambda self: getattr(self.base_model, "_no_split_modules", None))
    method = "mcl"
    export_refusal: str | None = None
    merge_refusal: str | None = None

    def __init__(self, model: nn.Module, config: MCLConfig, routing: HypothesisRouting, layer_names: list[str],
                 base: FrozenBase = FrozenBase()) -> None:
        super().__init__()
        self.base_model = model
        self.mcl_config = config
        self.routing = routing
        self.layer_names = layer_names
        self.frozen_base = base
        self._explicit_routing = 0
        self._adapters_disabled = 0
        self._detached: str | None = None  # how the adapters left the base model: 'merged in place' / 'unloaded'
        # adapt_context=False: run the context once on B rows and the targets on K*B rows (loramcl.mcl.context); False
        # computes the same on the full sequence with the adapters masked on the context (the reference, for tests
        # and benchmarks).
        self.context_once = True
        output_layer = output_layer_of(model)
        output_layer_name = next((n for n, m in model.named_modules() if m is output_layer), None)
        expansion = find_expansion_module(model, layer_names)
        shared = find_shared_modules(model, expansion, layer_names, output_layer_name)
        branches = find_branches(model, expansion, layer_names)
        routes_output_layer = output_layer_name in layer_names  # e.g. multi-head MCL's heads at the output
        if routes_output_layer:  # the K copies are made at its input, after the whole network
            expansion = output_layer_name
        self.scope = CallScope()
        self.copy_hooks = CopyHooks(model, routing, config.num_hypotheses, self.scope, expansion, shared, branches)
        self.label_logits = LabelLogits(model, output_layer_name, self.scope, config, routing,
                                  routes_output_layer)
        self.scoring_head = scoring_head_for(output_layer, model, config.num_hypotheses,
                                             self.adapter_device()) if config.scoring else None
        self.install_hooks()

    def install_hooks(self) -> None:
        """The copies' hooks, then the output layer's (on a module holding both, in this order)."""
        self.copy_hooks.install()
        self.label_logits.install()

    def remove_hooks(self) -> None:
        self.copy_hooks.remove()
        self.label_logits.remove()

    @property
    def expansion_module_name(self) -> str:
        return self.copy_hooks.expansion_module_name

    @property
    def shared_module_names(self) -> list[str]:
        return self.copy_hooks.shared_module_names

    @property
    def branch_names(self) -> list[str]:
        return self.copy_hooks.branch_names

    @property
    def share_frozen_modules(self) -> bool:
        return self.copy_hooks.share_frozen_modules

    @share_frozen_modules.setter
    def share_frozen_modules(self, value: bool) -> None:
        self.copy_hooks.share_frozen_modules = value

    @property
    def method_config(self):
        """The method's own configuration, as ``save_pretrained`` writes it."""
        return self.mcl_config

    @property
    def adapters_disabled(self) -> bool:
        """Inside ``disable_adapters()``."""
        return bool(self._adapters_disabled)

    @property
    def hypotheses_chosen(self) -> bool:
        """Inside ``use_hypotheses(...)`` or ``disable_adapters()``: the routing is the caller's."""
        return bool(self._explicit_routing)

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

    def shared_parameter_count(self) -> int:
        """Trainable numbers of the shared adapter (``MCLConfig.shared_r``), counted in ``parameter_counts`` too."""
        return sum(p.numel() for _, layer in self.mcl_layers() for part, p in layer.adapter_tensors().items()
                   if part.startswith("shared_") and p.requires_grad)

    def print_trainable_parameters(self) -> None:
        trainable, total = self.parameter_counts()
        shared = self.shared_parameter_count()
        print(f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f}"
              f" || hypotheses: {self.num_hypotheses}" + (f" || shared adapter: {shared:,}" if shared else ""))

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
        self.check_usable()
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
        self.check_usable()
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
        self.copy_hooks.main_rows = None
        set_routing(self.routing, hypotheses, self.num_hypotheses, rows, copies, self.adapter_device())

    def check_hypothesis(self, k: int) -> None:
        check_hypothesis(k, self.num_hypotheses)

    def adapter_device(self) -> torch.device:
        return next(iter(self.base_model.get_submodule(self.layer_names[0]).adapter_tensors().values())).device

    # ---- forward ----------------------------------------------------------------------------------------

    def forward(self, labels: torch.Tensor | None = None, hypotheses: int | torch.Tensor | None = None,
                examples_per_block: int | None = None, target_index: torch.Tensor | None = None,
                step: int | torch.Tensor = 0, total_steps: int | None = None,
                balance_bias: torch.Tensor | None = None, **inputs) -> MCLOutput:
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
        target_index: [N] the positions whose output predicts a label (``loramcl.mcl.batch.checked_target_index``,
            once per batch outside the forward): given, nothing is checked or read on the host and the forward compiles
            whole; None: found and checked here. (No "label" in the name: Trainer would take it for a label column.)
        step, total_steps: the loss's schedule position, the optimizer step of the run's (the annealed temperature's
            t and T; ``loramcl.mcl.step.mcl_step`` passes them): an int, or in a compiled forward a 0-dim tensor on
            the adapters' device (one graph for every step). Default: step 0 of a run of unknown length.
        balance_bias: [K] the balancing bias (``MCLConfig.balance``) the stacked loss subtracts before it picks the
            winners (``losses.balanced``), an argument as ``step`` is; None: none (evaluation never has one).
        inputs: every other input of the base model (input_ids, attention_mask, pixel_values,
            input_features, decoder_input_ids, ...), passed through untouched.
        """
        self.check_usable()
        if labels is None and not torch.compiler.is_compiling():  # compiled, the caller's entry checks (generate's)
            check_token_ids(self.base_model, inputs.get("input_ids"))
        if self._adapters_disabled and hypotheses is not None:
            raise ValueError("the adapters are disabled in this block (disable_adapters): leave hypotheses out")
        copies = False
        if hypotheses is None and self._explicit_routing and not self._adapters_disabled:
            hypotheses, copies = self._chosen_hypotheses()
        if examples_per_block is not None:
            LabelLogits.check_examples_per_block(examples_per_block, labels, hypotheses, self.adapters_disabled)
        if labels is None:
            return self._forward_logits(hypotheses, inputs, copies)
        base = self.base_model
        causal = not getattr(base.config, "is_encoder_decoder", False)
        if not causal and "decoder_input_ids" not in inputs and "decoder_inputs_embeds" not in inputs:
            inputs["decoder_input_ids"] = decoder_input_ids_from_labels(base, labels)
        if target_index is None:
            target_index = checked_target_index(self, inputs, labels)  # [N]
        targets = aligned_targets(labels, causal)  # [B, T]
        positions = targets != IGNORE_INDEX  # [B, T]
        batch = labels.shape[0]
        stacked = hypotheses is None and not self._adapters_disabled
        if not self._adapters_disabled:
            self._set_routing(hypotheses, rows=None if copies else batch, copies=copies)
        if torch.is_tensor(hypotheses) and self.routing.mode == INDEXED:
            try:
                return self._forward_nll(inputs, targets, positions, target_index, stacked=False)
            except RowsPerExampleUnknown as error:
                # Exact without knowing the rows of each example: run all K hypotheses (K times the compute)
                # and keep each example's own; the gradient is the same as that of the per-example forward.
                warnings.warn(f"{error} Running all K hypotheses instead and keeping each example's own.",
                              stacklevel=4)  # the caller of model(...), past nn.Module's call wrappers
                index = self.routing.index.to(labels.device)
                self._set_routing(None, rows=batch)
                nll = self._forward_nll(inputs, targets, positions, target_index, True, None, step,
                                        total_steps).nll  # [B, K]
                nll = nll.gather(1, index.unsqueeze(1)).squeeze(1)  # [B]
                return MCLOutput(loss=nll.mean(), nll=nll)
        return self._forward_nll(inputs, targets, positions, target_index, stacked, examples_per_block, step,
                                 total_steps, balance_bias)

    def _forward_nll(self, inputs: dict, targets: torch.Tensor, positions: torch.Tensor, index: torch.Tensor,
                     stacked: bool, examples_per_block: int | None = None, step: int | torch.Tensor = 0,
                     total_steps: int | None = None, bias: torch.Tensor | None = None) -> MCLOutput:
        """nll of every example under the routing already set: [B, K] (stacked, with the loss at ``step`` of
        ``total_steps``, its winners picked less the balancing ``bias``) or [B]; stacked, the examples run
        ``examples_per_block`` at a time (the loss and the scores see them all at once); ``index``: the batch's
        target_index [N] (a block of examples finds its own)."""
        if not stacked:
            nll = nll_of_rows(self, inputs, targets, positions, index, stacked=False)[0]  # [B]
            return MCLOutput(loss=nll.mean(), nll=nll)
        k, batch = self.num_hypotheses, targets.shape[0]
        nll, states = [], []
        blocks = self.label_logits.example_blocks(inputs, batch, examples_per_block)
        for block, block_inputs in blocks:
            block_index = index if len(blocks) == 1 else flat_index(positions[block])  # [N_block]
            block_nll, block_states = nll_of_rows(self, block_inputs, targets[block], positions[block], block_index,
                                                  stacked=True)
            nll.append(block_nll.view(k, -1))  # [K, n]: rows are hypothesis-major within the block
            if block_states is not None:
                states.append(block_states.view(k, -1, block_states.shape[-1]))  # [K, n, d]
        nll = torch.cat(nll, dim=1).T  # [B, K]
        loss, weights = mcl_loss(nll, self.mcl_config, step, total_steps, self.training, bias)
        if self.scoring_head is None:
            return MCLOutput(loss=loss, nll=nll, weights=weights)
        # The head learns even inside the trainer's no-grad scoring pass of two-pass WTA (its inputs are detached).
        with torch.enable_grad() if self.training else contextlib.nullcontext():
            log_scores = self.scoring_head(torch.cat(states, dim=1))  # [B, K]
            scoring_loss = mixture_nll(log_scores, nll.detach(), positions.sum(dim=1)).mean()
        mixture = mixture_nll(log_scores.detach(), nll.detach(), positions.sum(dim=1))  # [B]
        return MCLOutput(loss=loss + self.mcl_config.scoring_weight * scoring_loss, nll=nll, weights=weights,
                         log_scores=log_scores.detach(), mixture_nll=mixture, scoring_loss=scoring_loss)

    def adapter_dtype(self) -> torch.dtype:
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
        logits = self.run_base(inputs, ForwardCall(expand_batch=batch if stacked else None)).logits  # [K*B|B, T, V]
        if stacked:
            logits = logits.view(self.num_hypotheses, batch, *logits.shape[1:]).transpose(0, 1)  # [B, K, T, V]
        return MCLOutput(logits=logits)

    def run_base(self, inputs: dict, call: ForwardCall):
        """The base model's outputs on ``inputs``, its hooks doing what ``call`` asks (the K copies, the label
        positions, ...; the hooks fill ``call.context_states`` and ``call.label_states``), checked to have run."""
        with self.scope.armed(call):
            outputs = self.base_model(**inputs)
            self.copy_hooks.check_ran(call)
            self.label_logits.check_ran(call)
            cache = given_cache(inputs)
            if is_shared_context(cache):
                check_context_read(cache, self.base_model)
            return outputs

    def check_usable(self) -> None:
        if self._detached:
            raise RuntimeError(f"this MCLModel's adapters were {self._detached}; use the returned base model, or "
                               "load the adapters again with load_mcl_model")

    def close(self, how: str) -> None:
        """The adapters left the base model (``how``: merged in place, unloaded): this model is unusable from now on."""
        self.remove_hooks()
        self._detached = how

    # ---- generation, files and PEFT: free functions of the model (loramcl.mcl.generate, adapter_files, peft_interop)

    def generate(self, *args, **kwargs):
        """``base_model.generate`` with the hypotheses chosen by an enclosing ``use_hypotheses`` block."""
        return generation.generate(self, *args, **kwargs)

    def capture_context(self) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
        """Record the hidden state at the last position of every row of the next output-layer call (a generate's
        prefill: the last context position), without another forward; the list holds [rows, d] after the block."""
        return self.label_logits.capturing()

    def adapter_state_dict(self, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """{'<layer>.lora_A': [K, d_in, r], '<layer>.lora_B': [K, r, d_out], ...} on CPU."""
        return adapter_files.adapter_state_dict(self, state_dict)

    def save_pretrained(self, path: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None) -> str:
        """Write the K hypotheses: ``mcl_adapters.safetensors`` and ``mcl_config.json``."""
        return adapter_files.save_pretrained(self, path, state_dict)

    def load_adapters(self, path: str | os.PathLike, verify: bool = True, strict: bool = False,
                      is_trainable: bool = False) -> None:
        """Load adapter weights written by ``save_pretrained`` into this model, everything checked first; the model is
        then in eval mode unless ``is_trainable=True`` (as PEFT's ``load_adapter``)."""
        adapter_files.load_adapters(self, path, verify, strict, is_trainable)

    def export_hypothesis(self, k: int, path: str | os.PathLike, **options) -> str:
        """Write hypothesis k as a standard PEFT LoRA adapter folder (``PeftModel.from_pretrained`` loads it);
        ``options``: ``fold_scaling``, ``alora_invocation_tokens`` (``peft_interop.export_hypothesis``)."""
        return peft_interop.export_hypothesis(self, k, path, **options)

    def merge_hypothesis(self, k: int, inplace: bool = False) -> nn.Module:
        """The base model with hypothesis k merged into its weights (W + alpha/r * (A_k B_k)^T), adapters removed."""
        return peft_interop.merge_hypothesis(self, k, inplace)

    def unload(self) -> nn.Module:
        """Remove every adapter and return the base model as it was before ``get_mcl_model``."""
        return peft_interop.unload(self)

    def get_base_model(self) -> nn.Module:
        """The transformers model holding the adapted layers (as PEFT's ``get_base_model``)."""
        return self.base_model
