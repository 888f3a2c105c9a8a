"""What a command checks before it imports torch, so that a mistake is reported at once, and the path type of its
arguments.

Every path argument of a command is a ``LocalPath``: jsonargparse turns it into an absolute path, relative to the
recipe file that gives it (jsonargparse reads a ``--config`` file from that file's folder) or to the current
folder on the command line. Python callers pass plain strings.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Literal, get_args

from jsonargparse.typing import register_type

Dtype = Literal["float32", "bfloat16", "float16"]  # the frozen model's dtype, as a command option
DTYPES: tuple[str, ...] = get_args(Dtype)
RUN_RECORD = "run.json"  # written last by `loramcl train` in its `out` folder
PEFT_FOLDER = "peft"  # where a K = 1 run of `loramcl train` exports its adapter, inside `out`
MCL_CONFIG = "mcl_config.json"  # loramcl.adapter_files.CONFIG_NAME (not imported: that module imports torch)
PEFT_CONFIG = "adapter_config.json"
# The packaged models' folder names (as the recipes name them) and the command that writes such a folder.
PACKAGED_MODELS = {"SmolLM2-135M-Instruct": "convert-smollm2", "whisper-base": "convert-whisper-base"}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


class LocalPath(str):
    """A file or folder path; absolute once parsed from the command line or a recipe file."""


class ModelPath(LocalPath):
    """A model folder; a Hugging Face repository id ("org/name") stays as given when no such folder exists and the
    model is in the local Hugging Face cache (nothing is downloaded)."""


def _absolute(value: str) -> LocalPath:
    return LocalPath(os.path.abspath(os.path.expanduser(str(value))))


def _model(value: str) -> ModelPath:
    path = _absolute(value)
    if not os.path.exists(path) and cached_hub_model(str(value)):
        return ModelPath(value)
    return ModelPath(path)


register_type(LocalPath, serializer=str, deserializer=_absolute)
register_type(ModelPath, serializer=str, deserializer=_model)


class PromptFormatWarning(UserWarning):
    """Decoding or scoring formats its prompts otherwise than the training run did."""


class AdapterFilesWarning(UserWarning):
    """Adapter files that load but cannot be verified in full (no checksum of the weights or of the settings, no base
    fingerprint) or whose tensors were converted after save (``loramcl.adapter_files``, ``loramcl.fingerprint``;
    defined here, without torch, so that the command line can print it as one line). ``strict=True`` makes each an
    error."""


class BaseWeightsMismatch(AdapterFilesWarning):
    """Adapters loaded onto a base model whose weights differ from those they were trained on
    (``loramcl.fingerprint``)."""


def check_file(path: str, what: str) -> None:
    """A clear error if ``path`` is not an existing file (``what``: e.g. "training file")."""
    if not os.path.isfile(path):
        reason = "is a folder" if os.path.isdir(path) else "does not exist"
        raise FileNotFoundError(f"{what} {path} {reason}")


def check_model_folder(model: str) -> None:
    """``model`` is a local transformers folder (with config.json), or a model of the local Hugging Face cache."""
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise FileNotFoundError(f"model folder {model} has no config.json: give the folder of a transformers "
                                    "model (the one save_pretrained wrote)")
        return
    if os.path.isfile(model):
        raise NotADirectoryError(f"model {model} is a file: give the folder of a transformers model")
    if not cached_hub_model(model):
        command = PACKAGED_MODELS.get(os.path.basename(os.path.normpath(model)))
        writes = f": `loramcl {command} --out {model}` writes it" if command else ""
        raise FileNotFoundError(f"model folder {model} does not exist (a model is a local transformers folder; "
                                f"nothing is downloaded){writes}")


def cached_hub_model(name: str) -> bool:
    """Whether ``name`` is a hub id ("org/model") whose config.json is in the local Hugging Face cache."""
    if not _HUB_ID.fullmatch(name):
        return False
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(name, "config.json"), str)


def is_encoder_decoder(model: str) -> bool:
    """Whether the transformers model in folder ``model`` is an encoder-decoder (read from its config.json)."""
    path = os.path.join(model, "config.json")
    if os.path.isfile(path):
        return bool(json.loads(Path(path).read_text()).get("is_encoder_decoder", False))
    from transformers import AutoConfig  # a cached hub model

    return bool(getattr(AutoConfig.from_pretrained(model), "is_encoder_decoder", False))


def check_adapters_folder(adapters: str) -> None:
    """``adapters`` holds MCL adapters (MCLModel.save_pretrained) or a PEFT adapter."""
    if not os.path.isdir(adapters):
        raise FileNotFoundError(f"adapters folder {adapters} does not exist")
    if not any(os.path.isfile(os.path.join(adapters, name)) for name in (MCL_CONFIG, PEFT_CONFIG)):
        raise FileNotFoundError(f"{adapters} holds neither MCL adapters ({MCL_CONFIG}) nor a PEFT adapter "
                                f"({PEFT_CONFIG})")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def check_model_options(model: str, dtype: str, adapters: str | None = None) -> None:
    """The options of a command that loads a model: ``dtype`` one of ``DTYPES``, the model folder, and the adapters
    folder when one is given."""
    check_choice("dtype", dtype, DTYPES)
    check_model_folder(model)
    if adapters is not None:
        check_adapters_folder(adapters)


def training_record(adapters: str | None) -> tuple[Path, dict] | None:
    """(path, settings) of the `loramcl train` run that wrote ``adapters``: its run.json beside them, or one folder
    up for the PEFT export of a K = 1 run (OUT/peft). None for adapters without a run record."""
    if adapters is None:
        return None
    folder = Path(adapters)
    for path in (folder / RUN_RECORD, *([folder.parent / RUN_RECORD] if folder.name == PEFT_FOLDER else [])):
        if path.is_file():
            try:
                settings = json.loads(path.read_text(encoding="utf-8")).get("settings")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
                raise ValueError(f"{path} is not a run record of `loramcl train` ({error})") from None
            return (path, settings) if isinstance(settings, dict) else None
    return None


def prompt_format(adapters: str | None, chat_template: bool | None) -> bool:
    """Whether prompts are wrapped with the chat template: as given, else as the training run of ``adapters`` did
    (its run.json), else not. A choice that contradicts the training run is a PromptFormatWarning."""
    record = training_record(adapters)
    trained = None
    if record is not None:
        trained = (record[1].get("data") or {}).get("chat_template")
    if chat_template is None:
        return bool(trained)
    if trained is not None and bool(trained) != chat_template:
        warnings.warn(f"chat_template is {str(chat_template).lower()} but the adapters were trained with "
                      f"chat_template {str(bool(trained)).lower()} ({record[0]}): the prompts will not look like the "
                      "training prompts (leave --chat_template out to use the training run's format)",
                      PromptFormatWarning, stacklevel=3)
    return chat_template
