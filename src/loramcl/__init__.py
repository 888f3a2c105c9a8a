"""loramcl: K diverse, plausible answers from one language model (LoRA-MCL, ICML 2026)."""

from loramcl.config import MCLConfig
from loramcl.layers import MCLLoraLinear
from loramcl.losses import annealed_weights, mcl_loss, relaxed_weights, temperature_at, wta_weights
from loramcl.model import MCLModel, MCLOutput, get_mcl_model, load_mcl_model
from loramcl.trainer import MCLTrainer

__version__ = "0.1.0"

__all__ = [
    "MCLConfig", "MCLLoraLinear", "MCLModel", "MCLOutput", "MCLTrainer", "get_mcl_model", "load_mcl_model",
    "mcl_loss", "wta_weights", "relaxed_weights", "annealed_weights", "temperature_at",
]
