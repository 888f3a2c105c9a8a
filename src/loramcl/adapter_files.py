"""The files of an MCL model: ``mcl_adapters.safetensors`` (every hypothesis' lora_A [K, d_in, r] and lora_B
[K, r, d_out], the scoring head) and ``mcl_config.json`` (the method's configuration, the adapted layers, the weights'
SHA-256, the base weights' fingerprint). Saving, loading into a model, and reading with every check made before a
weight is copied (so a failed load leaves the model as it was).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import safetensors.torch
import torch
from torch import nn

from loramcl.config import MCLConfig
from loramcl.file_io import sha256, write_atomically
from loramcl.fingerprint import check_base_weights
from loramcl.scores import HypothesisScores

CONFIG_NAME = "mcl_config.json"
WEIGHTS_NAME = "mcl_adapters.safetensors"
FORMAT_VERSION = 1
SCORING_PREFIX = "scoring"  # the scoring head's tensors in mcl_adapters.safetensors: scoring.weight, scoring.bias


class AdapterFiles:
    """The saving and loading methods of ``MCLModel`` (they use its ``mcl_layers``, ``mcl_config`` and
    ``scoring_head``)."""

    def adapter_state_dict(self, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """{'<layer>.lora_A': [K, d_in, r], '<layer>.lora_B': [K, r, d_out]} on CPU, from ``state_dict`` (e.g.
        one Trainer gathered from DeepSpeed/FSDP) when given, else from this model. Adapters sharded by FSDP2
        (``fully_shard``: DTensors) are gathered whole, a collective that every rank must call."""
        tensors = {}
        for name, layer in self.mcl_layers():
            for part, param in layer.adapter_tensors().items():
                key = f"{name}.{part}"
                value = (param if state_dict is None else state_dict[f"base_model.{key}"]).detach()
                tensors[key] = _full_tensor(value).to("cpu").contiguous()
        if self.scoring_head is not None:  # 'scoring.weight' [K, d], 'scoring.bias' [K]
            for part, param in self.scoring_head.named_parameters():
                value = (param if state_dict is None else state_dict[f"scoring_head.{part}"]).detach()
                tensors[f"{SCORING_PREFIX}.{part}"] = _full_tensor(value).to("cpu").contiguous()
        return tensors

    def save_pretrained(self, path: str | os.PathLike, state_dict: dict[str, torch.Tensor] | None = None) -> str:
        """Write the K hypotheses: ``mcl_adapters.safetensors`` and ``mcl_config.json`` (no pickle), each file
        written under a temporary name and renamed when whole. The config records the weights' SHA-256, which
        loading verifies."""
        tensors = self.adapter_state_dict(state_dict)
        if _sharded(self) and torch.distributed.get_rank() != 0:
            return str(path)  # FSDP2: every rank gathers the shards (above), rank 0 writes
        os.makedirs(path, exist_ok=True)
        weights = os.path.join(path, WEIGHTS_NAME)
        write_atomically(weights, lambda tmp: safetensors.torch.save_file(
            tensors, tmp, metadata={"format": "pt", "loramcl_format": str(FORMAT_VERSION)}))
        meta = {
            "loramcl_format": FORMAT_VERSION,
            **self._config_metadata(),
            "base_model_name_or_path": getattr(self.config, "_name_or_path", None) or None,
            "base_model_class": type(self.base_model).__name__,
            "adapted_modules": self.layer_names,
            "weights_sha256": sha256(weights),
            "base_fingerprint": getattr(self, "_base_fingerprint", None),
        }
        write_atomically(os.path.join(path, CONFIG_NAME),
                          lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8"))
        return str(path)

    def _config_metadata(self) -> dict:
        """What ``save_pretrained`` writes to rebuild the model: its method's configuration."""
        return {"mcl_config": self.mcl_config.to_dict()}

    def load_adapters(self, path: str | os.PathLike, verify: bool = True, strict: bool = False) -> None:
        """Load adapter weights written by ``save_pretrained`` into this model (same layers, K, r and alpha).

        Everything is checked before any weight is copied (see ``read_adapters``; ``verify=False`` skips only the
        checksum), so a failed load leaves the model as it was. Adapters saved on other base weights warn (raise
        with ``strict=True``), as in ``load_mcl_model``."""
        saved, config, tensors = read_adapters(path, verify)
        ours = self.mcl_config
        if (config.num_hypotheses, config.r, config.alpha) != (ours.num_hypotheses, ours.r, ours.alpha):
            raise ValueError(f"{path} holds K={config.num_hypotheses}, r={config.r}, alpha={config.alpha:g} "
                             f"adapters; this model has K={ours.num_hypotheses}, r={ours.r}, alpha={ours.alpha:g}")
        layers = dict(self.mcl_layers())
        check_adapters_fit(path, saved, config, tensors, self.layer_names,
                            {name: (layer.in_features, layer.out_features) for name, layer in layers.items()})
        if config.scoring != ours.scoring:
            raise ValueError(f"{path} {'has' if config.scoring else 'has no'} hypothesis scores (scoring="
                             f"{config.scoring}); this model was built with scoring={ours.scoring}")
        check_scoring_fits(path, tensors, self.scoring_head)
        check_base_weights(path, saved, self.base_model, getattr(self, "_base_fingerprint", None), strict)
        with torch.no_grad():
            for name, layer in layers.items():
                layer.lora_A.copy_(tensors[f"{name}.lora_A"])
                layer.lora_B.copy_(tensors[f"{name}.lora_B"])
            self._copy_scoring_head(tensors)

    def _copy_scoring_head(self, tensors: dict[str, torch.Tensor]) -> None:
        """The saved head's values, if ``tensors`` has one (else the head keeps its zero initialisation)."""
        if self.scoring_head is not None and f"{SCORING_PREFIX}.weight" in tensors:
            with torch.no_grad():
                for part, param in self.scoring_head.named_parameters():
                    param.copy_(tensors[f"{SCORING_PREFIX}.{part}"])


def _full_tensor(value: torch.Tensor) -> torch.Tensor:
    """``value`` whole: a DTensor (a parameter sharded by FSDP2's ``fully_shard``) gathered from every rank."""
    return value.full_tensor() if hasattr(value, "full_tensor") and hasattr(value, "placements") else value


def _sharded(model: nn.Module) -> bool:
    """Whether some trainable tensor of ``model`` is an FSDP2 shard (a DTensor) in an initialised process group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() and any(
        hasattr(p, "placements") for p in model.parameters() if p.requires_grad)


def read_adapters(path: str | os.PathLike, verify: bool = True) -> tuple[dict, MCLConfig, dict[str, torch.Tensor]]:
    """(saved metadata, MCLConfig, tensors) of a folder written by ``MCLModel.save_pretrained``, checked on its own:
    a well-formed config, the weights' SHA-256 against the one recorded at save (``verify=False`` skips it, e.g.
    for a file repaired by hand), one lora_A [K, d_in, r] and lora_B [K, r, d_out] per adapted layer, finite.
    Every error names the file and what is wrong."""
    saved, tensors = read_adapter_files(path, verify)
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
        config = MCLConfig.from_dict(saved["mcl_config"])
    except (TypeError, ValueError) as error:
        raise ValueError(f"{config_file}: {error}") from None
    _check_adapter_tensors(os.path.join(path, WEIGHTS_NAME), config, saved["adapted_modules"], tensors)
    return config


def read_adapter_files(path: str | os.PathLike, verify: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """(saved metadata, tensors) of a folder written by ``save_pretrained`` (LoRA-MCL or a baseline), checked for
    what every method shares: a well-formed config with its adapted modules, the weights' SHA-256 (unless
    ``verify=False``), readable safetensors, every tensor floating point and finite."""
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
    if verify and saved.get("weights_sha256") is not None and sha256(weights) != saved["weights_sha256"]:
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
    return saved, tensors


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
    expected = {f"{name}.{part}" for name in modules for part in ("lora_A", "lora_B")}
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

