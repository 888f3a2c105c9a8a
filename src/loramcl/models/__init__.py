"""Models, by what they are for:

- ``load``: a local model loaded for training or decoding (``load_model``: a transformers folder in the class its
  config calls for, with MCL adapters, a baseline's, a PEFT adapter, or none).
- ``mcl``: ``load_mcl_model``, the MCL model saved in a folder rebuilt on its base, whatever its method (the
  baselines' loaders registered: this room stands above them).
- ``pretrained``: pretrained models that install from PyPI (no model hub), converted once to a transformers folder.
- ``tiny``: tiny randomly initialised models of real classes for end-to-end checks on the CPU.

Every public name is also a name of this package (``from loramcl.models import load_model``), loaded on first use.
"""

from loramcl.utils.lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(("load_model", "training_model_loader"), "loramcl.models.load"),
    "load_mcl_model": "loramcl.models.mcl",
    **dict.fromkeys(("SMOLLM2_PACKAGE", "SMOLLM2_INSTALL", "smollm2_gguf", "convert_smollm2", "convert_smollm2_command",
                     "WHISPER_PACKAGES", "WHISPER_INSTALL", "whisper_base_files", "read_ctranslate2",
                     "whisper_state_dict", "convert_whisper_base", "convert_whisper_base_command",
                     "whisper_with_context"), "loramcl.models.pretrained"),
    **dict.fromkeys(("TINY_AUDIO_SPECIAL_TOKENS", "tiny_qwen2_audio", "TINY_LLAVA_SPECIAL_TOKENS",
                     "LLAVA_CHAT_TEMPLATE", "tiny_llava_next_config", "tiny_llava_next_processor", "tiny_llava_next"),
                    "loramcl.models.tiny"),
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
