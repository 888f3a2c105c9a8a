"""Multi-head MCL (paper App. H.1, Table 6): one module of a frozen model duplicated K times; the copies are the
hypotheses, trained with the WTA / relaxed / annealed losses of LoRA-MCL through ``MCLTrainer``.

The duplicated module is named by the user: the LM head (``lm_head``) or an internal module such as the multimodal
projector of LLaVA-NeXT or Qwen2-Audio (``model.multi_modal_projector``). Initialisation ``copy`` gives K copies of
the pretrained module (no initial diversity: the paper finds it prone to collapse) and ``random`` re-initialises
each copy as the model's own ``_init_weights`` would (pretrained knowledge lost).

Where the K copies of the batch are made:
  - LM head: at the head's input. The whole network before it runs once on B rows; its hidden states are repeated
    K times and, as for LoRA-MCL, only those at label positions reach the K heads (logits [K * N_labels, V], never
    K full [B, T, V] tensors).
  - an internal module: at the entry of the smallest transformers model holding it (the rule LoRA-MCL applies to
    its adapters), e.g. ``model`` for LLaVA-NeXT: the vision or audio tower then runs K times. The language model
    after a projector differs per hypothesis and runs K times anyway; the tower is the small part.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch
from torch import nn

from loramcl.baselines.config import MultiHeadConfig
from loramcl.baselines.files import BaselineModel, check_tensors_fit, copy_tensors, method_config
from loramcl.mcl.adapter_size import check_heads_size
from loramcl.mcl.build import replace_modules
from loramcl.mcl.copies import batch_size_of
from loramcl.mcl.fingerprint import FrozenBase, check_base_weights, known_fingerprint
from loramcl.mcl.layers import DISABLED, INDEXED, SINGLE, STACKED, HypothesisRouting
from loramcl.mcl.logits import output_layer_of
from loramcl.mcl.model import MCLModel, MCLOutput
from loramcl.mcl.routing import set_routing


class HypothesisHeads(nn.Module):
    """K copies of a module: every parameter of ``heads`` is stacked ``[K, *shape]``; rows are routed as for
    ``MCLLoraLinear`` (``HypothesisRouting``).

    - stacked: the K*R rows are K contiguous blocks, block k through copy k, all K in one ``torch.func.vmap``
      (one batched matmul per linear layer of the module);
    - single: every row through copy k;
    - disabled: the original module (kept frozen as ``base_layer``; free when it is tied to the embeddings);
    - indexed: ``index`` gives the copy of consecutive row groups (see ``_row_hypotheses``); rows are sorted by
      copy and each copy runs once on its rows (a loop over at most K copies: gathering a copy of the parameters
      per row would hold rows x |module| numbers).
    """

    def __init__(self, module: nn.Module, routing: HypothesisRouting, num_hypotheses: int,
                 copies: list[dict[str, torch.Tensor]], dtype: torch.dtype | None = None) -> None:
        super().__init__()
        names = [name for name, _ in module.named_parameters()]
        # the module's structure (and buffers) without a copy of its parameters: they are replaced just below
        memo = {id(p): nn.Parameter(torch.empty(0, device="meta"), requires_grad=False) for p in module.parameters()}
        self.heads = copy.deepcopy(module, memo)
        for name in names:
            stacked = torch.stack([c[name].detach() for c in copies]).to(dtype)  # [K, *shape]
            owner, _, leaf = name.rpartition(".")
            setattr(self.heads.get_submodule(owner), leaf, nn.Parameter(stacked))
        self.base_layer = module  # the frozen original: what disable_adapters() runs and unload() puts back
        self.routing = routing
        self.num_hypotheses = num_hypotheses

    def adapter_tensors(self) -> dict[str, nn.Parameter]:
        """The stacked copies, by their name in this module ('heads.<parameter>': [K, *shape])."""
        return {f"heads.{name}": param for name, param in self.heads.named_parameters()}

    def hypothesis_parameters(self, k: int) -> dict[str, torch.Tensor]:
        """Copy k's parameters, by their name in the duplicated module."""
        return {name: param[k] for name, param in self.heads.named_parameters()}

    def module_for(self, k: int) -> nn.Module:
        """A standalone copy of the module holding copy k's parameters (e.g. to put back into the base model)."""
        memo = {id(p): nn.Parameter(torch.empty(0, device="meta"), requires_grad=False)
                for p in self.heads.parameters()}
        module = copy.deepcopy(self.heads, memo)
        for name, value in self.hypothesis_parameters(k).items():
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, nn.Parameter(value.detach().clone()))
        return module

    def _run(self, params: dict[str, torch.Tensor], x: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        out = torch.func.functional_call(self.heads, params, (x, *args), kwargs)
        if not torch.is_tensor(out):
            raise TypeError(f"multi-head MCL duplicates modules that return one tensor; "
                            f"{type(self.heads).__name__} returns {type(out).__name__}")
        return out

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.routing.mode == DISABLED:
            return self.base_layer(x, *args, **kwargs)
        dtype = next(self.heads.parameters()).dtype
        if x.is_floating_point() and x.dtype != dtype:  # compute in the copies' dtype, answer in the input's
            return self.forward(x.to(dtype), *args, **kwargs).to(x.dtype)
        routing, k_max, rows = self.routing, self.num_hypotheses, x.shape[0]
        if routing.mode == SINGLE:
            return self._run(self.hypothesis_parameters(routing.hypothesis), x, args, kwargs)
        if routing.mode == STACKED:
            if rows % k_max:
                raise RuntimeError(f"stacked routing needs K*R rows (K={k_max}), got {rows}")
            blocks = x.reshape(k_max, rows // k_max, *x.shape[1:])  # [K, R, ...], hypothesis-major
            stacked = dict(self.heads.named_parameters())  # each [K, *shape]
            out = torch.func.vmap(lambda params, block: self._run(params, block, args, kwargs),
                                  randomness="different")(stacked, blocks)  # [K, R, ...]
            return out.reshape(rows, *out.shape[2:])
        if routing.mode == INDEXED:
            per_row = self._row_hypotheses(routing.index, rows)  # [rows]
            order = torch.argsort(per_row, stable=True)
            counts = torch.bincount(per_row, minlength=k_max).tolist()
            outs = [self._run(self.hypothesis_parameters(k), block, args, kwargs)
                    for k, block in enumerate(x[order].split(counts)) if counts[k]]
            return torch.cat(outs)[torch.argsort(order)]  # back to the rows' order
        raise RuntimeError(f"unknown routing mode {routing.mode!r}")

    @staticmethod
    def _row_hypotheses(index: torch.Tensor, rows: int) -> torch.Tensor:
        """The copy of each of ``rows`` rows from ``index`` [n].

        ``index`` is read as R equal blocks of constant value, R as large as possible (n / gcd of its run lengths);
        each block gets rows / R consecutive rows. With one entry per example and the same number of rows per
        example, that is entry i -> its rows (as ``MCLLoraLinear``); for decoding (the batch repeated once per
        hypothesis, index = hypotheses.repeat_interleave(B)) it is copy c -> the c-th block of rows, even when
        examples own different numbers of rows (e.g. LLaVA-NeXT's image patches at the projector).
        """
        changes = torch.nonzero(index[1:] != index[:-1]).flatten() + 1
        bounds = [0, *changes.tolist(), index.numel()]
        block = math.gcd(*[b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
        blocks = index.numel() // block
        if rows % blocks:
            raise RuntimeError(f"{rows} rows cannot be split among {blocks} blocks of hypothesis indices "
                               f"{index.tolist()}")
        return index[::block].repeat_interleave(rows // blocks)

    def extra_repr(self) -> str:
        return f"hypotheses={self.num_hypotheses}"


class MultiHeadModel(BaselineModel):
    """A frozen transformers model with one module duplicated K times. Build it with ``get_multihead_model``.

    Heads at the output (the LM head duplicated) are routed modules at the output layer: ``MCLModel`` then makes the
    K copies at their input and computes their logits whole (``LabelLogits.routes_output_layer``).
    """

    method = "multihead"
    export_refusal = ("multi-head hypotheses are copies of a module, not LoRA adapters: save them with "
                      "save_pretrained, or take one copy as a plain module with model.heads().module_for(k)")
    merge_refusal = ("merge is a LoRA operation; a multi-head hypothesis is a whole module: "
                     "model.heads().module_for(k) gives copy k as a plain module")

    def __init__(self, model: nn.Module, config: MultiHeadConfig, routing: HypothesisRouting,
                 base: FrozenBase = FrozenBase()) -> None:
        super().__init__(model, config.loss_config(), routing, [config.module], base)
        self.multihead_config = config
        self.heads_at_output = self.label_logits.routes_output_layer

    @property
    def method_config(self) -> MultiHeadConfig:
        return self.multihead_config

    def heads(self) -> HypothesisHeads:
        return self.base_model.get_submodule(self.multihead_config.module)

    def forward(self, labels: torch.Tensor | None = None, hypotheses: int | torch.Tensor | None = None,
                **inputs) -> MCLOutput:
        if not torch.is_tensor(hypotheses) or self.heads_at_output:
            return super().forward(labels=labels, hypotheses=hypotheses, **inputs)
        # One copy per example of an internal module: which of its rows belong to which example is the model's
        # business (e.g. a varying number of image patches), so all K copies run and each example keeps its own.
        batch = labels.shape[0] if labels is not None else batch_size_of(inputs)
        set_routing(self.routing, hypotheses, self.num_hypotheses, rows=batch, device=self.adapter_device())
        index = self.routing.index  # [B]
        out = super().forward(labels=labels, **inputs)
        if labels is None:
            return MCLOutput(logits=out.logits[torch.arange(batch, device=index.device), index])  # [B, T, V]
        nll = out.nll.gather(1, index.unsqueeze(1).to(out.nll.device)).squeeze(1)  # [B]
        return MCLOutput(loss=nll.mean(), nll=nll)

    @staticmethod
    def structure_of(config: MultiHeadConfig) -> dict:
        return {"num_hypotheses": config.num_hypotheses, "module": config.module}


def _reinitialised(module: nn.Module, model: nn.Module) -> nn.Module:
    """A copy of ``module`` re-initialised as ``model`` initialises its own weights (transformers' ``_init_weights``),
    or by each submodule's ``reset_parameters`` for a model without it."""
    fresh = copy.deepcopy(module)
    for param in fresh.parameters():
        if hasattr(param, "_is_hf_initialized"):  # transformers' initialisers skip tensors flagged as loaded
            del param._is_hf_initialized
    init_weights = getattr(model, "_init_weights", None)
    with torch.no_grad():
        for submodule in fresh.modules():
            if init_weights is not None:
                init_weights(submodule)
            elif hasattr(submodule, "reset_parameters"):
                submodule.reset_parameters()
    unchanged = [name for (name, new), old in zip(fresh.named_parameters(), module.parameters(), strict=True)
                 if new.dim() > 1 and torch.equal(new, old)]
    if unchanged:
        raise ValueError(f"init='random' could not re-initialise {unchanged} of {type(module).__name__}: "
                         f"{type(model).__name__}._init_weights does not handle it; use init='copy'")
    return fresh


def _module_suggestions(model: nn.Module) -> list[str]:
    output = output_layer_of(model)
    names = [name for name, m in model.named_modules() if m is output or "projector" in name.rsplit(".", 1)[-1]]
    return names or [name for name, _ in model.named_children()]


def duplicated_module(model: nn.Module, config: MultiHeadConfig) -> nn.Module:
    """The module of ``model`` that ``config`` duplicates, checked: a part of the model with parameters."""
    if isinstance(model, MCLModel):
        raise ValueError("this model already has MCL adapters or heads")
    try:
        module = model.get_submodule(config.module)
    except AttributeError:
        raise ValueError(f"{type(model).__name__} has no module {config.module!r} to duplicate; e.g. "
                         f"{_module_suggestions(model)}") from None
    if module is model or not any(True for _ in module.parameters()):
        raise ValueError(f"module {config.module!r} {'is the whole model' if module is model else 'has no parameters'}"
                         f": duplicate a part of the model such as {_module_suggestions(model)}")
    return module


def get_multihead_model(model: nn.Module, config: MultiHeadConfig) -> MultiHeadModel:
    """Duplicate ``config.module`` of ``model`` (any transformers model, modified in place) K times.

    Every other parameter is frozen; only the K copies train. If anything fails, the model is left as it was.
    """
    if not isinstance(config, MultiHeadConfig):
        raise TypeError(f"config must be a MultiHeadConfig, got {type(config).__name__}")
    module = duplicated_module(model, config)
    check_heads_size(module, config)
    k = config.num_hypotheses
    if config.init == "copy":
        copies = [dict(module.named_parameters())] * k
    else:
        copies = [dict(_reinitialised(module, model).named_parameters()) for _ in range(k)]
    routing = HypothesisRouting()
    dtype = torch.float32 if config.dtype == "float32" else None
    return replace_modules(model, [config.module],
                           lambda original: HypothesisHeads(original, routing, k, copies, dtype=dtype),
                           lambda names, base: MultiHeadModel(model, config, routing, base))


def load_from_files(model: nn.Module, path, saved: dict, tensors: dict[str, torch.Tensor],
                    is_trainable: bool, strict: bool = False) -> MultiHeadModel:
    """``load_mcl_model`` for a saved multi-head model: checked against ``model`` before it is touched; built with
    init='copy' (no random draws), the loaded copies then replace the pretrained ones."""
    config = method_config(path, saved, "multihead", MultiHeadConfig)
    module = duplicated_module(model, config)
    expected = {f"{config.module}.heads.{name}": (config.num_hypotheses, *param.shape)
                for name, param in module.named_parameters()}
    check_tensors_fit(path, saved, tensors, [config.module], expected)
    with known_fingerprint(model, check_base_weights(path, saved, model, strict)):
        mcl = get_multihead_model(model, dataclasses.replace(config, init="copy"))
    mcl.multihead_config = config
    copy_tensors(mcl, tensors, is_trainable)
    return mcl


__all__ = ["HypothesisHeads", "MultiHeadConfig", "MultiHeadModel", "get_multihead_model"]
