"""save_pretrained / load_mcl_model, export_hypothesis (a PEFT adapter), merge_hypothesis."""

import copy
import hashlib
import json
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from conftest import randomize_adapters, wrapped_model
from tiny_models import CASES, build_batch, build_model

from loramcl import MCLConfig, MCLLoraLinear, get_mcl_model, load_mcl_model
from loramcl.utils.inputs import AdapterFilesWarning


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


@pytest.mark.parametrize("method", ["mcl", "moe", "multihead"])
def test_every_load_path_decodes_in_eval_mode_unless_asked_to_train(tmp_path, method):
    """A folder saved with dropout, loaded onto a base in eval mode: the model comes back in eval mode (two forwards of
    one input equal) from load_mcl_model, load_adapters and models.load_model, as PEFT's; in its built modes only when
    asked to train (issue 51: load_mcl_model returned it training, the saved dropout moving the logits by 0.5)."""
    from loramcl.baselines import MoEConfig, MultiHeadConfig, get_moe_model, get_multihead_model
    from loramcl.models import load_model

    base = build_model("llama").eval()
    base.save_pretrained(tmp_path / "base")
    pristine = copy.deepcopy(base)
    targets = CASES["llama"].targets
    model = {"mcl": lambda: get_mcl_model(base, MCLConfig(num_hypotheses=2, r=4, dropout=0.5, target_modules=targets)),
             "moe": lambda: get_moe_model(base, MoEConfig(num_experts=2, r=4, dropout=0.5, target_modules=targets)),
             "multihead": lambda: get_multihead_model(base, MultiHeadConfig(num_hypotheses=2, init="random"))}[method]()
    if method != "multihead":
        randomize_adapters(model, std=1.0)
    model.save_pretrained(tmp_path / "run")
    inputs, _ = build_batch("llama", pristine)

    def in_eval_mode(loaded):
        assert not [name for name, module in loaded.named_modules() if module.training]
        with torch.no_grad():
            assert torch.equal(loaded(**inputs).logits, loaded(**inputs).logits)

    loaded = load_mcl_model(copy.deepcopy(pristine), tmp_path / "run")
    in_eval_mode(loaded)
    loaded.train().load_adapters(tmp_path / "run")
    in_eval_mode(loaded)
    in_eval_mode(load_model(str(tmp_path / "base"), str(tmp_path / "run")))  # the CLI's and the recipes' loading
    loaded.train().load_adapters(tmp_path / "run", is_trainable=True)  # the trainer's resume: its modes stay
    assert loaded.training
    trainable = load_mcl_model(copy.deepcopy(pristine), tmp_path / "run", is_trainable=True)
    assert trainable.training and any(param.requires_grad for param in trainable.parameters())


def test_loading_onto_another_model_or_folder_is_a_clear_error(tmp_path):
    mcl, _, _, _ = _trained_like("llama")
    mcl.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="are on 10 layers, this model's layers matching .* are 0"):
        load_mcl_model(build_model("t5"), tmp_path)
    wider = build_model("llama")
    wider.get_submodule("model.layers.1.self_attn.q_proj").__init__(32, 40)  # another shape
    with pytest.raises(ValueError, match="maps 32 -> 40 features.*another width"):
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


def test_a_failed_load_leaves_the_base_model_as_it_was(tmp_path):
    import transformers as tf
    from tiny_models import _llama_text

    wider = get_mcl_model(tf.LlamaForCausalLM(tf.LlamaConfig(**{**_llama_text(), "hidden_size": 48})),
                          MCLConfig(num_hypotheses=3, r=4, alpha=8, target_modules=CASES["llama"].targets))
    wider_adapters = tmp_path / "wider"
    wider.save_pretrained(wider_adapters)
    valid, pristine, inputs, _ = _trained_like("llama")
    valid.save_pretrained(tmp_path / "valid")

    base = copy.deepcopy(pristine)
    with pytest.raises(ValueError, match="another width"):
        load_mcl_model(base, wider_adapters)
    assert not any(isinstance(m, MCLLoraLinear) for m in base.modules()) and not base._forward_pre_hooks
    assert all(p.requires_grad for p in base.parameters())
    with torch.no_grad():
        assert torch.equal(base(**inputs).logits, pristine(**inputs).logits)
    assert load_mcl_model(base, tmp_path / "valid").num_hypotheses == 3  # a retry with a valid folder works


def test_a_failure_while_wrapping_rolls_the_model_back(monkeypatch):
    from loramcl.mcl import model as model_module

    base = build_model("llama")
    layers = {name: module for name, module in base.named_modules()}

    def broken(self):
        raise RuntimeError("injected")

    monkeypatch.setattr(model_module.MCLModel, "install_hooks", broken)
    with pytest.raises(RuntimeError, match="injected"):
        get_mcl_model(base, MCLConfig(target_modules=CASES["llama"].targets))
    assert {name: module for name, module in base.named_modules()} == layers
    assert all(p.requires_grad for p in base.parameters())


def _data_start(weights):
    header = int.from_bytes(weights.read_bytes()[:8], "little")
    return 8 + header


def test_damaged_or_non_finite_weights_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    mcl, pristine, _, _ = _trained_like("llama")
    folder = tmp_path / "adapters"
    mcl.save_pretrained(folder)
    weights = folder / "mcl_adapters.safetensors"
    original = weights.read_bytes()
    meta = json.loads((folder / "mcl_config.json").read_text())
    assert len(meta["weights_sha256"]) == 64

    def damaged(edit):
        data = bytearray(original)
        edit(data)
        weights.write_bytes(bytes(data))

    def flip_exponent(data):  # the top byte of a little-endian float32 holds its sign and exponent
        data[_data_start(weights) + 4 * 17 + 3] ^= 0x40

    def zero_4k(data):
        start = _data_start(weights)
        data[start:start + 4096] = bytes(len(data[start:start + 4096]))

    for edit in (flip_exponent, zero_4k):
        damaged(edit)
        with pytest.raises(ValueError, match="does not match the SHA-256 recorded"):
            load_mcl_model(copy.deepcopy(pristine), folder)
    damaged(flip_exponent)  # still finite: the explicit opt-out loads it
    assert load_mcl_model(copy.deepcopy(pristine), folder, verify=False).num_hypotheses == 3

    damaged(lambda data: data.__setitem__(slice(8, 40), b"#" * 32))  # header corruption names the file
    with pytest.raises(ValueError, match=r"mcl_adapters.safetensors cannot be read as safetensors"):
        load_mcl_model(copy.deepcopy(pristine), folder, verify=False)
    weights.write_bytes(original[:-100])  # truncated
    with pytest.raises(ValueError, match="mcl_adapters.safetensors"):
        load_mcl_model(copy.deepcopy(pristine), folder, verify=False)

    weights.write_bytes(original)
    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name][0, 0, 0] = float("nan")  # a NaN in an otherwise valid file, with a matching checksum
    save_file(tensors, weights)
    meta["weights_sha256"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    (folder / "mcl_config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=f"{name} holds NaN or infinite values"):
        load_mcl_model(copy.deepcopy(pristine), folder)
    with pytest.raises(ValueError, match="NaN or infinite"):
        mcl.load_adapters(folder)  # the trainer's resume path reads through the same checks


def test_malformed_config_files_say_what_is_wrong(tmp_path):
    mcl, pristine, _, _ = _trained_like("llama")
    folder = tmp_path / "adapters"
    mcl.save_pretrained(folder)
    config_file = folder / "mcl_config.json"
    meta = json.loads(config_file.read_text())
    # a file written before settings_sha256 (which refuses any edit of these fields, test_file_integrity.py): the
    # values themselves are checked
    legacy = {key: value for key, value in meta.items() if key not in ("settings_sha256", "weights_dtypes")}

    def loading(text):
        config_file.write_bytes(text if isinstance(text, bytes) else text.encode())
        return pytest.raises(ValueError, match=r"mcl_config\.json")

    cases = {
        "{not json": "is not valid JSON", b"\xff\xfe{}": "is not valid JSON", "[1, 2]": "must hold a JSON object",
        json.dumps({k: v for k, v in meta.items() if k != "mcl_config"}): r"lacks \['mcl_config'\]",
        json.dumps({**meta, "adapted_modules": []}): "adapted_modules must be a non-empty list",
        json.dumps({**legacy, "mcl_config": {**meta["mcl_config"], "r": True}}): r"r \(LoRA rank\) must be an integer",
        json.dumps({**legacy, "mcl_config": {**meta["mcl_config"], "rank": 4}}): "unknown MCLConfig fields",
    }
    for text, message in cases.items():
        with loading(text) as error, warnings.catch_warnings():
            warnings.simplefilter("ignore", AdapterFilesWarning)  # the legacy files' "not verified"
            load_mcl_model(copy.deepcopy(pristine), folder)
        assert re.search(message, str(error.value)), (text, str(error.value))


def test_renamed_layers_are_named_in_the_error(tmp_path):
    from safetensors.torch import load_file, save_file

    mcl, pristine, _, _ = _trained_like("llama")
    folder = tmp_path / "adapters"
    mcl.save_pretrained(folder)
    weights = folder / "mcl_adapters.safetensors"
    tensors = {key.replace("layers.1.", "layers.7."): value for key, value in load_file(weights).items()}
    save_file(tensors, weights)
    meta = json.loads((folder / "mcl_config.json").read_text())
    meta["adapted_modules"] = [name.replace("layers.1.", "layers.7.") for name in meta["adapted_modules"]]
    meta["weights_sha256"] = hashlib.sha256(weights.read_bytes()).hexdigest()
    (folder / "mcl_config.json").write_text(json.dumps(meta))
    renamed = r"in the file only \['model\.layers\.7\..*in the model only \['model\.layers\.1\."
    with pytest.raises(ValueError, match=renamed):
        load_mcl_model(copy.deepcopy(pristine), folder)


def test_adapters_on_other_base_weights_warn_and_strict_refuses(tmp_path):
    """Same class and shapes, other weights (another seed): a warning naming both fingerprints, an error with
    strict=True (the base model untouched); the right pairing and its bfloat16 copy load silently."""
    from loramcl.mcl.fingerprint import BaseWeightsMismatch, base_fingerprint

    mcl, pristine, _, _ = _trained_like("llama")
    mcl.save_pretrained(tmp_path)
    recorded = json.loads((tmp_path / "mcl_config.json").read_text())["base_fingerprint"]
    assert recorded == base_fingerprint(pristine) and recorded.startswith("sha256-bf16-all:")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_mcl_model(copy.deepcopy(pristine), tmp_path)
        load_mcl_model(copy.deepcopy(pristine).to(torch.bfloat16), tmp_path)  # the same checkpoint in bfloat16
    torch.manual_seed(1)
    other = build_model("llama")
    theirs = base_fingerprint(other)
    assert theirs != recorded
    with pytest.raises(ValueError, match=f"trained on other base weights.*{recorded}.*{theirs}"):
        load_mcl_model(other, tmp_path, strict=True)
    assert not any(isinstance(m, MCLLoraLinear) for m in other.modules())  # refused before wrapping
    with pytest.warns(BaseWeightsMismatch, match=f"{recorded}.*LlamaForCausalLM.*{theirs}.*every output"):
        loaded = load_mcl_model(other, tmp_path)
    with pytest.warns(BaseWeightsMismatch, match="trained on other base weights"):
        loaded.load_adapters(tmp_path)  # the trainer's resume path checks it too
    with pytest.warns(BaseWeightsMismatch):  # a float16 copy rounds otherwise: documented as another fingerprint
        load_mcl_model(copy.deepcopy(pristine).half(), tmp_path)


def test_the_base_fingerprint_survives_a_bfloat16_round_trip_sees_a_sampled_change_and_skips_meta():
    from loramcl.mcl.fingerprint import base_fingerprint

    model = build_model("gpt2")
    assert base_fingerprint(model) == base_fingerprint(copy.deepcopy(model).to(torch.bfloat16).float())
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.transformer.h[1].attn.c_attn.weight[0, 0] += 1.0  # one sampled value (row 0, column 0)
    assert base_fingerprint(changed) != base_fingerprint(model)
    with torch.device("meta"):
        assert base_fingerprint(build_model("gpt2")) is None  # nothing recorded, nothing checked


def test_a_run_saved_by_an_earlier_version_loads_and_gives_the_same_outputs(tmp_path):
    """tests/fixtures/saved_run: a tiny Llama and its K = 2 adapters as loramcl wrote them before MCLModel was split
    into modules (issue 25), with the NLL and last-position logits that version computed. Loaded now, the model
    gives the same numbers (its settings, recorded before settings_sha256, are said to be unverified:
    test_file_integrity.py), and saving it again writes the same tensors and settings."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    saved = Path(__file__).resolve().parents[1] / "fixtures" / "saved_run"
    expected = json.loads((saved / "expected.json").read_text())
    with pytest.warns(AdapterFilesWarning, match="records no settings_sha256"):
        mcl = load_mcl_model(AutoModelForCausalLM.from_pretrained(saved / "base"), saved / "adapters")
    ids = torch.tensor(expected["input_ids"])
    with torch.no_grad():
        assert torch.allclose(mcl(input_ids=ids, labels=ids).nll[0], torch.tensor(expected["nll"]), atol=1e-5)
        for k, logits in enumerate(expected["last_logits"]):
            with mcl.use_hypotheses(k):
                assert torch.allclose(mcl.base_model(input_ids=ids).logits[0, -1], torch.tensor(logits), atol=1e-5)
    mcl.save_pretrained(tmp_path)
    before, after = load_file(saved / "adapters" / "mcl_adapters.safetensors"), load_file(
        tmp_path / "mcl_adapters.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[key], after[key]) for key in before)
    written, earlier = (json.loads((f / "mcl_config.json").read_text()) for f in (tmp_path, saved / "adapters"))
    assert written.pop("base_model_name_or_path") == str(saved / "base")  # loaded from there now
    assert earlier.pop("base_model_name_or_path") is None  # built in memory when the fixture was written
    # the checksum is of the file's bytes, and safetensors writes its metadata keys in no fixed order: two saves of
    # the same tensors can differ there (the tensors are compared above)
    assert written.pop("weights_sha256") and earlier.pop("weights_sha256")
    # recorded since: the settings' checksum, the tensors' dtypes, a fingerprint of every base value (not a sample)
    assert written.pop("settings_sha256") and written.pop("weights_dtypes") == ["float32"]
    assert written.pop("base_fingerprint").startswith("sha256-bf16-all:")
    assert earlier.pop("base_fingerprint").startswith("sha256-bf16-sample:")
    assert written == earlier  # the format, the settings, the layer names
