"""loramcl: K diverse, plausible answers from one language model (LoRA-MCL, ICML 2026).

The public names load on first use, so that `loramcl --help` and `loramcl.metrics` do not import torch and
transformers.
"""

from loramcl.utils.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "MCLConfig": "loramcl.mcl.config",
    "DataConfig": "loramcl.training.config", "TrainConfig": "loramcl.training.config",
    "MCLLoraLinear": "loramcl.mcl.layers",
    "MCLModel": "loramcl.mcl.model", "MCLOutput": "loramcl.mcl.model", "get_mcl_model": "loramcl.mcl.build",
    "load_mcl_model": "loramcl.models.mcl", "to_peft": "loramcl.mcl.export",
    "assemble_hypotheses": "loramcl.mcl.ensemble",
    "MCLTrainer": "loramcl.training.trainer", "MCLTrainingArguments": "loramcl.training.arguments",
    "generate_hypotheses": "loramcl.decoding.strategies", "equal_budget": "loramcl.decoding.budget",
    "EqualBudget": "loramcl.decoding.budget", "Candidate": "loramcl.decoding.candidates",
    "Decoding": "loramcl.decoding.options",
    "mcl_loss": "loramcl.mcl.losses", "wta_weights": "loramcl.mcl.losses", "relaxed_weights": "loramcl.mcl.losses",
    "annealed_weights": "loramcl.mcl.losses", "temperature_at": "loramcl.mcl.losses",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
