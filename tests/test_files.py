"""save_pretrained / load_mcl_model, export_hypothesis (a PEFT adapter), merge_hypothesis."""

import json
import os

import pytest
import torch
from conftest import wrapped_model
from tiny_models import CASES, build_model

from loramcl import MCLConfig, get_mcl_model, load_mcl_model


def _trained_like(name):
    return wrapped_model(name, dropout=0.1, loss="relaxed", epsilon=0.05)


def _hypothesis_logits(mcl, inputs, labels, k):
    if mcl.config.is_encoder_decoder:
        inputs = {**inputs, "decoder_input_ids": mcl.base_model.prepare_decoder_input_ids_from_labels(labels=labels)}
    with torch.no_grad():
        return mcl(**inputs, hypotheses=k).logits, inputs


def test_save_load_round_trips_exactly(tmp_path):
    mcl, pristine, inputs, labels = _trained_like("llama")
    mcl.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["mcl_adapters.safetensors", "mcl_config.json"]  # no pickle
    meta = json.loads((tmp_path / "mcl_config.json").read_text())
    assert meta["mcl_config"]["epsilon"] == 0.05 and meta["base_model_class"] == "LlamaForCausalLM"
    loaded = load_mcl_model(pristine, tmp_path).eval()
    for (_, a), (_, b) in zip(mcl.mcl_layers(), loaded.mcl_layers(), strict=True):
        assert torch.equal(a.lora_A, b.lora_A) and torch.equal(a.lora_B, b.lora_B)
        assert not b.lora_A.requires_grad  # inference by default, as PEFT
    with torch.no_grad():
        assert torch.equal(mcl(**inputs, labels=labels).nll, loaded(**inputs, labels=labels).nll)
    assert loaded.mcl_config == mcl.mcl_config


def test_loading_onto_another_model_or_folder_is_a_clear_error(tmp_path):
    mcl, _, _, _ = _trained_like("llama")
    mcl.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="matched no layer"):
        load_mcl_model(build_model("t5"), tmp_path)
    wider = build_model("llama")
    wider.get_submodule("model.layers.1.self_attn.q_proj").__init__(32, 40)  # another shape
    with pytest.raises(ValueError, match="file has shape"):
        load_mcl_model(wider, tmp_path)
    with pytest.raises(FileNotFoundError, match="not a folder written by MCLModel.save_pretrained"):
        load_mcl_model(build_model("llama"), tmp_path / "missing")


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
def test_exported_hypothesis_loads_in_peft_with_the_same_logits(tmp_path, name):
    from peft import PeftModel

    mcl, pristine, inputs, labels = _trained_like(name)
    k = 2
    mcl.export_hypothesis(k, tmp_path)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path))
    ours, model_inputs = _hypothesis_logits(mcl, inputs, labels, k)
    peft = PeftModel.from_pretrained(pristine, tmp_path).eval()
    with torch.no_grad():
        theirs = peft(**model_inputs).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(CASES[name].targets)  # short names: servable by vLLM & co


def test_export_uses_full_names_when_short_names_would_select_more_layers(tmp_path):
    mcl = get_mcl_model(build_model("llama"), MCLConfig(target_modules=r"model\.layers\.0\.self_attn\.q_proj"))
    mcl.export_hypothesis(0, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["target_modules"] == ["model.layers.0.self_attn.q_proj"]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_merged_hypothesis_gives_the_same_logits(name):
    mcl, _, inputs, labels = _trained_like(name)
    expected = [_hypothesis_logits(mcl, inputs, labels, k)[0] for k in range(3)]
    merged = mcl.merge_hypothesis(1)  # a copy: the MCL model stays usable
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(**inputs).logits, expected[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(_hypothesis_logits(mcl, inputs, labels, 0)[0], expected[0], atol=0, rtol=0)
    merged_in_place = mcl.merge_hypothesis(2, inplace=True)
    with torch.no_grad():
        torch.testing.assert_close(merged_in_place(**inputs).logits, expected[2], atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="merged in place"):
        mcl(**inputs, labels=labels)
    with pytest.raises(ValueError, match="hypothesis 7 does not exist"):
        _trained_like(name)[0].merge_hypothesis(7)
