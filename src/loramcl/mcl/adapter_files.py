"""The files of an MCL model: ``mcl_adapters.safetensors`` (every hypothesis' lora_A [K, d_in, r] and lora_B
[K, r, d_out], with a shared adapter its shared_A [d_in, s] and shared_B [s, d_out], the scoring head) and
``mcl_config.json`` (the method's configuration, the adapted layers, the weights'
SHA-256, the dtypes of the tensors, the SHA-256 of the settings that change the outputs, the base weights'
fingerprint). Saving, loading into a model, and reading with every check made before a weight is copied (so a failed
load leaves the model as it was).

What loading verifies, and what it only warns about (``strict=True`` makes every warning an error):
- the weights file's bytes against ``weights_sha256`` (a file without it: a warning, it cannot be verified);
- the settings that change the outputs (the method's configuration less ``TRAINING_SETTINGS``, and the tensors' dtypes
  as saved) against ``settings_sha256``: an edited ``mcl_config.json`` is refused, naming each edited field with the
  value saved, which the weights file's header also holds (``SETTINGS_METADATA``, covered by ``weights_sha256``).
  Files written before this field: a warning, the settings cannot be verified;
- the tensors' dtypes against ``weights_dtypes``: tensors converted after save (e.g. to float16) warn, naming both;
- the base weights' fingerprint (``loramcl.mcl.fingerprint``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from torch import nn

from loramcl.mcl.config import MCLConfig, saved_values
from loramcl.mcl.fingerprint import check_wrapped_base_weights, whole_tensor
from loramcl.mcl.scores import HypothesisScores
from loramcl.utils.files import sha256, write_atomically, write_json
from loramcl.utils.inputs import MCL_CONFIG, MCL_WEIGHTS, AdapterFilesWarning

CONFIG_NAME = MCL_CONFIG
WEIGHTS_NAME = MCL_WEIGHTS
FORMAT_VERSION = 1
SCORING_PREFIX = "scoring"  # the scoring head's tensors in mcl_adapters.safetensors: scoring.weight, scoring.bias
SHARED_PARTS = ("shared_A", "shared_B")  # the shared adapter's tensors of a layer (MCLConfig.shared_r > 0)
SETTINGS_METADATA = "loramcl_settings"  # the output settings in the weights file's header, to name an edited field
# Fields of a method's configuration that only shape training (its loss, dropout, initialisation) or how the NLL is
# computed (in chunks, to the same values): editing them in mcl_config.json changes no output of the saved adapters
# (e.g. to continue training with another loss). Every other field is covered by settings_sha256.
TRAINING_SETTINGS = frozenset({"dropout", "loss", "epsilon", "epsilon_form", "temperature0", "temperature_decay",
                               "temperature_min", "tie_break", "scoring_weight", "logits_chunk_size", "router_init",
                               "router_std", "init", "balance", "balance_rate", "split_after", "split_noise"})
# Settings that name a set of layers (which ones an adapter is on): the order of their lists changes nothing.
ORDER_FREE = frozenset({"target_modules", "exclude_modules", "layers_to_transform"})
STRICT_HINT = "strict=True, or --strict true in loramcl generate / nll, refuses this"


def adapter_state_dict(model, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """{'<layer>.lora_A': [K, d_in, r], '<layer>.lora_B': [K, r, d_out]} (and '<layer>.shared_A' [d_in, s],
    '<layer>.shared_B' [s, d_out] with a shared adapter) on CPU, from ``state_dict`` (e.g.
    one Trainer gathered from DeepSpeed/FSDP) when given, else from this model. Adapters sharded by FSDP2
    (``fully_shard``: DTensors) are gathered whole, a collective that every rank must call."""
    tensors = {}
    for name, layer in model.mcl_layers():
        for part, param in layer.adapter_tensors().items():
            key = f"{name}.{part}"
            value = (param if state_dict is None else state_dict[f"base_model.{key}"]).detach()
            tensors[key] = whole_tensor(value).to("cpu").contiguous()
    if model.scoring_head is not None:  # 'scoring.weight' [K, d], 'scoring.bias' [K]
        for part, param in model.scoring_head.named_parameters():
            value = (param if state_dict is None else state_dict[f"scoring_head.{part}"]).detach()
            tensors[f"{SCORING_PREFIX}.{part}"] = whole_tensor(value).to("cpu").contiguous()
    return tensors


def save_pretrained(model, path: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None) -> str:
    """Write the K hypotheses: ``mcl_adapters.safetensors`` and ``mcl_config.json`` (no pickle), each file
    written under a temporary name and renamed when whole. The config records the weights' SHA-256 and the
    settings' (see the module docstring), which loading verifies."""
    tensors = model.adapter_state_dict(state_dict)
    if not writes_here(model):
        return str(path)  # FSDP2: every rank gathers the shards (above), rank 0 writes
    os.makedirs(path, exist_ok=True)
    weights = os.path.join(path, WEIGHTS_NAME)
    meta = {"loramcl_format": FORMAT_VERSION, **method_metadata(model), "weights_dtypes": dtypes_of(tensors)}
    settings = output_settings(meta)
    write_atomically(weights, lambda tmp: safetensors.torch.save_file(
        tensors, tmp, metadata={"format": "pt", "loramcl_format": str(FORMAT_VERSION),
                                SETTINGS_METADATA: json.dumps(settings, sort_keys=True)}))
    meta.update({
        "base_model_name_or_path": getattr(model.config, "_name_or_path", None) or None,
        "base_model_class": type(model.base_model).__name__,
        "adapted_modules": model.layer_names,
        "weights_sha256": sha256(weights),
        "settings_sha256": _digest(canonical(settings)),
        "base_fingerprint": model.frozen_base.fingerprint,
    })
    write_json(os.path.join(path, CONFIG_NAME), meta, indent=2)
    return str(path)


def method_metadata(model) -> dict:
    """What ``save_pretrained`` writes to rebuild the model: its method's configuration (``method`` and
    ``method_config``); LoRA-MCL's files name no method."""
    if model.method == "mcl":
        return {"mcl_config": model.method_config.to_dict()}
    return {"method": model.method, f"{model.method}_config": model.method_config.to_dict()}


def load_adapters(model, path: str | os.PathLike, verify: bool = True, strict: bool = False,
                  is_trainable: bool = False) -> None:
    """Load adapter weights written by ``save_pretrained`` into this model (same layers and the same settings
    that change the outputs: K, r, alpha, use_rslora, adapt_context, ...), then put it in eval mode unless
    ``is_trainable=True`` (the trainer's resume: its modes are the trainer's to set). Which tensors train is left as
    the model was built.

    Everything is checked before any weight is copied (see ``read_adapters``; ``verify=False`` skips the
    checksums), so a failed load leaves the model as it was. Adapters saved on other base weights, and files that
    cannot be verified, warn (raise with ``strict=True``), as in ``load_mcl_model``."""
    saved, config, tensors = read_adapters(path, verify, strict)
    ours = model.mcl_config
    if config.scoring != ours.scoring:
        raise ValueError(f"{path} {'has' if config.scoring else 'has no'} hypothesis scores (scoring="
                         f"{config.scoring}); this model was built with scoring={ours.scoring}")
    # every field, those to_dict leaves out at their default included (a shared_r of 4 against none)
    theirs, mine = (output_settings({"mcl_config": dataclasses.asdict(c)})["mcl_config"] for c in (config, ours))
    differing = [name for name in sorted(mine) if not same_setting(name, theirs.get(name), mine[name])]
    if differing:
        raise ValueError(f"{path} holds adapters with {', '.join(f'{n}={theirs.get(n)!r}' for n in differing)}; "
                         f"this model has {', '.join(f'{n}={mine[n]!r}' for n in differing)}")
    layers = dict(model.mcl_layers())
    check_adapters_fit(path, saved, config, tensors, model.layer_names,
                        {name: (layer.in_features, layer.out_features) for name, layer in layers.items()})
    check_scoring_fits(path, tensors, model.scoring_head)
    check_wrapped_base_weights(path, saved, model.base_model, model.frozen_base.fingerprint, strict)
    with torch.no_grad():
        for name, layer in layers.items():
            for part, param in layer.adapter_tensors().items():  # lora_A, lora_B (shared_A, shared_B)
                _copy_whole(param, tensors[f"{name}.{part}"])
        copy_scoring_head(model.scoring_head, tensors)
    if not is_trainable:
        model.eval()


def copy_scoring_head(head: HypothesisScores | None, tensors: dict[str, torch.Tensor]) -> None:
    """The saved head's values, if ``tensors`` has one (else the head keeps its zero initialisation)."""
    if head is not None and f"{SCORING_PREFIX}.weight" in tensors:
        with torch.no_grad():
            for part, param in head.named_parameters():
                _copy_whole(param, tensors[f"{SCORING_PREFIX}.{part}"])


def _copy_whole(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy the whole tensor ``value`` into ``param``; a DTensor (an FSDP2 shard, e.g. resuming under FSDP) takes its
    own part of it, cut on this rank (every rank read the same file: no communication)."""
    if hasattr(param, "placements"):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(value)


def writes_here(model: nn.Module) -> bool:
    """Whether this process writes ``model``'s files: always, unless a trainable tensor is an FSDP2 shard (a DTensor)
    in an initialised process group; then every rank gathers the shards and rank 0 alone writes."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized() and any(
        hasattr(p, "placements") for p in model.parameters() if p.requires_grad)) or torch.distributed.get_rank() == 0


def read_adapters(path: str | os.PathLike, verify: bool = True,
                  strict: bool = False) -> tuple[dict, MCLConfig, dict[str, torch.Tensor]]:
    """(saved metadata, MCLConfig, tensors) of a folder written by ``MCLModel.save_pretrained``, checked on its own:
    a well-formed config, the weights' and the settings' SHA-256 against those recorded at save (``verify=False``
    skips them, e.g. for a file repaired by hand), one lora_A [K, d_in, r] and lora_B [K, r, d_out] per adapted
    layer, finite. Every error names the file and what is wrong; what cannot be verified warns (``strict``: raises)."""
    saved, tensors = read_adapter_files(path, verify, strict)
    return saved, checked_mcl_config(path, saved, tensors), tensors


def checked_mcl_config(path: str | os.PathLike, saved: dict, tensors: dict[str, torch.Tensor]) -> MCLConfig:
    """The MCLConfig of checked LoRA-MCL files, after checking the adapters' shapes against it."""
    config_file = os.path.join(path, CONFIG_NAME)
    method = saved.get("method", "mcl")
    if method != "mcl":
        raise ValueError(f"{config_file} holds a {method!r} model, not LoRA-MCL adapters: load it with load_mcl_model")
    if "mcl_config" not in saved:
        raise ValueError(f"{config_file} lacks ['mcl_config']: not a complete file written by "
                         "MCLModel.save_pretrained")
    if not isinstance(saved["mcl_config"], dict):
        raise ValueError(f"{config_file}: mcl_config must be a JSON object, got {saved['mcl_config']!r}")
    try:
        config = MCLConfig.from_dict(saved_values(saved["mcl_config"]))
    except (TypeError, ValueError) as error:
        raise ValueError(f"{config_file}: {error}") from None
    _check_adapter_tensors(os.path.join(path, WEIGHTS_NAME), config, saved["adapted_modules"], tensors)
    return config


def read_adapter_files(path: str | os.PathLike, verify: bool = True,
                       strict: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """(saved metadata, tensors) of a folder written by ``save_pretrained`` (LoRA-MCL or a baseline), checked for
    what every method shares: a well-formed config with its adapted modules, the weights' and the settings' SHA-256
    (unless ``verify=False``), readable safetensors, every tensor floating point and finite, in the dtypes saved.
    A file without a checksum, and converted tensors, warn (``strict``: raise)."""
    config_file = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"no {CONFIG_NAME} in {path}: not a folder written by MCLModel.save_pretrained")
    try:
        saved = json.loads(Path(config_file).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{config_file} is not valid JSON ({error}); it was damaged or edited: save the adapters "
                         "again, or restore the file") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{config_file} must hold a JSON object (as MCLModel.save_pretrained writes), got a "
                         f"{type(saved).__name__}")
    if saved.get("loramcl_format") != FORMAT_VERSION:
        raise ValueError(f"{config_file} has format {saved.get('loramcl_format')!r}; "
                         f"this loramcl reads format {FORMAT_VERSION}")
    if "adapted_modules" not in saved:
        raise ValueError(f"{config_file} lacks ['adapted_modules']: not a complete file written by "
                         "MCLModel.save_pretrained")
    modules = saved["adapted_modules"]
    if not (isinstance(modules, list) and modules and all(isinstance(m, str) and m for m in modules)):
        raise ValueError(f"{config_file}: adapted_modules must be a non-empty list of layer names, got {modules!r}")
    weights = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(weights):
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in {path}: not a folder written by MCLModel.save_pretrained")
    if verify and saved.get("weights_sha256") is None:
        _unverified(f"{config_file} records no weights_sha256 (removed, or written by another tool): {weights} is "
                    "not verified, so a damaged or changed file would load unnoticed. Save the adapters again with "
                    f"save_pretrained to record it ({STRICT_HINT}; verify=False loads without a word)", strict)
    elif verify and sha256(weights) != saved["weights_sha256"]:
        raise ValueError(f"{weights} does not match the SHA-256 recorded in {CONFIG_NAME} at save: the file was "
                         "damaged or changed afterwards. Restore it (or an earlier checkpoint); verify=False loads "
                         "it anyway")
    try:
        tensors = safetensors.torch.load_file(weights)
    except Exception as error:  # safetensors raises its own error type without the path
        raise ValueError(f"{weights} cannot be read as safetensors ({error}): the file is damaged") from None
    for key, value in tensors.items():
        if not value.is_floating_point() or not torch.isfinite(value).all():
            raise ValueError(f"{weights}: {key} holds NaN or infinite values (or is not floating point): these "
                             "adapters were saved from a diverged run or damaged; use an earlier checkpoint")
    if verify:
        _check_settings(path, saved, strict)
    _check_dtypes(weights, saved, tensors, strict)
    return saved, tensors


def output_settings(saved: dict) -> dict | None:
    """The saved settings that change the adapters' outputs: the method's configuration less ``TRAINING_SETTINGS``,
    and ``weights_dtypes``; None when the configuration is not a JSON object (reported by the method's reader)."""
    key = "mcl_config" if saved.get("method", "mcl") == "mcl" else f"{saved['method']}_config"
    config = saved.get(key)
    if not isinstance(config, dict):
        return None
    return {key: {name: value for name, value in config.items() if name not in TRAINING_SETTINGS},
            "weights_dtypes": saved.get("weights_dtypes")}


def canonical(settings) -> str:
    """``settings`` as one JSON text, keys sorted, every number as a float (an alpha of 8 and of 8.0 is the same)."""
    def numbers_as_floats(value):
        if isinstance(value, dict):
            return {key: numbers_as_floats(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [numbers_as_floats(item) for item in value]
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
    return json.dumps(numbers_as_floats(settings), sort_keys=True, separators=(",", ":"))


def dtypes_of(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted({str(value.dtype).removeprefix("torch.") for value in tensors.values()})


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _unverified(message: str, strict: bool) -> None:
    if strict:
        raise ValueError(message)
    warnings.warn(message, AdapterFilesWarning, stacklevel=5)


def _check_settings(path, saved: dict, strict: bool) -> None:
    """Refuse an ``mcl_config.json`` whose settings that change the outputs differ from those saved, naming each
    edited field and its saved value; warn when they were not recorded (files written before ``settings_sha256``)."""
    config_file = os.path.join(path, CONFIG_NAME)
    settings = output_settings(saved)
    if settings is None:
        return
    key = next(iter(settings))
    covered = f"{', '.join(sorted(settings[key]))} and weights_dtypes"
    recorded = saved.get("settings_sha256")
    if recorded is None:
        _unverified(f"{config_file} records no settings_sha256 (written by loramcl before it was recorded, or "
                    f"removed): the settings that change the adapters' outputs ({covered}) are not verified. Load and "
                    f"save_pretrained again to record it ({STRICT_HINT})", strict)
        return
    if _digest(canonical(settings)) == recorded:
        return
    try:
        with safetensors.safe_open(os.path.join(path, WEIGHTS_NAME), framework="pt") as f:
            at_save = json.loads((f.metadata() or {})[SETTINGS_METADATA])
    except (KeyError, ValueError):
        at_save = None
    edit_only = ("Only the training settings (" + ", ".join(sorted(TRAINING_SETTINGS & set(saved[key]))) +
                 ") may be edited")
    if not isinstance(at_save, dict):
        raise ValueError(f"{config_file} was edited after save: its settings do not match the settings_sha256 "
                         f"recorded then, and {WEIGHTS_NAME} was rewritten without the header that holds the saved "
                         f"values, to name the field. One of {covered} changed; these change every output. Restore "
                         f"the files saved with the adapters. {edit_only}")
    edits = [_edit(where + name, now, then, name)
             for where, now, then in ((f"{key}.", settings[key], at_save.get(key) or {}), ("", settings, at_save))
             for name in sorted(set(now) | set(then))
             if name != key and not same_setting(name, now.get(name, ()), then.get(name, ()))]
    if _digest(canonical(at_save)) == recorded:  # the header holds the settings saved: mcl_config.json was edited
        if not edits:
            return  # only the order of a set (target_modules, ...) changed
        raise ValueError(f"{config_file} was edited after save: {'; '.join(edits)}. These settings change every "
                         f"output of the adapters: restore the saved values (also in the header of {WEIGHTS_NAME}). "
                         f"To use others, train or save adapters with them. {edit_only}")
    if not edits:  # both files hold the same settings; the checksum is what changed
        raise ValueError(f"{config_file}: settings_sha256 is {recorded}, but its settings and those saved in the "
                         f"header of {WEIGHTS_NAME} are the same and hash to {_digest(canonical(at_save))}: "
                         "settings_sha256 was edited or damaged, not the settings. Restore it (save_pretrained "
                         "writes it), or load with verify=False")
    raise ValueError(f"{config_file} and the header of {WEIGHTS_NAME} hold other settings ({'; '.join(edits)}, "
                     f"'saved as' naming the header's), and neither matches the settings_sha256 of {CONFIG_NAME}: "
                     f"both files were changed after save. Restore the files saved with the adapters. {edit_only}")


def same_setting(name: str, a, b) -> bool:
    """Whether two values of the setting ``name`` are the same setting: the same JSON (``canonical``), and for
    ``ORDER_FREE`` lists the same members in any order."""
    if name in ORDER_FREE and isinstance(a, list) and isinstance(b, list):
        return {canonical(item) for item in a} == {canonical(item) for item in b}
    return canonical(a) == canonical(b)


def _edit(field: str, now: dict, then: dict, name: str) -> str:
    if name not in then:
        return f"{field} = {json.dumps(now[name])} was added"
    if name not in now:
        return f"{field} was removed (saved as {json.dumps(then[name])})"
    return f"{field} is {json.dumps(now[name])}, saved as {json.dumps(then[name])}"


def _check_dtypes(weights: str, saved: dict, tensors: dict[str, torch.Tensor], strict: bool) -> None:
    """Tensors stored in another dtype than at save were rounded (or widened) after: they load, with a warning naming
    both dtypes, so that the changed numbers are never silent (``strict``: refused)."""
    recorded, found = saved.get("weights_dtypes"), dtypes_of(tensors)
    if recorded is None or recorded == found:
        return  # files written before weights_dtypes: the settings warning covers them
    saved_as = ", ".join(map(str, recorded)) if isinstance(recorded, list) else str(recorded)
    _unverified(f"{weights} holds {', '.join(found)} tensors, saved as {saved_as}: they were "
                "converted after save, so the adapters' values are not those trained (the outputs differ by the "
                f"rounding). Restore the file that save_pretrained wrote ({STRICT_HINT})", strict)


def check_scoring_fits(path, tensors: dict[str, torch.Tensor], head: HypothesisScores | None,
                        hidden_size: int | None = None) -> None:
    """The saved scoring head must have the width of this model's output layer input."""
    if f"{SCORING_PREFIX}.weight" not in tensors:
        return
    width = head.weight.shape[1] if head is not None else hidden_size
    saved = tensors[f"{SCORING_PREFIX}.weight"].shape[1]
    if saved != width:
        raise ValueError(f"the scoring head in {path} reads hidden states of width {saved}, this model's are {width}: "
                         "were the adapters saved from another base model?")


def _check_adapter_tensors(weights: str, config: MCLConfig, modules: list[str],
                           tensors: dict[str, torch.Tensor]) -> None:
    parts = ("lora_A", "lora_B", *(SHARED_PARTS if config.shared_r else ()))
    expected = {f"{name}.{part}" for name in modules for part in parts}
    if config.scoring:
        expected |= {f"{SCORING_PREFIX}.weight", f"{SCORING_PREFIX}.bias"}
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(f"{weights} does not hold the adapters its {CONFIG_NAME} lists: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    k, r = config.num_hypotheses, config.r
    for name in modules:
        a, b = tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"]
        if a.dim() != 3 or b.dim() != 3 or a.shape[0] != k or b.shape[0] != k or a.shape[2] != r or b.shape[1] != r:
            raise ValueError(f"{weights}: {name} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; K={k}, r={r} "
                             f"needs [{k}, d_in, {r}] and [{k}, {r}, d_out]")
        if config.shared_r:
            s, shared_a, shared_b = config.shared_r, tensors[f"{name}.shared_A"], tensors[f"{name}.shared_B"]
            if tuple(shared_a.shape) != (a.shape[1], s) or tuple(shared_b.shape) != (s, b.shape[2]):
                raise ValueError(f"{weights}: {name} has shared_A {tuple(shared_a.shape)} and shared_B "
                                 f"{tuple(shared_b.shape)}; shared_r={s} with lora_A {tuple(a.shape)} and lora_B "
                                 f"{tuple(b.shape)} needs [{a.shape[1]}, {s}] and [{s}, {b.shape[2]}]: the file was "
                                 "damaged or edited; restore the one save_pretrained wrote")
    if config.scoring:
        weight, bias = tensors[f"{SCORING_PREFIX}.weight"], tensors[f"{SCORING_PREFIX}.bias"]
        if weight.dim() != 2 or weight.shape[0] != k or tuple(bias.shape) != (k,):
            raise ValueError(f"{weights}: the scoring head has weight {tuple(weight.shape)} and bias "
                             f"{tuple(bias.shape)}; K={k} needs [{k}, d] and [{k}]")


def check_adapters_fit(path, saved: dict, config: MCLConfig, tensors: dict[str, torch.Tensor], names: list[str],
                        features: dict[str, tuple[int, int]]) -> None:
    """Raise unless the adapters read from ``path`` fit the layers ``names`` of shapes ``features`` (d_in, d_out)."""
    ours, theirs = set(names), set(saved["adapted_modules"])
    if ours != theirs:
        raise ValueError(f"the adapters in {path} are on {len(theirs)} layers, this model's layers matching its "
                         f"target_modules={config.target_modules!r} are {len(ours)}: in the file only "
                         f"{sorted(theirs - ours)[:5]}, in the model only {sorted(ours - theirs)[:5]}. Load them onto "
                         "the base architecture they were trained on")
    for name in names:
        d_in, d_out = features[name]
        a, b = tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"]
        if (a.shape[1], b.shape[2]) != (d_in, d_out):
            raise ValueError(f"{name}: the file in {path} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                             f"this model's layer maps {d_in} -> {d_out} features; were they saved from another base "
                             "model (another width)?")

