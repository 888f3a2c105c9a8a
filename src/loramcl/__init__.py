"""loramcl: K diverse, plausible answers from one language model (LoRA-MCL, ICML 2026).

The public names load on first use, so that `loramcl --help` and `loramcl.metrics` do not import torch and
transformers.
"""

from loramcl._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "MCLConfig": "loramcl.config", "DataConfig": "loramcl.config", "TrainConfig": "loramcl.config",
    "MCLLoraLinear": "loramcl.layers",
    "MCLModel": "loramcl.model", "MCLOutput": "loramcl.model", "get_mcl_model": "loramcl.model",
    "load_mcl_model": "loramcl.model",
    "MCLTrainer": "loramcl.trainer",
    "generate_hypotheses": "loramcl.generation.decoding", "equal_budget": "loramcl.generation.budget",
    "EqualBudget": "loramcl.generation.budget", "Candidate": "loramcl.generation.candidates",
    "Decoding": "loramcl.generation.options",
    "mcl_loss": "loramcl.losses", "wta_weights": "loramcl.losses", "relaxed_weights": "loramcl.losses",
    "annealed_weights": "loramcl.losses", "temperature_at": "loramcl.losses",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
