"""How an MCL forward keeps its peak memory down (issue 18; docs/architecture.md, "Decisions as implemented": "Logits
only where labels are" and "Two-pass hard WTA"), three devices that change no result:

- logits only where labels are: a pre-hook on the output layer gives it the hidden states at label positions
  [N, d] instead of [rows, T, d], so no vocabulary logits are built for prompt, image or audio tokens;
- logits in chunks (``MCLConfig.logits_chunk_size``): the layer gets one probe row, and the logits of the N label
  positions and their cross-entropy are computed a chunk at a time (``nll.chunked_token_nll``), after checking that
  the probe's logits are the model's own;
- blocks of examples (``MCLModel.forward(examples_per_block=n)``): a forward without gradient of all K hypotheses
  runs n examples at a time, K*n rows per call instead of K*B (two-pass WTA's scoring pass).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from loramcl.mcl.batch import flat_index
from loramcl.mcl.config import MCLConfig
from loramcl.mcl.copies import ExamplesNotSeparable, select_examples
from loramcl.mcl.layers import INDEXED, HypothesisRouting
from loramcl.mcl.scope import CallScope, ForwardCall


def output_layer_of(model: nn.Module) -> nn.Module | None:
    """The model's output layer (its LM head), None for a model without one."""
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


class LabelLogits:
    """The output layer's hook and the forward's memory devices, with their state.

    base_model: the model; output_layer_name: its output layer (None: none found, the model's logits are used whole);
    scope: the call in progress (``logit_positions``, ``context_positions``, ``chunked``); config: the model's
    ``MCLConfig``, whose ``logits_chunk_size`` is read at every forward (it may be changed between them); routing:
    the routing of the adapted modules, re-indexed per label token when the output layer is one of them
    (``routes_output_layer``: multi-head MCL's heads at the output, which also rules out chunks: K heads route their
    rows by hypothesis and must see every label row at once).
    """

    def __init__(self, base_model: nn.Module, output_layer_name: str | None, scope: CallScope, config: MCLConfig,
                 routing: HypothesisRouting, routes_output_layer: bool = False) -> None:
        self.base_model, self.output_layer_name, self.scope = base_model, output_layer_name, scope
        self.config, self.routing, self.routes_output_layer = config, routing, routes_output_layer
        self.unchunkable: str | None = None  # why this model's logits cannot be computed in chunks, once found
        self.whole_batch_warned = False  # examples_per_block met inputs it cannot cut (warned once)
        # (dtype, device) of the label states whose logits ``logits_of`` was found to reproduce: the check (a matmul
        # and a host sync) runs once per kind of forward, not on every forward
        self._reproduced: set[tuple[torch.dtype, torch.device]] = set()
        self._capture: list[torch.Tensor] | None = None  # armed by capturing()
        self._handle: torch.utils.hooks.RemovableHandle | None = None

    def install(self) -> None:
        if self.output_layer_name is not None:
            output_layer = self.base_model.get_submodule(self.output_layer_name)
            self._handle = output_layer.register_forward_pre_hook(self._keep_label_positions)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    @property
    def chunk_size(self) -> int | None:
        return self.config.logits_chunk_size

    def check_ran(self, call: ForwardCall) -> None:
        if call.logit_positions is not None:
            raise RuntimeError(f"the output layer '{self.output_layer_name}' did not run during this forward")

    @contextlib.contextmanager
    def capturing(self) -> Iterator[list[torch.Tensor]]:
        """Record the hidden state at the last position of every row of the next output-layer call (a generate's
        prefill: the last context position), without another forward; the list holds [rows, d] after the block."""
        captured: list[torch.Tensor] = []
        self._capture = captured
        try:
            yield captured
        finally:
            self._capture = None

    @contextlib.contextmanager
    def not_capturing(self) -> Iterator[None]:
        """A call inside ``capturing`` whose hidden states are not the ones to record (a context run before it)."""
        capture, self._capture = self._capture, None
        try:
            yield
        finally:
            self._capture = capture

    # ---- logits only where labels are (the output layer's pre-hook) ---------------------------------------------

    def _keep_label_positions(self, module: nn.Module, args: tuple):
        """Give the LM head only the hidden states that predict a label: [rows, T, d] -> [N, d]."""
        hidden = args[0]
        if self._capture is not None and not self._capture:
            # the prefill of a generate: the last position is the last context position of every row
            self._capture.append(hidden[:, -1].detach())  # [rows, d]
        call = self.scope.call
        positions = call.logit_positions
        if positions is None:
            return None
        call.logit_positions = None
        if tuple(hidden.shape[:2]) != tuple(positions.shape):
            raise RuntimeError(
                f"the output layer received hidden states of shape {tuple(hidden.shape)} but the labels give "
                f"{tuple(positions.shape)} (rows, positions); labels must be aligned with the sequence the model "
                "processes (e.g. image/audio tokens already expanded in input_ids, as current processors do).")
        if call.context_positions is not None:
            rows = torch.arange(hidden.shape[0], device=hidden.device)
            call.context_states = hidden[rows, call.context_positions].detach()  # [rows, d]
        flat = call.logit_index if call.logit_index is not None else flat_index(positions)  # [N]
        if self.routes_output_layer and self.routing.mode == INDEXED:
            # one hypothesis per example -> one per label token, the rows the routed output layer now sees
            rows = torch.div(flat, positions.shape[1], rounding_mode="floor")  # [N]: the row of each label token
            self.routing.index = self.routing.index.index_select(0, rows.to(self.routing.index.device))  # [N]
        states = hidden.flatten(0, 1).index_select(0, flat.to(hidden.device))  # [N, d], as hidden[positions]
        if call.chunked:
            call.label_states = states
            return (states[:1], *args[1:])  # the probe row
        return (states, *args[1:])

    # ---- logits in chunks (MCLConfig.logits_chunk_size) ----------------------------------------------------

    def in_chunks(self) -> bool:
        """Whether this forward computes the vocabulary logits and their cross-entropy chunk by chunk: asked for, an
        output layer that is found, not routed and frozen (its weight would get no gradient), and no transformation
        of the logits that ``logits_of`` fails to reproduce."""
        if self.chunk_size is None or self.output_layer_name is None or self.unchunkable or self.routes_output_layer:
            return False
        if torch.compiler.is_compiling():
            # each chunk's gradient is taken inside the forward (torch.autograd.grad in an autograd.Function), which
            # torch.compile cannot trace, and the probe's check reads the host: compiled, the logits of the N label
            # positions are computed whole (docs/architecture.md, "Compiling the forward")
            return False
        layer = self.base_model.get_submodule(self.output_layer_name)
        return not any(param.requires_grad for param in layer.parameters())

    def logits_of(self):
        """hidden states at label positions [n, d] -> the logits [n, V] the model returns for them: its output layer,
        then what transformers' models apply after it: BART-family ``final_logits_bias`` (added), Gemma-family
        ``final_logit_softcapping`` (cap * tanh(logits / cap)), in their own order of operations."""
        base = self.base_model
        layer = base.get_submodule(self.output_layer_name)
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

    def reproduces_logits(self, logits_of, label_states: torch.Tensor, probe: torch.Tensor) -> bool:
        """Whether ``logits_of`` gives exactly the logits the model returned for the probe row (the first label
        position); if not, warn once and compute the full logits from now on (any other post-processing of the
        logits, e.g. Cohere's logit_scale or Granite's logits_scaling, is the model's own). Checked once per dtype
        and device of the label states (the post-processing is the model's, the same at every forward)."""
        kind = (label_states.dtype, label_states.device)
        if kind in self._reproduced:
            return True
        with torch.no_grad():
            ours = logits_of(label_states[:1])  # [1, V]
        # NaN where the model's logits are NaN too (a diverged step is the NaN guard's business, not a different model)
        if probe.numel() == ours.numel() and torch.allclose(probe.detach().reshape(ours.shape).to(ours.dtype), ours,
                                                            rtol=0, atol=0, equal_nan=True):
            self._reproduced.add(kind)
            return True
        self.unchunkable = (f"{type(self.base_model).__name__} transforms the output of its output layer in a way "
                             "loramcl does not reproduce")
        warnings.warn(f"{self.unchunkable}: its logits are computed whole ([N label tokens, V]), not in chunks of "
                      f"MCLConfig.logits_chunk_size={self.chunk_size}. Please report this model "
                      "class to loramcl.", stacklevel=4)
        return False

    # ---- blocks of examples (examples_per_block) ----------------------------------------------------------------

    @staticmethod
    def check_examples_per_block(examples_per_block, labels: torch.Tensor | None, hypotheses,
                                 adapters_disabled: bool) -> None:
        if isinstance(examples_per_block, bool) or not isinstance(examples_per_block, int) or examples_per_block < 1:
            raise ValueError(f"examples_per_block must be a number of examples >= 1 or None, got "
                             f"{examples_per_block!r}")
        if labels is None or hypotheses is not None or adapters_disabled:
            raise ValueError("examples_per_block cuts the forward of all K hypotheses with labels (hypotheses=None, "
                             "adapters enabled) into blocks of examples; leave it out here")
        if torch.is_grad_enabled():
            raise ValueError("examples_per_block lowers the peak memory of a forward without gradient (two-pass "
                             "WTA's scoring pass); with gradients every block's activations stay alive until the "
                             "backward, so blocks save nothing: run it under torch.no_grad(), or leave it out")

    def example_blocks(self, inputs: dict, batch: int, examples_per_block: int | None
                        ) -> list[tuple[slice, dict]]:
        """(examples, their inputs) of each block; the whole batch where it is one block or cannot be cut."""
        if examples_per_block is None or examples_per_block >= batch:
            return [(slice(None), inputs)]
        blocks = [slice(start, start + examples_per_block) for start in range(0, batch, examples_per_block)]
        try:
            return [(block, select_examples(inputs, block, batch)) for block in blocks]
        except ExamplesNotSeparable as error:
            if not self.whole_batch_warned:
                self.whole_batch_warned = True
                warnings.warn(f"{error}: the forward of all K hypotheses runs the batch whole, not "
                              f"{examples_per_block} example{'s' if examples_per_block > 1 else ''} at a time (the "
                              "same result, a higher peak memory); examples_per_block=None (MCLTrainer: "
                              "scoring_examples_per_block=None) asks for the whole batch", stacklevel=5)
            return [(slice(None), inputs)]
