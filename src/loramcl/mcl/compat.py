"""Where loramcl relies on transformers beyond its documented API, in one place (docs/architecture.md, "What we rely
on in transformers and PEFT", lists every such reliance, the test that watches it and the check that guards it).

Checked on transformers 5.23 and 5.24 and PEFT 0.21.2 (the oldest and newest releases the test suite passes on; README,
"Versions"). Every check here raises ``UpstreamChanged`` (package, version, what moved and what to do instead) rather
than let a moved internal compute something else.

- The KV cache is handed to a model's forward as ``cache=`` since transformers 5.24 and as ``past_key_values=``
  before (a deprecated alias in 5.24 until 5.40). A name the model does not take lands in its ``**kwargs`` and is
  ignored without a word, so the name is read off the model's own signature (``cache_argument``), and a forward
  pre-hook finds the cache under either name (``given_cache``).
- transformers' gradient-checkpointed decoder layers drop the cache unless their class says
  ``_can_checkpoint_with_cache`` (``checkpointing_keeps_cache``); the context computed once checks afterwards that
  every layer read its shared cache (``loramcl.mcl.context.check_context_read``), which also catches this attribute
  being renamed.
- ``Trainer`` methods that ``MCLTrainer`` overrides although they are private (``check_trainer_methods``): an
  override of a method the base class no longer has is never called, and its behaviour (resuming from a checked
  checkpoint, the adapters' own files, the columns the model takes) would silently stop.
- The generation loop's own steps, which diverse beam search drives (``check_generation_steps``).
- PEFT's matching of target modules (``peft_targets``), so that our layers are the ones a PEFT LoRA with the same
  options adapts, and its table of default targets per model type (``peft_default_targets``).
- PEFT's dequantize / requantize of a quantized base layer (``peft_quantization_backend``), which merging a
  hypothesis into a bitsandbytes or torchao layer uses.
- Token ids outside the model's vocabulary, found before the model runs (``check_token_ids``): torch's embedding
  lookup would end in ``IndexError: index out of range in self`` without saying which id.
- torch's ``torch._dynamo.maybe_mark_dynamic`` (``mark_dynamic``): a compiled forward's sizes that vary per batch.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import transformers
from torch import nn

# The names a model's forward takes its KV cache under, newest first (transformers 5.24 renamed the argument).
CACHE_ARGUMENTS = ("cache", "past_key_values")


class UpstreamChanged(RuntimeError):
    """A transformers internal that loramcl relies on is not as it was in the versions loramcl was tested with."""


def upstream_error(what: str, instead: str, package: str = "transformers") -> UpstreamChanged:
    """The error for a moved internal: the package and version installed, what is not as expected, what to do."""
    version = transformers.__version__ if package == "transformers" else _version_of(package)
    return UpstreamChanged(f"{package} {version}: {what}. loramcl was tested with the versions in its constraints.txt; "
                           f"{instead}, or install those versions, and please report this to loramcl")


def _version_of(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "(not installed)"


def tensor_version(tensor: torch.Tensor) -> int:
    """torch's in-place counter of ``tensor`` (``Tensor._version``: every in-place write, an optimizer step's too, adds
    one): what tells a kept copy of an adapter weight (``MCLLoraLinear``'s transposed A) that the weight changed."""
    version = getattr(tensor, "_version", None)
    if not isinstance(version, int):
        raise upstream_error("Tensor._version, the in-place counter that a kept copy of the adapters' A is checked "
                             "against at CPU decoding, is gone", "decode with torch.enable_grad() meanwhile",
                             package="torch")
    return version


def cache_argument(model: nn.Module) -> str:
    """The keyword under which ``model``'s forward takes a KV cache: ``cache`` (transformers >= 5.24) or
    ``past_key_values`` (older releases), read off the forward's signature."""
    parameters = inspect.signature(model.forward).parameters
    name = next((name for name in CACHE_ARGUMENTS if name in parameters), None)
    if name is None:
        raise upstream_error(f"{type(model).__name__}.forward takes no cache argument (none of {CACHE_ARGUMENTS})",
                             "use MCLConfig(adapt_context=True), which needs no cache of ours")
    return name


def given_cache(kwargs: dict):
    """The cache a forward was handed (``cache=`` or ``past_key_values=``), or None."""
    return next((kwargs[name] for name in CACHE_ARGUMENTS if kwargs.get(name) is not None), None)


@contextlib.contextmanager
def checkpointing_keeps_cache(model: nn.Module) -> Iterator[None]:
    """Let activation-checkpointed layers of ``model`` read a cache: transformers drops the cache in them (a
    recomputed forward would update a growing cache twice), which would silently cut the targets from their shared
    context. Our training cache is never updated in place (``loramcl.mcl.context.SharedContextLayer``), so recomputing
    is safe. Were the attribute renamed, the layers would drop the cache again, which ``check_context_read`` finds."""
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True
              and hasattr(type(m), "_can_checkpoint_with_cache")]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache  # the class's value again


def check_trainer_methods(trainer_class: type, names: Iterable[str]) -> None:
    """Refuse to build ``trainer_class`` when ``transformers.Trainer`` lacks a private method it overrides (the
    override would never be called) or calls."""
    missing = sorted(name for name in names if not callable(getattr(transformers.Trainer, name, None)))
    if missing:
        raise upstream_error(f"transformers.Trainer has no {', '.join(missing)}, which {trainer_class.__name__} "
                             "overrides (resuming, loading the best model, saving the adapters, the model's columns)",
                             "train with the versions loramcl was tested with")


def check_generation_steps(model: nn.Module, names: Iterable[str], feature: str, instead: str) -> None:
    """Refuse ``feature`` when ``model`` lacks a step of transformers' generation loop it drives itself."""
    missing = sorted(name for name in names if not callable(getattr(model, name, None)))
    if missing:
        raise upstream_error(f"{type(model).__name__} has no {', '.join(missing)} (the generation loop's steps that "
                             f"{feature} drives)", instead)


@dataclass
class _TargetProbe:
    """The attributes of a PEFT config that ``check_target_module_exists`` reads."""

    target_modules: list[str] | str
    exclude_modules: list[str] | str | None = None
    target_parameters: None = None
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None
    modules_to_save: None = None


def peft_targets(config, target_modules: list[str] | str, name: str) -> bool:
    """Whether PEFT's own matching (``check_target_module_exists``) adapts module ``name`` for ``target_modules`` and
    ``config``'s ``exclude_modules``, ``layers_to_transform`` and ``layers_pattern``."""
    try:
        from peft.tuners.tuners_utils import check_target_module_exists

        probe = _TargetProbe(target_modules, config.exclude_modules, None, config.layers_to_transform,
                             config.layers_pattern)
        return bool(check_target_module_exists(probe, name))
    except (ImportError, AttributeError) as error:
        raise upstream_error(f"PEFT's check_target_module_exists is not as loramcl uses it ({error})",
                             "list the full names of the layers to adapt in MCLConfig.target_modules",
                             package="peft") from error


def peft_default_targets() -> dict:
    """PEFT's default LoRA target modules per ``model_type``."""
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    except ImportError as error:
        raise upstream_error(f"PEFT has no default target modules table ({error})",
                             "set MCLConfig.target_modules", package="peft") from error
    return TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING


def peft_quantization_backend(layer: nn.Module, model: nn.Module):
    """PEFT's ``QuantizationBackend`` of a quantized ``layer`` of ``model`` (``peft.utils.quantization_utils``, PEFT
    0.20 on): its ``get_base_weight`` dequantizes the layer's weight, ``set_base_weight(holder, weight)`` requantizes
    into ``holder.get_base_layer()``, ``supports_merge`` says whether both work."""
    try:
        from peft.utils.quantization_utils import get_quantization_kwargs, resolve_quantization_backend

        backend = resolve_quantization_backend(layer, **get_quantization_kwargs(model))
    except (ImportError, AttributeError, TypeError) as error:
        raise upstream_error(f"PEFT's quantization_utils are not as loramcl uses them ({error})",
                             "merge on an unquantized base model", package="peft") from error
    if backend is None or not all(hasattr(backend, name) for name in ("get_base_weight", "set_base_weight")):
        raise upstream_error(f"PEFT's resolve_quantization_backend gives {backend!r} for a {type(layer).__name__}",
                             "merge on an unquantized base model", package="peft")
    return backend


def check_token_ids(model: nn.Module, input_ids: torch.Tensor | None, name: str = "input_ids") -> None:
    """Raise a ValueError naming the first id of ``input_ids`` [B, T] outside [0, vocabulary size of ``model``'s
    input embeddings), its row and the vocabulary size. One comparison and one sync when they are fine."""
    bad = bad_token_ids(model, input_ids)
    if bad is not None and bad.any().item():
        raise_bad_token_ids(model, input_ids, bad, name)


def bad_token_ids(model: nn.Module, input_ids: torch.Tensor | None) -> torch.Tensor | None:
    """[B, T] bool: the ids of ``input_ids`` outside ``model``'s vocabulary (placeholders it replaces excepted), on
    the device, unread; None where nothing can be checked (no ids, no embedding matrix)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.numel() == 0 or input_ids.is_floating_point():
        return None
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    if weight is None or weight.dim() != 2:
        return None
    vocabulary = weight.shape[0]
    bad = (input_ids < 0) | (input_ids >= vocabulary)
    placeholders = _placeholder_ids(getattr(model, "config", None), vocabulary)
    if placeholders:  # e.g. LLaVA's image token may lie past the text embeddings: the model replaces it first
        bad &= ~torch.isin(input_ids, torch.tensor(placeholders, device=input_ids.device))
    return bad


def raise_bad_token_ids(model: nn.Module, input_ids: torch.Tensor, bad: torch.Tensor, name: str = "input_ids"):
    """The ValueError of ``check_token_ids`` for ``bad`` (``bad_token_ids``, holding at least one True)."""
    vocabulary = model.get_input_embeddings().weight.shape[0]
    position = bad.nonzero()[0].tolist()
    value = input_ids[tuple(position)].item()
    where = f"row {position[0]}" + (f", position {position[1]}" if len(position) > 1 else "")
    raise ValueError(f"{name} holds {value} ({where}), outside this model's vocabulary of {vocabulary} tokens "
                     f"(ids 0..{vocabulary - 1}): were the inputs tokenized with another tokenizer? (-100 belongs in "
                     "labels, never in input_ids)")


def mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Tell ``torch.compile`` that ``tensor``'s size on ``dim`` varies from call to call (``torch._dynamo.
    maybe_mark_dynamic``, torch's documented way, outside ``torch.compiler``): the first graph is compiled for any
    size, not specialised and recompiled once. Without it (a torch that moved it), the same happens one graph later."""
    mark = getattr(getattr(torch, "_dynamo", None), "maybe_mark_dynamic", None)
    if mark is not None:
        mark(tensor, dim)


def _placeholder_ids(config, vocabulary: int) -> list[int]:
    """The special ids a multimodal config names (``image_token_id``, ``audio_token_index``, ...) that lie outside
    ``[0, vocabulary)``: its model swaps them for its own features before the embedding lookup."""
    ids = []
    for owner in (config, getattr(config, "text_config", None)):
        for key, value in (vars(owner).items() if owner is not None else ()):
            if key.endswith(("_token_id", "_token_index")) and isinstance(value, int) and not isinstance(value, bool) \
                    and not 0 <= value < vocabulary:
                ids.append(value)
    return ids
