"""What a command checks before it imports torch, so that a mistake is reported at once (its files and folders, the
places it writes, the model's positions from its config.json; the device, which needs torch, just before the model
loads), and the path type of its arguments.

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
from typing import Literal, NamedTuple, get_args

from jsonargparse.typing import register_type

from loramcl.utils.files import read_json
from loramcl.utils.validate import OptionError

Dtype = Literal["float32", "bfloat16", "float16"]  # the frozen model's dtype, as a command option
# the frozen model quantized as it loads, as a command option (loramcl.mcl.quantization: docs/guide/quantization.md)
Quantization = Literal["nf4", "fp4", "int8", "torchao-int8"]
DTYPES: tuple[str, ...] = get_args(Dtype)
RUN_RECORD = "run.json"  # written last by `loramcl train` in its `out` folder
PEFT_FOLDER = "peft"  # where a K = 1 run of `loramcl train` exports its adapter, inside `out`
BEST_FOLDER = "best"  # a run's best-validation adapters (training.keep_best), beside the last ones
# The files of MCL adapters (loramcl.mcl.adapter_files names them from here: that module imports torch)
MCL_CONFIG = "mcl_config.json"
MCL_WEIGHTS = "mcl_adapters.safetensors"
PEFT_CONFIG = "adapter_config.json"
# The packaged models' folder names (as the recipes name them) and the command that writes such a folder.
PACKAGED_MODELS = {"SmolLM2-135M-Instruct": "convert-smollm2", "whisper-base": "convert-whisper-base"}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


class LocalPath(str):
    """A file or folder path; absolute once parsed from the command line or a recipe file."""


class ModelPath(LocalPath):
    """A model folder; a Hugging Face repository id ("org/name") stays as given when no such folder exists and the
    model is in the local Hugging Face cache (nothing is downloaded)."""


# The paths read relative to a folder (absolute path -> (the path as written, that folder)): a recipe file's relative
# path is read relative to the file's folder, which a "does not exist" names (``read_relative``).
_READ_RELATIVE: dict[str, tuple[str, str]] = {}


def absolute_path(value: str, folder: str | os.PathLike | None = None) -> str:
    """``value`` made absolute relative to ``folder`` (default: the current folder, which jsonargparse sets to a
    ``--config`` file's own while it reads the file); a relative one is remembered for ``read_relative``."""
    written = os.path.expanduser(str(value))
    base = os.path.abspath(folder if folder is not None else os.getcwd())
    path = os.path.abspath(os.path.join(base, written))
    if not os.path.isabs(written):
        _READ_RELATIVE[path] = (str(value), base)
    return path


def read_relative(path: str) -> str:
    """For a path a recipe file gave relative to its folder (another than the current one): what it wrote and the rule
    (appended to a "does not exist"); else ''."""
    written, base = _READ_RELATIVE.get(os.path.abspath(path), (None, None))
    if written is None or base == os.getcwd():
        return ""
    return (f"; a recipe file gives it as `{written}` (relative paths in a recipe file are read relative to the "
            f"recipe file's folder, here {base})")


def _absolute(value: str) -> LocalPath:
    return LocalPath(absolute_path(value))


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
    fingerprint) or whose tensors were converted after save (``loramcl.mcl.adapter_files``, ``loramcl.mcl.fingerprint``;
    defined here, without torch, so that the command line can print it as one line). ``strict=True`` makes each an
    error."""


class BaseWeightsMismatch(AdapterFilesWarning):
    """Adapters loaded onto a base model whose weights differ from those they were trained on
    (``loramcl.mcl.fingerprint``)."""


def check_file(path: str, what: str) -> None:
    """A clear error if ``path`` is not an existing file (``what``: e.g. "training file")."""
    if not os.path.isfile(path):
        reason = "is a folder" if os.path.isdir(path) else f"does not exist{read_relative(path)}"
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
                                f"nothing is downloaded){writes}{read_relative(model)}")


def cached_hub_model(name: str) -> bool:
    """Whether ``name`` is a hub id ("org/model") whose config.json is in the local Hugging Face cache."""
    if not _HUB_ID.fullmatch(name):
        return False
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(name, "config.json"), str)


def config_file(model: str) -> str:
    """The config.json of a model folder, or of a model of the local Hugging Face cache (``check_model_folder``)."""
    path = os.path.join(model, "config.json")
    if os.path.isfile(path):
        return path
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(model, "config.json") if _HUB_ID.fullmatch(model) else None
    if not isinstance(cached, str):
        raise FileNotFoundError(f"model folder {model} has no config.json")
    return cached


def model_config(model: str) -> dict:
    """The settings of a model as its config.json holds them (read as JSON: no torch, no transformers)."""
    return read_json(config_file(model), "the model folder is damaged: copy or convert the model again")


def is_encoder_decoder(model: str) -> bool:
    """Whether the transformers model in folder ``model`` is an encoder-decoder (read from its config.json)."""
    return bool(model_config(model).get("is_encoder_decoder", False))


# Where configurations write the number of positions a model reads (absolute position tables, or the length a rotary
# model was trained to), in the order they are looked for.
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx",
                  "max_seq_len")


class PositionLimits(NamedTuple):
    """The most positions a model reads, from its configuration (None: it states none, e.g. T5's relative
    positions). A causal LM reads prompt and target as one sequence of at most ``prompt`` positions (``shared``);
    an encoder-decoder reads at most ``prompt`` in its encoder and ``target`` in its decoder."""

    prompt: int | None
    target: int | None
    shared: bool
    source: str  # where the limit is stated, e.g. "max_position_embeddings in tiny/config.json"

    def excess(self, prompt_tokens: int, target_tokens: int) -> str | None:
        """What does not fit when a prompt of ``prompt_tokens`` tokens and a target (or the generated tokens) of
        ``target_tokens`` are read; None when they fit."""
        if self.shared:
            total = prompt_tokens + target_tokens
            if self.prompt is not None and total > self.prompt:
                return f"{total} positions, more than the {self.prompt} the model reads ({self.source})"
            return None
        if self.prompt is not None and prompt_tokens > self.prompt:
            return f"{prompt_tokens} prompt tokens, more than the {self.prompt} its encoder reads ({self.source})"
        if self.target is not None and target_tokens > self.target:
            return f"{target_tokens} target positions, more than the {self.target} its decoder reads ({self.source})"
        return None


def position_limits(config: dict, where: str = "config.json") -> PositionLimits:
    """The ``PositionLimits`` of a model from its configuration as a dict (``model_config``, or a live model's
    ``config.to_dict()``); ``where`` names the file in the messages. The language model of a multimodal model
    (``text_config``) and the decoder of a composite encoder-decoder (``decoder``) state its limits."""
    def first(settings: dict, keys: tuple[str, ...]) -> tuple[int | None, str | None]:
        for key in keys:
            value = settings.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, key
        return None, None

    if "relative_attention_num_buckets" in config:  # T5 and its kin: relative positions, no table to run past
        return PositionLimits(None, None, not config.get("is_encoder_decoder"), "")
    if config.get("is_encoder_decoder"):
        decoder = config.get("decoder") if isinstance(config.get("decoder"), dict) else config
        encoder = config.get("encoder") if isinstance(config.get("encoder"), dict) else config
        # Whisper's max_source_positions counts audio frames, not prompt tokens: only text positions are checked
        prompt, prompt_key = first(encoder, _POSITION_KEYS)
        target, target_key = first(decoder, ("max_target_positions", *_POSITION_KEYS))
        keys = sorted({key for key in (prompt_key, target_key) if key})
        return PositionLimits(prompt, target, False, f"{' and '.join(keys)} in {where}")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    limit, key = first(text, _POSITION_KEYS)
    return PositionLimits(limit, limit, True, f"{key} in {where}")


def model_positions(model: str) -> PositionLimits:
    """The ``PositionLimits`` of the model folder (or cached hub model) ``model``, read from its config.json."""
    return position_limits(model_config(model), config_file(model))


def record_line(path: str, index: int) -> int:
    """The line number of record ``index`` (0-based) of a JSONL file, whose blank lines hold no record (as
    ``loramcl.utils.files.read_jsonl`` reads it); for messages, read only then."""
    return _record_lines(path)[index]


def _record_lines(path: str) -> list[int]:
    """The line number of each record of a JSONL file, in order."""
    with open(path, "rb") as lines:
        return [number for number, raw in enumerate(lines, start=1) if raw.strip()]


def record_names(path: str):
    """``name(i)``: "<path>:<line>" of record i (0-based) of a JSONL file, as ``record_line``; the table of lines is
    read once, at the first call, so that naming every row of a file (as ``Dataset.map`` does) stays linear."""
    table: list[int] = []

    def name(index: int) -> str:
        if not table:
            table.extend(_record_lines(path))
        return f"{path}:{table[index]}"

    return name


def check_output(path: str, folder: bool, option: str = "out", example: str = "out.jsonl") -> None:
    """Before any work: ``path`` can be written, as a folder (``folder``) or a file. A file where a folder goes (or
    the reverse), a file among its parents, or a place without write permission is an OptionError naming
    ``option``; ``example``: a file name to suggest inside a folder given for a file."""
    path = os.path.abspath(path)
    if folder and os.path.isfile(path):
        raise OptionError(option, f"{option} {path} is a file, and a folder is written there: give a folder (a new "
                          "one, or one this command wrote)")
    if not folder and os.path.isdir(path):
        raise OptionError(option, f"{option} {path} is a folder, and a file is written there: give a file path, "
                          f"e.g. {os.path.join(path, example)}")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if existing != path and not os.path.isdir(existing):
        raise OptionError(option, f"{option} {path} cannot be made: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | (os.X_OK if os.path.isdir(existing) else 0)):
        raise OptionError(option, f"{option} {path}: {existing} is not writable (permission denied): choose a place "
                          "you can write to")


def check_device(device: str, option: str = "device") -> None:
    """Before the model loads: ``device`` is a device that torch can use here, else an OptionError with what to
    do (imports torch)."""
    import torch

    try:
        kind = torch.device(device)
    except (RuntimeError, TypeError):
        raise OptionError(option, f"{option} {device!r} is not a device torch knows: give cpu, cuda, cuda:N (GPU N) "
                          "or mps") from None
    if kind.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise OptionError(option, f"{option} {device}: this torch ({torch.__version__}) is built without CUDA: "
                              "install a CUDA build of torch (pytorch.org/get-started), or use --device cpu")
        if not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise OptionError(option, f"{option} {device}: torch sees no GPU"
                              f"{f' (CUDA_VISIBLE_DEVICES={visible!r})' if visible is not None else ''}: check the "
                              "driver with nvidia-smi, or use --device cpu")
        count = torch.cuda.device_count()
        if kind.index is not None and kind.index >= count:
            raise OptionError(option, f"{option} {device}: torch sees {count} GPU{'s' if count > 1 else ''} "
                              f"(cuda:0 to cuda:{count - 1}): give one of them, or use --device cpu")
    elif kind.type == "mps" and not torch.backends.mps.is_available():
        raise OptionError(option, f"{option} {device}: Apple's Metal (MPS) is not available here (it needs an Apple "
                          "silicon Mac and a torch built with it): use --device cpu")
    elif kind.type == "meta":
        raise OptionError(option, f"{option} meta holds no weights: give cpu, cuda or mps")
    elif kind.type not in ("cpu", "cuda", "mps"):
        backend = getattr(torch, kind.type, None)
        if not (callable(getattr(backend, "is_available", None)) and backend.is_available()):
            raise OptionError(option, f"{option} {device}: torch has no {kind.type} device here: use --device cpu "
                              "(or cuda)")


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
    """(path, settings) of the `loramcl train` run that wrote ``adapters``: its run.json beside them, or that of the
    run above the PEFT export of a K = 1 run (OUT/peft), its best adapters (OUT/best, ``training.keep_best``) or
    both (OUT/best/peft). None for adapters without a run record."""
    if adapters is None:
        return None
    paths, folder = [Path(adapters) / RUN_RECORD], Path(adapters)
    for name in (PEFT_FOLDER, BEST_FOLDER):
        if folder.name == name:
            folder = folder.parent
            paths.append(folder / RUN_RECORD)
    for path in paths:
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
