"""Loading a local model for training or decoding: a transformers folder in the class its config calls for, with
MCL adapters (or a baseline's), a PEFT adapter, or none."""

from __future__ import annotations

import os

from loramcl.inputs import DTYPES, check_choice


def load_model(model: str, adapters: str | None = None, dtype: str = "float32", device: str = "cpu",
               strict: bool = False):
    """A local transformers model (causal, sequence-to-sequence, speech-to-text such as Whisper, or an audio/vision-
    language model such as Qwen2-Audio) in eval mode, with MCL adapters (an MCLModel), a PEFT adapter (a PeftModel)
    or none. ``strict``: MCL adapters saved on other base weights, or whose files cannot be verified, are an error,
    not a warning."""
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForMultimodalLM,
        AutoModelForSeq2SeqLM,
        AutoModelForSpeechSeq2Seq,
    )

    from loramcl.adapter_files import CONFIG_NAME
    from loramcl.model import load_mcl_model

    check_choice("dtype", dtype, DTYPES)
    config = AutoConfig.from_pretrained(model)
    if getattr(config, "is_encoder_decoder", False):  # text to text, or speech to text (Whisper)
        model_class = AutoModelForSpeechSeq2Seq if type(config) in AutoModelForSpeechSeq2Seq._model_mapping and \
            type(config) not in AutoModelForSeq2SeqLM._model_mapping else AutoModelForSeq2SeqLM
    else:  # a multimodal LM (Qwen2-Audio, LLaVA) has no causal-LM class of its own
        model_class = AutoModelForCausalLM if type(config) in AutoModelForCausalLM._model_mapping else \
            AutoModelForMultimodalLM
    loaded = model_class.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
    if adapters is None:
        return loaded
    if os.path.isfile(os.path.join(adapters, CONFIG_NAME)):
        loaded = load_mcl_model(loaded, adapters, strict=strict)
    elif os.path.isfile(os.path.join(adapters, "adapter_config.json")):
        from peft import PeftModel

        loaded = PeftModel.from_pretrained(loaded, adapters)
    else:
        raise FileNotFoundError(f"{adapters} holds neither MCL adapters ({CONFIG_NAME}) nor a PEFT adapter "
                                "(adapter_config.json)")
    return loaded.to(device).eval()
