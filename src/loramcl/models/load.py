"""A local model loaded for training or decoding: a transformers folder in the class its config calls for, with MCL
adapters, a baseline's, a PEFT adapter, or none."""

from __future__ import annotations

import os

from loramcl.utils.inputs import DTYPES, check_choice, training_record
from loramcl.utils.run_best import check_loaded_best


def load_model(model: str, adapters: str | None = None, dtype: str = "float32", device: str = "cpu",
               strict: bool = False, quantization: str | None = None):
    """A local transformers model (causal, sequence-to-sequence, speech-to-text such as Whisper, or an audio/vision-
    language model such as Qwen2-Audio) in eval mode, with MCL adapters (an MCLModel), a PEFT adapter (a PeftModel)
    or none. ``strict``: MCL adapters saved on other base weights, or whose files cannot be verified, are an error,
    not a warning. ``quantization``: the base weights quantized as they load (``loramcl.mcl.quantization``: nf4, fp4,
    int8, torchao-int8), computing in ``dtype``, their normalization layers in float32; by default as the training
    run of ``adapters`` (its run.json) quantized them, so that adapters are decoded on the base they trained on.
    A run's best adapters (OUT/best, OUT/best/peft: ``training.keep_best``) are checked against their best.json and
    the run's records first (``utils.run_best.check_loaded_best``)."""
    check_choice("dtype", dtype, DTYPES)
    if adapters is not None:
        check_loaded_best(adapters)  # before anything loads: a damaged or foreign best is one line naming OUT/best
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForMultimodalLM,
        AutoModelForSeq2SeqLM,
        AutoModelForSpeechSeq2Seq,
    )

    from loramcl.mcl.adapter_files import CONFIG_NAME
    from loramcl.models.mcl import load_mcl_model

    if quantization is None and (record := training_record(adapters)) is not None:
        quantization = record[1].get("quantization")
    config = AutoConfig.from_pretrained(model)
    if getattr(config, "is_encoder_decoder", False):  # text to text, or speech to text (Whisper)
        model_class = AutoModelForSpeechSeq2Seq if type(config) in AutoModelForSpeechSeq2Seq._model_mapping and \
            type(config) not in AutoModelForSeq2SeqLM._model_mapping else AutoModelForSeq2SeqLM
    else:  # a multimodal LM (Qwen2-Audio, LLaVA) has no causal-LM class of its own
        model_class = AutoModelForCausalLM if type(config) in AutoModelForCausalLM._model_mapping else \
            AutoModelForMultimodalLM
    if quantization is None:
        loaded = model_class.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
    else:
        from loramcl.mcl.quantization import QUANTIZATIONS, norms_in_float32, quantization_config

        check_choice("quantization", quantization, QUANTIZATIONS)
        # placed on the device as it loads: a quantized model cannot be moved afterwards
        loaded = model_class.from_pretrained(model, dtype=getattr(torch, dtype), device_map=device,
                                             quantization_config=quantization_config(
                                                 quantization, getattr(torch, dtype))).eval()
        norms_in_float32(loaded)
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
    return (loaded if quantization else loaded.to(device)).eval()


def training_model_loader(model: str, dtype: str, quantization: str | None):
    """``load_model`` as a training run calls it: a plain base on the CPU (the trainer moves it); a quantized one
    where this process trains (accelerate's device: ``cuda:<local rank>`` under torchrun or accelerate launch, else
    the GPU, else the CPU), quantized there by transformers as it loads."""
    def load():
        if quantization is None:
            return load_model(model, dtype=dtype)
        from accelerate import PartialState

        return load_model(model, dtype=dtype, device=str(PartialState().device), quantization=quantization)

    return load
