"""LoRA-MoE: a soft mixture of E LoRA experts per adapted layer (paper App. F, after Muqeeth et al.), an MLE model.

At every adapted layer, for each token x independently:

    y = W x + (alpha / r) * sum_e gamma(x)_e * B_e A_e x,        gamma(x) = softmax(x W_gamma)   (W_gamma: d_in -> E)

The router W_gamma starts at zero (every expert weighs 1/E: the paper's choice) or N(0, std^2). Routing is dense
and differentiable, with no load-balancing loss; the model is trained with plain NLL through ``MCLTrainer`` (it is
an ``MCLModel`` with one hypothesis, so ``nll`` is [B, 1] and the WTA loss over one hypothesis is the mean NLL).

Decoding (App. F, "Remarks on the decoding setup"):
  - MLE decoding: the MoE model is one model; ``generate_hypotheses`` decodes it as any LoRA-MLE model
    (beam search returning K sequences, diverse beam search, sampling).
  - Stochastic router decoding (Zuo et al. 2021): ``generate_hypotheses(strategy="stochastic_router")``: at every
    layer and token one expert is drawn from gamma(x) and used alone; K candidates, each its own stochastic pass
    (``MoEModel.stochastic_router``), all in one batched ``generate``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from loramcl.baselines.config import MoEConfig
from loramcl.baselines.files import BaselineModel, check_tensors_fit, copy_tensors, method_config
from loramcl.mcl.adapter_size import check_adapter_size
from loramcl.mcl.build import replace_modules, target_layer_names
from loramcl.mcl.fingerprint import FrozenBase, check_base_weights, known_fingerprint
from loramcl.mcl.layers import DISABLED, HypothesisRouting, MCLLoraLinear, linear_features

SOFT, SAMPLED = "soft", "sampled"


@dataclass
class RouterState:
    """How every MoE layer of a model mixes its experts; one object shared by all layers.

    - ``soft``: gamma(x) weighs every expert (training, MLE decoding);
    - ``sampled``: one expert per token drawn from gamma(x). The rows of a forward are ``len(generators)`` equal
      contiguous blocks (the candidates of a stochastic-router decoding), block c drawing from ``generators[c]``.
    """

    mode: str = SOFT
    generators: list[torch.Generator] | None = None


class MoELoraLinear(MCLLoraLinear):
    """``base(x) + (alpha / r) * sum_e gamma(x)_e * dropout(x) @ A_e @ B_e`` with a per-token softmax router.

    The E experts are the stacked tensors of ``MCLLoraLinear`` (``lora_A [E, d_in, r]``, ``lora_B [E, r, d_out]``,
    PEFT's initialisation); the router is ``router [d_in, E]`` (no bias, as the routers of Switch or Mixtral). All
    experts run in one pair of einsums: the gated mixture is a rank E*r LoRA whose middle is scaled per token.
    """

    def __init__(self, base_layer: nn.Module, routing: HypothesisRouting, router_state: RouterState,
                 config: MoEConfig, adapter_dtype: torch.dtype | None = None) -> None:
        super().__init__(base_layer, routing, config.num_experts, config.r, config.alpha, config.dropout,
                         adapter_dtype=adapter_dtype)
        self.router_state = router_state
        self.num_experts = config.num_experts
        self.router = nn.Parameter(torch.zeros(self.in_features, config.num_experts, device=self.lora_A.device,
                                               dtype=self.lora_A.dtype))
        if config.router_init == "normal":
            with torch.no_grad():
                self.router.normal_(0.0, config.router_std)

    def adapter_tensors(self) -> dict[str, nn.Parameter]:
        return {**super().adapter_tensors(), "router": self.router}

    def router_probabilities(self, x: torch.Tensor) -> torch.Tensor:
        """gamma(x) = softmax(x W_gamma), per token: [..., d_in] -> [..., E]."""
        return (x.to(self.router.dtype) @ self.router).softmax(dim=-1)

    def gates(self, x: torch.Tensor) -> torch.Tensor:
        """The weight of each expert for each token: gamma(x), or a one-hot draw from it (sampled routing)."""
        probabilities = self.router_probabilities(x)  # [rows, ..., E]
        if self.router_state.mode == SOFT:
            return probabilities
        if self.router_state.mode != SAMPLED:
            raise RuntimeError(f"unknown router mode {self.router_state.mode!r}")
        experts = self._sample_experts(probabilities)  # [rows, ...]
        return nn.functional.one_hot(experts, self.num_experts).to(probabilities.dtype)

    def _sample_experts(self, probabilities: torch.Tensor) -> torch.Tensor:
        """One expert per token by inverse-CDF sampling; block c of the rows draws its uniforms from generator c,
        so a candidate's draws do not depend on the other candidates decoded beside it."""
        generators = self.router_state.generators
        rows = probabilities.shape[0]
        if rows % len(generators):
            raise RuntimeError(f"{rows} rows cannot be split among {len(generators)} stochastic-router candidates")
        blocks = probabilities.split(rows // len(generators))  # each [rows / C, ..., E]
        uniforms = torch.cat([torch.rand(block.shape[:-1], generator=generator, device=block.device)
                              for block, generator in zip(blocks, generators, strict=True)])  # [rows, ...]
        cumulative = probabilities.float().cumsum(dim=-1)  # [rows, ..., E]
        return (cumulative < uniforms.unsqueeze(-1)).sum(dim=-1).clamp(max=self.num_experts - 1)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)  # [..., d_out]
        if self.routing.mode == DISABLED:
            return result
        gates = self.gates(x)  # [..., E]
        h = self.dropout(x).to(self.lora_A.dtype)  # [..., d_in]
        per_expert = torch.einsum("...d,edr->...er", h, self.lora_A)  # [..., E, r]
        delta = torch.einsum("...er,ero->...o", per_expert * gates.unsqueeze(-1), self.lora_B)  # [..., d_out]
        return result + (delta * self.scaling).to(result.dtype)

    def delta_weight(self, k: int) -> torch.Tensor:
        raise ValueError("a LoRA-MoE layer has no single weight update: its router mixes the experts differently "
                         "for every token, so it cannot be merged into the base weights")

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}, r={self.r}, "
                f"scaling={self.scaling:g}")


class MoEModel(BaselineModel):
    """A frozen transformers model with a LoRA-MoE layer at each target layer. Build it with ``get_moe_model``.

    For ``MCLTrainer`` and ``generate_hypotheses`` it is an MCL model with one hypothesis (an MLE model).
    """

    method = "moe"
    export_refusal = ("a LoRA-MoE model is not K LoRA adapters: its router mixes the experts per token, which PEFT's "
                      "LoRA format cannot hold. Save it with save_pretrained and load it with loramcl.load_mcl_model")
    merge_refusal = ("merge is not defined for LoRA-MoE: the router mixes the experts differently for every token, "
                     "so no single weight update equals the model. Keep the MoE layers (save_pretrained)")

    def __init__(self, model: nn.Module, config: MoEConfig, routing: HypothesisRouting, router_state: RouterState,
                 layer_names: list[str], base: FrozenBase = FrozenBase()) -> None:
        super().__init__(model, config.mle_config(), routing, layer_names, base)
        self.moe_config = config
        self.router_state = router_state

    @property
    def method_config(self) -> MoEConfig:
        return self.moe_config

    @property
    def num_experts(self) -> int:
        return self.moe_config.num_experts

    def router_parameter_count(self) -> int:
        return sum(layer.router.numel() for _, layer in self.mcl_layers())

    def print_trainable_parameters(self) -> None:
        trainable, total = self.parameter_counts()
        print(f"trainable params: {trainable:,} (routers: {self.router_parameter_count():,}) || all params: "
              f"{total:,} || trainable%: {100 * trainable / total:.4f} || experts: {self.num_experts}")

    @contextlib.contextmanager
    def stochastic_router(self, candidates: int, seed: int) -> Iterator[None]:
        """Stochastic router decoding (Zuo et al. 2021; paper App. F) inside the block: every MoE layer uses, for
        each token, one expert drawn from its router's distribution instead of the mixture.

        The rows of each forward are ``candidates`` equal contiguous blocks, e.g. the batch repeated candidate-major
        (beams of a row stay inside its block); block c draws from its own ``torch.Generator`` seeded ``seed + c``,
        so candidate c equals a one-candidate pass with seed ``seed + c``, whatever is decoded beside it.
        """
        if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1:
            raise ValueError(f"candidates must be an integer >= 1, got {candidates!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        device = self.adapter_device()
        state = self.router_state
        saved = (state.mode, state.generators)
        state.mode = SAMPLED
        state.generators = [torch.Generator(device=device).manual_seed(seed + c) for c in range(candidates)]
        try:
            yield
        finally:
            state.mode, state.generators = saved

    @staticmethod
    def structure_of(config: MoEConfig) -> dict:
        return {"num_experts": config.num_experts, "r": config.r, "alpha": config.alpha}


def get_moe_model(model: nn.Module, config: MoEConfig) -> MoEModel:
    """Give ``model`` (any transformers model, modified in place) a LoRA-MoE layer at each target layer.

    Every base parameter is frozen; the experts and routers train.
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    routing, router_state = HypothesisRouting(), RouterState()
    adapter_dtype = torch.float32 if config.adapter_dtype == "float32" else None
    names = target_layer_names(model, config.mle_config())
    check_adapter_size(model, names, config)
    return replace_modules(
        model, names,
        lambda layer: MoELoraLinear(layer, routing, router_state, config, adapter_dtype=adapter_dtype),
        lambda names, base: MoEModel(model, config, routing, router_state, names, base))


def load_from_files(model: nn.Module, path, saved: dict, tensors: dict[str, torch.Tensor],
                    is_trainable: bool, strict: bool = False) -> MoEModel:
    """``load_mcl_model`` for a saved LoRA-MoE model: checked against ``model`` before it is touched."""
    config = method_config(path, saved, "moe", MoEConfig)
    names = target_layer_names(model, config.mle_config())
    e, r = config.num_experts, config.r
    expected = {}
    for name in names:
        d_in, d_out = linear_features(model.get_submodule(name))
        expected.update({f"{name}.lora_A": (e, d_in, r), f"{name}.lora_B": (e, r, d_out),
                         f"{name}.router": (d_in, e)})
    check_tensors_fit(path, saved, tensors, names, expected)
    with known_fingerprint(model, check_base_weights(path, saved, model, strict)):
        moe = get_moe_model(model, config)
    copy_tensors(moe, tensors, is_trainable)
    return moe


__all__ = ["MoEConfig", "MoELoraLinear", "MoEModel", "RouterState", "get_moe_model"]
