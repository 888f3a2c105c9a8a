"""The K hypotheses out of loramcl, into the engines users serve with: every hypothesis as a standard PEFT LoRA
folder (``export_all``: DIR/h0 ... DIR/h{K-1}), or in memory as named adapters h0 ... of one ``PeftModel``
(``to_peft``), which PEFT's mixed-adapter batches, vLLM, SGLang, LoRAX and llama.cpp's converter read.

Engines differ in what they read (docs/guide/serving.md): ``fold_scaling`` writes the scaling into lora_B for those
that read ``lora_alpha`` only (llama.cpp ignores ``use_rslora``); ``serving_warnings`` names what vLLM or llama.cpp
would refuse or silently leave out; context-once hypotheses (``adapt_context=False``) leave as PEFT's activated
LoRA where that is the same model (``peft_interop.activated_lora_refusal``).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from loramcl.mcl.peft_interop import (
    _remove_adapters,
    export_hypothesis,
    hypothesis_tensors,
    peft_lora_config,
)

# vLLM's --max-lora-rank accepts these ranks only (vllm.config.LoRAConfig, as of vLLM 0.11); an adapter of another
# rank is served only with a larger max_lora_rank, its tensors padded to it.
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The layers engines adapt in the decoder-only LMs they serve LoRA for: the attention and MLP projections under
# transformers' Llama/Mistral/Qwen/Gemma names (vLLM's models pack q/k/v into qkv_proj and gate/up into gate_up_proj,
# which Phi-3 names so too; llama.cpp's convert_lora_to_gguf.py maps them to attn_q/k/v/output, ffn_gate/up/down).
# Another layer may be served by one engine and not the other: the warning says to check.
SERVED_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                            "qkv_proj", "gate_up_proj"})
# Words of the modules outside a multimodal model's language model: vLLM applies LoRA to the language model only.
_TOWER_WORDS = ("vision", "visual", "audio", "image", "projector", "multi_modal")


class ServingWarning(UserWarning):
    """An exported adapter that some serving engine would refuse, or serve otherwise than PEFT does."""


def chosen_hypotheses(model, hypotheses: list[int] | None) -> list[int]:
    """The hypotheses to export, in order (None: all K), each checked in range and named once."""
    k_total = model.num_hypotheses
    chosen = list(range(k_total)) if hypotheses is None else list(hypotheses)
    if not chosen:
        raise ValueError(f"hypotheses is empty: give some of 0 to {k_total - 1}, or leave it out for all {k_total}")
    for k in chosen:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < k_total:
            raise ValueError(f"hypotheses: {k!r} is no hypothesis of this model; it has {k_total}, numbered 0 to "
                             f"{k_total - 1}")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"hypotheses {chosen} names a hypothesis twice")
    return chosen


def export_all(model, path: str | os.PathLike, hypotheses: list[int] | None = None, fold_scaling: bool = False,
               alora_invocation_tokens: list[int] | None = None) -> list[str]:
    """Write hypotheses ``hypotheses`` (default: all K) of ``model`` as PEFT LoRA folders ``path/h{k}``; returns
    them. A refusal (a baseline, context-once hypotheses without an exact activated-LoRA form) comes before any
    file is written (``export_hypothesis`` checks before it writes); what an engine would not serve as PEFT does is
    a ``ServingWarning``."""
    chosen = chosen_hypotheses(model, hypotheses)
    folders = [export_hypothesis(model, k, Path(path) / f"h{k}", fold_scaling=fold_scaling,
                                 alora_invocation_tokens=alora_invocation_tokens) for k in chosen]
    warn_serving(model, fold_scaling)
    return folders


def to_peft(model, hypotheses: list[int] | None = None, fold_scaling: bool = False, inplace: bool = False):
    """A ``peft.PeftModel`` on the base model holding hypotheses ``hypotheses`` (default: all K) as named LoRA
    adapters ``h0``, ``h1``, ... (the names ``export_all`` gives their folders), ``h{first}`` active: PEFT's own API
    then switches (``set_adapter``), mixes (``generate(..., adapter_names=[...])``) or merges them.

    The base model is copied first, so ``model`` stays usable; ``inplace=True`` takes the base model itself (no copy
    of its weights) and leaves ``model`` unusable, as ``merge_hypothesis(..., inplace=True)``. Refused as
    ``export_hypothesis`` refuses (context-once hypotheses: use ``export_all`` with ``alora_invocation_tokens``)."""
    from peft import get_peft_model, set_peft_model_state_dict

    chosen = chosen_hypotheses(model, hypotheses)
    if model.export_refusal:
        raise ValueError(model.export_refusal)
    if not model.mcl_config.adapt_context:
        raise ValueError("these hypotheses were trained with adapt_context=False: they act only from the last prompt "
                         "token on, and a PeftModel's LoRA acts at every position: export them as activated LoRA "
                         "(export_all(..., alora_invocation_tokens=[the token every prompt ends with])) or decode "
                         "with this MCLModel")
    config = peft_lora_config(model, fold_scaling)
    tensors = {k: hypothesis_tensors(model, k, fold_scaling) for k in chosen}
    device = next(layer.lora_A.device for _, layer in model.mcl_layers())
    base = _remove_adapters(model, None, inplace, "handed to PEFT in place (to_peft(..., inplace=True))")
    names = [f"h{k}" for k in chosen]
    peft = get_peft_model(base, config, adapter_name=names[0])
    for name in names[1:]:
        peft.add_adapter(name, config)
    for k, name in zip(chosen, names, strict=True):
        result = set_peft_model_state_dict(peft, {key: value.to(device) for key, value in tensors[k].items()},
                                           adapter_name=name)
        missing = [key for key in result.missing_keys if ".lora_" in key and key.endswith(f".{name}.weight")]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"PEFT did not take hypothesis {k} whole (missing {missing[:2]}, unexpected "
                               f"{list(result.unexpected_keys)[:2]}): report this with the installed PEFT version")
    peft.set_adapter(names[0])
    return peft.eval()


def warn_serving(model, fold_scaling: bool) -> list[str]:
    """``ServingWarning`` for each way vLLM or llama.cpp would not serve these adapters as PEFT does; returns the
    messages."""
    cfg = model.mcl_config
    messages = []
    rank = cfg.lora_rank  # the exported rank: shared_r + r with a shared adapter
    if rank not in VLLM_RANKS:
        larger = next((allowed for allowed in VLLM_RANKS if allowed > rank), None)
        messages.append(f"rank {rank} is not one of vLLM's max_lora_rank values ({', '.join(map(str, VLLM_RANKS))}):"
                        f" serve with --max-lora-rank {larger} (padded), or train with one of them")
    if cfg.use_rslora and not fold_scaling:
        messages.append("these adapters use rsLoRA (alpha/sqrt(r)): llama.cpp's convert_lora_to_gguf.py reads "
                        f"lora_alpha only and would scale them by alpha/r, {rank ** 0.5:.3g}x too weak: export with "
                        "fold_scaling (--fold_scaling) for llama.cpp")
    if getattr(model.config, "is_encoder_decoder", False):
        messages.append(f"{type(model.base_model).__name__} is an encoder-decoder: vLLM and llama.cpp serve LoRA "
                        "adapters of decoder-only LMs; serve these with PEFT")
    towers = [name for name in model.layer_names if any(word in name for word in _TOWER_WORDS)]
    if towers:
        messages.append(f"{len(towers)} adapted layers are outside the language model (e.g. '{towers[0]}'): vLLM "
                        "applies LoRA to the language model only and would serve these hypotheses without them")
    others = sorted({name.rsplit(".", 1)[-1] for name in model.layer_names} - SERVED_MODULES)
    if others and not towers:
        messages.append(f"target modules {others} are not among the projections vLLM and llama.cpp adapt in the "
                        f"models they serve LoRA for ({', '.join(sorted(SERVED_MODULES))}): check that your engine "
                        "adapts them for this architecture, or it may refuse or skip them")
    for message in messages:
        warnings.warn(message, ServingWarning, stacklevel=3)
    return messages
