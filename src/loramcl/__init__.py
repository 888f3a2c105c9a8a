"""loramcl: K diverse, plausible answers from one language model (LoRA-MCL, ICML 2026).

The public names load on first use, so that `loramcl --help` and `loramcl.metrics` do not import torch and
transformers.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "MCLConfig": "loramcl.config",
    "MCLLoraLinear": "loramcl.layers",
    "MCLModel": "loramcl.model", "MCLOutput": "loramcl.model", "get_mcl_model": "loramcl.model",
    "load_mcl_model": "loramcl.model",
    "MCLTrainer": "loramcl.trainer",
    "generate_hypotheses": "loramcl.generation.decoding", "equal_budget": "loramcl.generation.decoding",
    "EqualBudget": "loramcl.generation.decoding", "Candidate": "loramcl.generation.decoding",
    "mcl_loss": "loramcl.losses", "wta_weights": "loramcl.losses", "relaxed_weights": "loramcl.losses",
    "annealed_weights": "loramcl.losses", "temperature_at": "loramcl.losses",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'loramcl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
