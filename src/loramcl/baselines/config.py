"""Configurations of the baselines (torch-free, so that `loramcl --help` stays fast): LoRA-MoE and multi-head MCL."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from loramcl.mcl.config import MCLConfig, without_defaults_added_later
from loramcl.utils.validate import names_its_options, require, require_int, require_real

ROUTER_INITS: tuple[str, ...] = ("zeros", "normal")
# A router's logits start with a standard deviation of about router_std x the norm of its input (sqrt(d_in) for
# unit features, 5.7 for the narrowest test model): past 10 every token of any model starts on one expert with a
# saturated softmax (no gradient for the router). transformers initialises linear layers with 0.02.
MAX_ROUTER_STD = 10.0
INITS: tuple[str, ...] = ("copy", "random")
ROUTER_STD = 0.01  # MoEConfig.router_std's default


class _Dictionary:
    """JSON round trip of a configuration dataclass, refusing unknown fields by name."""

    def to_dict(self) -> dict:
        return without_defaults_added_later(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, values: dict):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {unknown}; known fields are {sorted(known)}")
        return cls(**values)


@names_its_options
@dataclass
class MoEConfig(_Dictionary):
    """E LoRA experts of rank r per adapted layer, mixed per token by a softmax router (paper App. F).

    The paper's LoRA-MoE has E = K experts with the LoRA configuration of LoRA-MCL, so its experts hold the same
    trainable count as the K hypotheses; the routers add d_in * E per layer (``parameter_parity`` reports both).
    """

    num_experts: int = 2
    """E, the number of LoRA experts per adapted layer. E = 1 is plain LoRA fine-tuning."""

    r: int = 8
    """LoRA rank of every expert."""

    alpha: float = 8.0
    """LoRA scaling numerator: each expert's output is multiplied by alpha / r."""

    dropout: float = 0.0
    """Dropout on the experts' input (not on the router's, nor on the frozen branch), in training mode only."""

    target_modules: list[str] | str | None = None
    """Layers that get experts, matched as ``MCLConfig.target_modules`` (PEFT's matching)."""

    router_init: Literal["zeros", "normal"] = "zeros"
    """Router weights at initialisation: 'zeros' (uniform mixing, the paper's) or 'normal' (N(0, router_std^2))."""

    router_std: float = ROUTER_STD
    """Standard deviation of the router weights when router_init='normal'."""

    adapter_dtype: Literal["float32", "base"] = "float32"
    """dtype of the experts, the router and their matmuls, as ``MCLConfig.adapter_dtype``."""

    def __post_init__(self) -> None:
        require_int("num_experts", self.num_experts, what="(E)")
        require(self.router_init in ROUTER_INITS, f"router_init must be one of {ROUTER_INITS}, got "
                f"{self.router_init!r}", "router_init")
        require_real("router_std", self.router_std, low=0.0, high=MAX_ROUTER_STD, low_open=True,
                     hint=" (the router's initial logits grow with it; transformers' layers start with 0.02)")
        require(self.router_init == "normal" or self.router_std == ROUTER_STD, f"router_std {self.router_std!r} "
                f"draws the router's initial weights when router_init is 'normal', and router_init is "
                f"{self.router_init!r}: set router_init normal, or leave router_std out", "router_std")
        self.mle_config()  # r, alpha, dropout, target_modules and adapter_dtype are checked as MCLConfig checks them

    def mle_config(self) -> MCLConfig:
        """The model seen as one hypothesis trained with plain NLL: what ``MCLTrainer`` and the files read."""
        return MCLConfig(num_hypotheses=1, r=self.r, alpha=self.alpha, dropout=self.dropout,
                         target_modules=self.target_modules, adapter_dtype=self.adapter_dtype)


@names_its_options
@dataclass
class MultiHeadConfig(_Dictionary):
    """K copies of one module of a frozen model, trained as K hypotheses (paper App. H.1).

    The loss fields mean what they mean in ``MCLConfig`` (and are checked by it).
    """

    num_hypotheses: int = 2
    """K, the number of copies of the module."""

    module: str = "lm_head"
    """Full name of the module to duplicate, as in ``model.named_modules()``: 'lm_head', or e.g.
    'model.multi_modal_projector' (LLaVA-NeXT, Qwen2-Audio)."""

    init: Literal["copy", "random"] = "copy"
    """'copy': every copy starts as the pretrained module; 'random': each copy is re-initialised by the model's
    ``_init_weights`` (a different draw per copy)."""

    loss: Literal["wta", "relaxed", "annealed"] = "wta"
    """As ``MCLConfig.loss``: 'wta' (eq. 2), 'relaxed' (eq. 4) or 'annealed' (eq. 5)."""

    epsilon: float = 0.0
    """As ``MCLConfig.epsilon`` (relaxed WTA)."""

    epsilon_form: Literal["paper", "mean"] = "paper"
    """As ``MCLConfig.epsilon_form``: 'mean' weighs epsilon as the released code's multi-head audio model does (the
    paper's multi-head rows, App. H.1, were most likely trained so)."""

    temperature0: float = 1.0
    """As ``MCLConfig.temperature0`` (annealed MCL)."""

    temperature_decay: float = 0.999
    """As ``MCLConfig.temperature_decay`` (annealed MCL)."""

    temperature_min: float = 1e-6
    """As ``MCLConfig.temperature_min`` (annealed MCL)."""

    dtype: Literal["float32", "base"] = "float32"
    """dtype of the trained copies and their compute: 'float32' (as LoRA adapters by default, so a bfloat16 or
    float16 model still trains them stably; outputs are cast back to the input's dtype) or 'base' (the module's)."""

    def __post_init__(self) -> None:
        if not isinstance(self.module, str) or not self.module:
            raise ValueError(f"module must be the name of a module of the model (e.g. 'lm_head'), got {self.module!r}")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        if self.dtype not in ("float32", "base"):
            raise ValueError(f"dtype must be 'float32' or 'base', got {self.dtype!r}")
        self.loss_config()  # K and the loss fields are checked as MCLConfig checks them

    def loss_config(self) -> MCLConfig:
        """The hypotheses and their loss as ``MCLTrainer`` and ``mcl_loss`` read them (no LoRA fields apply)."""
        return MCLConfig(num_hypotheses=self.num_hypotheses, loss=self.loss, epsilon=self.epsilon,
                         epsilon_form=self.epsilon_form,
                         temperature0=self.temperature0, temperature_decay=self.temperature_decay,
                         temperature_min=self.temperature_min, tie_break="lowest")  # the paper's baseline


__all__ = ["MoEConfig", "MultiHeadConfig"]
