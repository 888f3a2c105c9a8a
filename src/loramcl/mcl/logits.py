"""How an MCL forward keeps its peak memory down (DESIGN decision 5, issue 18), three devices that change no result:

- logits only where labels are: a pre-hook on the output layer gives it the hidden states at label positions
  [N, d] instead of [rows, T, d], so no vocabulary logits are built for prompt, image or audio tokens;
- logits in chunks (``MCLConfig.logits_chunk_size``): the layer gets one probe row, and the logits of the N label
  positions and their cross-entropy are computed a chunk at a time (``nll.chunked_token_nll``), after checking that
  the probe's logits are the model's own;
- blocks of examples (``MCLModel.forward(examples_per_block=n)``): a forward without gradient of all K hypotheses
  runs n examples at a time, K*n rows per call instead of K*B (two-pass WTA's scoring pass).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from loramcl.mcl.copies import ExamplesNotSeparable, select_examples


class ForwardMemory:
    """The methods of ``MCLModel`` behind its memory devices. They read the model's ``_pending`` (what the next call
    of the base model must do), ``_generation_context``, ``_output_layer_name``, ``base_model`` and ``mcl_config``,
    and keep ``_unchunkable`` and ``_whole_batch_warned``."""

    # ---- logits only where labels are (the output layer's pre-hook) ---------------------------------------------

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

    # ---- logits in chunks (MCLConfig.logits_chunk_size) ----------------------------------------------------

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

    # ---- blocks of examples (examples_per_block) ----------------------------------------------------------------

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
