"""Trainable-parameter parity between LoRA-MCL and its baselines (paper §4, App. F): same LoRA layers, same count.

LoRA-MCL with K hypotheses of rank r trains K * r * (d_in + d_out) numbers per adapted layer. LoRA-MLE matches it
exactly with rank K * r; LoRA-MoE with E = K experts of rank r matches it with its experts, and its routers add
d_in * E per layer (the paper's setting: the same LoRA configuration, K experts). Multi-head MCL cannot be matched
(it trains K copies of a whole module); its count is reported when a module is named. With a shared adapter of rank s
(``MCLConfig.shared_r``) LoRA-MCL trains (K * r + s) * (d_in + d_out) per layer, and LoRA-MLE matches it with rank
K * r + s; LoRA-MoE's E = K experts of rank r then train s * (d_in + d_out) fewer per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from loramcl.mcl.build import target_layer_names
from loramcl.mcl.config import MCLConfig
from loramcl.mcl.layers import linear_features


@dataclass(frozen=True)
class ParameterParity:
    """Trainable counts of LoRA-MCL and of its baselines at the same LoRA layers."""

    num_hypotheses: int
    r: int
    layers: int
    """Adapted layers (those matched by target_modules)."""
    mcl: int
    """LoRA-MCL: K hypotheses of rank r (and the shared adapter of rank shared_r)."""
    mle_rank: int
    """LoRA-MLE rank with the same trainable count: K * r (+ shared_r)."""
    mle: int
    moe_num_experts: int
    moe_rank: int
    moe_experts: int
    """LoRA-MoE's experts (E = K of rank r): equal to ``mcl`` (without a shared adapter)."""
    moe_routers: int
    """LoRA-MoE's routers: d_in * E per layer, the MoE's only excess over LoRA-MCL."""
    multihead: int | None = None
    """K copies of the named module (multi-head MCL), if one was named."""
    shared_r: int = 0
    """The rank of LoRA-MCL's shared adapter (``MCLConfig.shared_r``), counted in ``mcl`` and ``mle_rank``."""

    @property
    def moe(self) -> int:
        return self.moe_experts + self.moe_routers

    def summary(self) -> str:
        mcl = f"K={self.num_hypotheses} r={self.r}" + (f" shared_r={self.shared_r}" if self.shared_r else "")
        lines = [f"LoRA-MCL  {mcl} on {self.layers} layers: {self.mcl:,} trainable",
                 f"LoRA-MLE  r={self.mle_rank}: {self.mle:,}",
                 f"LoRA-MoE  E={self.moe_num_experts} r={self.moe_rank}: {self.moe:,} = {self.moe_experts:,} experts "
                 f"+ {self.moe_routers:,} routers ({100 * (self.moe - self.mcl) / self.mcl:.2f}% more than LoRA-MCL)"]
        if self.multihead is not None:
            lines.append(f"multi-head K={self.num_hypotheses}: {self.multihead:,} "
                         f"({self.multihead / self.mcl:.3g}x LoRA-MCL)")
        return "\n".join(lines)


def parameter_parity(model: nn.Module, num_hypotheses: int, r: int, target_modules: list[str] | str | None = None,
                     multihead_module: str | None = None, shared_r: int = 0) -> ParameterParity:
    """The LoRA-MLE rank and the LoRA-MoE (E, r) with LoRA-MCL's trainable count on ``model``'s target layers.

    ``model`` is the plain base model (nothing is modified). ``target_modules`` as in ``MCLConfig``.
    """
    config = MCLConfig(num_hypotheses=num_hypotheses, r=r, target_modules=target_modules, shared_r=shared_r)
    names = target_layer_names(model, config)  # checked non-empty
    dims = [linear_features(model.get_submodule(name)) for name in names]
    per_rank = sum(d_in + d_out for d_in, d_out in dims)  # one rank-1 adapter on every layer
    mcl = (num_hypotheses * r + shared_r) * per_rank
    routers = sum(d_in for d_in, _ in dims) * num_hypotheses
    multihead = None
    if multihead_module is not None:
        multihead = num_hypotheses * sum(p.numel() for p in model.get_submodule(multihead_module).parameters())
    return ParameterParity(num_hypotheses=num_hypotheses, r=r, layers=len(names), mcl=mcl,
                           mle_rank=num_hypotheses * r + shared_r, mle=mcl, moe_num_experts=num_hypotheses, moe_rank=r,
                           moe_experts=num_hypotheses * r * per_rank, moe_routers=routers, multihead=multihead,
                           shared_r=shared_r)


__all__ = ["ParameterParity", "parameter_parity"]
