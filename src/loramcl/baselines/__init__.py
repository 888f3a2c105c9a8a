"""The paper's trained baselines, trained through ``MCLTrainer`` and decoded through ``generate_hypotheses`` as
LoRA-MCL is, so that comparisons are fair by construction (App. F, App. H.1).

- ``moe``: LoRA-MoE, a soft mixture of E LoRA experts per layer with a per-token router; MLE decoding and
  stochastic-router decoding (``generate_hypotheses(strategy="stochastic_router")``).
- ``multihead``: multi-head MCL, one module (the LM head, a multimodal projector) duplicated K times.
- ``parity``: the LoRA-MLE rank and LoRA-MoE (E, r) with LoRA-MCL's trainable count.

LoRA-MLE is LoRA-MCL with K = 1 (``MCLConfig(num_hypotheses=1, r=K*r)``). Models of every method are saved with
``save_pretrained`` and loaded with ``loramcl.load_mcl_model``: each baseline registers its loader here
(``loramcl.mcl.methods.register_method``), so the method's room never names a baseline; ``load_mcl_model``'s room
(``loramcl.models.mcl``) imports this package, so the loaders are registered whatever the caller imported.
"""

from loramcl.mcl import methods as _methods
from loramcl.utils.lazy import lazy_exports

_EXPORTS = {
    "MoEConfig": "loramcl.baselines.config", "MoEModel": "loramcl.baselines.moe",
    "MoELoraLinear": "loramcl.baselines.moe", "get_moe_model": "loramcl.baselines.moe",
    "MultiHeadConfig": "loramcl.baselines.config", "MultiHeadModel": "loramcl.baselines.multihead",
    "HypothesisHeads": "loramcl.baselines.multihead", "get_multihead_model": "loramcl.baselines.multihead",
    "ParameterParity": "loramcl.baselines.parity", "parameter_parity": "loramcl.baselines.parity",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)


# The loaders import their baseline on first use: this package imports no torch.
def _load_moe(model, path, saved, tensors, is_trainable, strict):
    from loramcl.baselines.moe import load_from_files

    return load_from_files(model, path, saved, tensors, is_trainable, strict)


def _load_multihead(model, path, saved, tensors, is_trainable, strict):
    from loramcl.baselines.multihead import load_from_files

    return load_from_files(model, path, saved, tensors, is_trainable, strict)


_methods.register_method("moe", _load_moe)
_methods.register_method("multihead", _load_multihead)
