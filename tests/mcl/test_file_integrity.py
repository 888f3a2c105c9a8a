"""Nothing silent (issue 36): every change of an adapter folder that changes the outputs is refused or said. Edited
settings in mcl_config.json, a removed weights checksum, tensors converted to another dtype, a base model edited in one
row, a removed base fingerprint, and folders written before the settings were recorded."""

import copy
import hashlib
import json
import warnings

import pytest
import torch
from conftest import wrapped_model
from safetensors.torch import load_file, save_file
from tiny_models import build_model

from loramcl import MCLConfig, get_mcl_model, load_mcl_model
from loramcl.utils.inputs import AdapterFilesWarning, BaseWeightsMismatch


def _saved(tmp_path, **config):
    mcl, pristine, inputs, labels = wrapped_model("llama", dropout=0.1, loss="relaxed", epsilon=0.05, **config)
    folder = tmp_path / "adapters"
    mcl.save_pretrained(folder)
    return mcl, pristine, inputs, folder


def _edit_json(folder, edit):
    meta = json.loads((folder / "mcl_config.json").read_text())
    edit(meta)
    (folder / "mcl_config.json").write_text(json.dumps(meta, indent=2))


def _silent_load(pristine, folder, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_mcl_model(copy.deepcopy(pristine), folder, **options)


@pytest.mark.parametrize("field, value, shown", [
    ("alpha", 16.0, "mcl_config.alpha is 16.0, saved as 8"),
    ("use_rslora", True, "mcl_config.use_rslora is true, saved as false"),
    ("adapt_context", False, "mcl_config.adapt_context is false, saved as true"),
    ("r", 8, "mcl_config.r is 8, saved as 4"),
    ("adapter_dtype", "base", 'mcl_config.adapter_dtype is "base", saved as "float32"'),
])
def test_an_edited_setting_that_changes_the_outputs_is_refused_naming_it(tmp_path, field, value, shown):
    """The issue's finding: alpha 8 -> 16 or use_rslora false -> true loaded and moved the logits by 0.45;
    adapt_context true -> false loaded, then a forward failed. Each is refused at load, strict or not, naming the
    field with both values, before the base model is touched; the same file restored loads again."""
    _, pristine, _, folder = _saved(tmp_path)
    original = (folder / "mcl_config.json").read_text()
    _edit_json(folder, lambda meta: meta["mcl_config"].__setitem__(field, value))
    base = copy.deepcopy(pristine)
    with pytest.raises(ValueError, match=rf"mcl_config\.json was edited after save: {shown}\. These settings "
                                         r"change every output.*Only the training settings \(dropout, epsilon"):
        load_mcl_model(base, folder)
    assert not any("lora" in name for name, _ in base.named_parameters())  # refused before wrapping
    (folder / "mcl_config.json").write_text(original)
    _silent_load(pristine, folder)


def test_training_settings_may_be_edited_and_are_validated(tmp_path):
    """dropout, the loss and its epsilon / temperatures, logits_chunk_size only shape training: editing them loads
    the same outputs; a value MCLConfig refuses is still named."""
    mcl, pristine, inputs, folder = _saved(tmp_path)
    _edit_json(folder, lambda meta: meta["mcl_config"].update(dropout=0.0, loss="annealed", temperature0=2.0,
                                                            logits_chunk_size=None, tie_break="random"))
    loaded = _silent_load(pristine, folder)
    assert loaded.mcl_config.loss == "annealed" and loaded.mcl_config.dropout == 0.0
    with torch.no_grad():
        for k in range(3):
            with mcl.use_hypotheses(k), loaded.use_hypotheses(k):
                assert torch.equal(mcl.base_model(**inputs).logits, loaded.base_model(**inputs).logits)
    _edit_json(folder, lambda meta: meta["mcl_config"].update(epsilon=0.9, loss="relaxed"))
    with pytest.raises(ValueError, match=r"mcl_config\.json: epsilon must be in \[0, \(K-1\)/K\]"):
        load_mcl_model(copy.deepcopy(pristine), folder)


def test_an_edit_is_named_even_for_a_new_field_and_when_the_header_lost_the_saved_values(tmp_path):
    _, pristine, _, folder = _saved(tmp_path)
    _edit_json(folder, lambda meta: meta["mcl_config"].update(rank=4))
    with pytest.raises(ValueError, match=r'mcl_config\.rank = 4 was added'):
        load_mcl_model(copy.deepcopy(pristine), folder)
    _edit_json(folder, lambda meta: (meta["mcl_config"].pop("rank"), meta.update(weights_dtypes=["bfloat16"])))
    with pytest.raises(ValueError, match=r'weights_dtypes is \["bfloat16"\], saved as \["float32"\]'):
        load_mcl_model(copy.deepcopy(pristine), folder)
    # the weights rewritten without loramcl's header (another tool) and the checksum updated: still refused
    weights = folder / "mcl_adapters.safetensors"
    save_file(load_file(weights), weights)
    _edit_json(folder, lambda meta: meta.update(weights_dtypes=["float32"], weights_sha256=hashlib.sha256(
        weights.read_bytes()).hexdigest()))
    _edit_json(folder, lambda meta: meta["mcl_config"].update(use_rslora=True))
    with pytest.raises(ValueError, match=r"do not match the settings_sha256 .* One of adapt_context, adapter_dtype, "
                                         r"alpha, .*use_rslora and weights_dtypes changed"):
        load_mcl_model(copy.deepcopy(pristine), folder)


def test_a_reordered_set_of_layers_loads_at_load_and_on_resume(tmp_path):
    """Issue 51: target_modules reordered (the same set) was refused as an edit that "changes every output". Lists that
    name a set of layers compare as sets, at load and on resume; another set is still refused."""
    mcl, pristine, inputs, folder = _saved(tmp_path, exclude_modules=["k_proj", "up_proj"], layers_to_transform=[0, 1])
    saved = json.loads((folder / "mcl_config.json").read_text())["mcl_config"]
    reordered = {field: saved[field][::-1] for field in ("target_modules", "exclude_modules", "layers_to_transform")}
    _edit_json(folder, lambda meta: meta["mcl_config"].update(reordered))
    loaded = _silent_load(pristine, folder)
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, mcl(**inputs).logits)
    resumed = get_mcl_model(copy.deepcopy(pristine), MCLConfig.from_dict(saved | reordered))
    resumed.load_adapters(folder)  # the resume path: the run's settings in another order
    _edit_json(folder, lambda meta: meta["mcl_config"].update(layers_to_transform=[1]))
    with pytest.raises(ValueError, match=r"edited after save: mcl_config\.layers_to_transform is \[1\], saved as "
                                         r"\[0, 1\]\. These settings change every output"):
        load_mcl_model(copy.deepcopy(pristine), folder)


def test_a_wrong_settings_checksum_is_named_as_the_checksum(tmp_path):
    """Issue 51: a wrong settings_sha256 was refused saying the weights file no longer held the saved settings, which
    it did: the message says which value disagrees with which."""
    _, pristine, _, folder = _saved(tmp_path)
    recorded = json.loads((folder / "mcl_config.json").read_text())["settings_sha256"]
    _edit_json(folder, lambda meta: meta.update(settings_sha256="0" * 64))
    with pytest.raises(ValueError, match=rf"mcl_config\.json: settings_sha256 is 0{{64}}, but its settings and those "
                                         r"saved in the header of mcl_adapters\.safetensors are the same and hash to "
                                         rf"{recorded}: settings_sha256 was edited or damaged, not the settings"):
        load_mcl_model(copy.deepcopy(pristine), folder)
    _edit_json(folder, lambda meta: meta["mcl_config"].update(alpha=16))
    with pytest.raises(ValueError, match=r"mcl_config\.json and the header of mcl_adapters\.safetensors hold other "
                                         r"settings \(mcl_config\.alpha is 16, saved as 8, 'saved as' naming the "
                                         r"header's\), and neither matches the settings_sha256"):
        load_mcl_model(copy.deepcopy(pristine), folder)


def test_the_baselines_settings_are_covered_the_same_way(tmp_path):
    """LoRA-MoE and multi-head folders: an edited alpha / module is refused naming it; a training setting (the
    router's initialisation) may be edited."""
    from loramcl.baselines import MoEConfig, MultiHeadConfig, get_moe_model, get_multihead_model

    base = build_model("llama")
    get_moe_model(copy.deepcopy(base), MoEConfig(num_experts=2, r=4, alpha=8, target_modules=["q_proj"])) \
        .save_pretrained(tmp_path / "moe")
    get_multihead_model(copy.deepcopy(base), MultiHeadConfig(num_hypotheses=2, module="lm_head")) \
        .save_pretrained(tmp_path / "multihead")
    _edit_json(tmp_path / "moe", lambda meta: meta["moe_config"].update(router_std=0.5))
    _silent_load(base, tmp_path / "moe")
    _edit_json(tmp_path / "moe", lambda meta: meta["moe_config"].update(alpha=4))
    with pytest.raises(ValueError, match=r"edited after save: moe_config\.alpha is 4, saved as 8"):
        load_mcl_model(copy.deepcopy(base), tmp_path / "moe")
    _edit_json(tmp_path / "multihead", lambda meta: meta["multihead_config"].update(dtype="base"))
    with pytest.raises(ValueError, match=r'edited after save: multihead_config\.dtype is "base", saved as "float32"'):
        load_mcl_model(copy.deepcopy(base), tmp_path / "multihead")


def test_the_resume_path_refuses_adapters_of_other_output_settings(tmp_path):
    """MCLModel.load_adapters (the trainer's resume) compares every output setting with the model's, not only K, r
    and alpha: use_rslora used to load silently."""
    _, pristine, _, folder = _saved(tmp_path)
    other = get_mcl_model(copy.deepcopy(pristine), MCLConfig(num_hypotheses=3, r=4, alpha=8, use_rslora=True,
                                                             target_modules=["q_proj", "k_proj", "v_proj", "up_proj",
                                                                             "down_proj"]))
    with pytest.raises(ValueError, match=r"holds adapters with use_rslora=False; this model has use_rslora=True"):
        other.load_adapters(folder)


@pytest.mark.parametrize("removed", ["deleted", "null"])
def test_a_folder_without_a_weights_checksum_warns_and_strict_refuses(tmp_path, removed):
    """weights_sha256 deleted (or null) and bytes damaged used to load with adapters off by up to 72, silently."""
    _, pristine, _, folder = _saved(tmp_path)
    weights = folder / "mcl_adapters.safetensors"
    data = bytearray(weights.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    data[start + 4 * 17 + 3] ^= 0x40  # an exponent bit of one float32: a finite, wrong value
    weights.write_bytes(bytes(data))
    _edit_json(folder, lambda meta: meta.pop("weights_sha256") if removed == "deleted" else
               meta.update(weights_sha256=None))
    with pytest.warns(AdapterFilesWarning, match=r"records no weights_sha256 .*mcl_adapters\.safetensors is not "
                                                 r"verified.*strict=True, or --strict true .* refuses this"):
        load_mcl_model(copy.deepcopy(pristine), folder)
    with pytest.raises(ValueError, match="records no weights_sha256"):
        load_mcl_model(copy.deepcopy(pristine), folder, strict=True)
    _silent_load(pristine, folder, verify=False)  # the explicit opt-out: nothing checked, nothing said


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tensors_converted_after_save_are_said_with_both_dtypes(tmp_path, dtype):
    """Re-saved in float16 / bfloat16 with the checksum updated: the outputs move by the rounding (5e-4 / 4e-3 in the
    issue). It loads, with a warning naming both dtypes; strict refuses."""
    _, pristine, _, folder = _saved(tmp_path)
    weights = folder / "mcl_adapters.safetensors"
    save_file({key: value.to(dtype) for key, value in load_file(weights).items()}, weights)
    _edit_json(folder, lambda meta: meta.update(weights_sha256=hashlib.sha256(weights.read_bytes()).hexdigest()))
    name = str(dtype).removeprefix("torch.")
    with pytest.warns(AdapterFilesWarning, match=f"holds {name} tensors, saved as float32: they were converted"):
        load_mcl_model(copy.deepcopy(pristine), folder)
    with pytest.raises(ValueError, match=f"holds {name} tensors, saved as float32"):
        load_mcl_model(copy.deepcopy(pristine), folder, strict=True)


@pytest.mark.parametrize("where", ["model.layers.1.self_attn.q_proj.weight", "model.embed_tokens.weight"])
def test_one_edited_row_of_the_base_is_caught(tmp_path, where):
    """One row outside the old fingerprint's sample (8 evenly spaced rows): one row of an adapted q_proj + 0.5
    (the logits moved by 0.26 in the issue) or one token's embedding. The old, sampled fingerprint misses both; the
    fingerprint of every value warns, and strict refuses."""
    from loramcl.mcl.fingerprint import sampled_fingerprint

    _, pristine, _, folder = _saved(tmp_path)
    edited = copy.deepcopy(pristine)
    with torch.no_grad():
        edited.get_parameter(where)[1] += 0.5  # row 1: between sampled rows 0 and 4 (of 32) or 0 and 14 (of 96)
    assert sampled_fingerprint(edited) == sampled_fingerprint(pristine)  # the old blind spot
    with pytest.warns(BaseWeightsMismatch, match=r"trained on other base weights.*every value of every base weight"):
        load_mcl_model(copy.deepcopy(edited), folder)
    with pytest.raises(ValueError, match="trained on other base weights"):
        load_mcl_model(edited, folder, strict=True)


def test_a_folder_without_a_base_fingerprint_warns_and_strict_refuses(tmp_path):
    """With base_fingerprint deleted, a base of another seed used to pass without a word. On the right base the
    folder still loads the saved adapters whole: the same tensors, the same logits as the model that saved them."""
    mcl, pristine, inputs, folder = _saved(tmp_path)
    _edit_json(folder, lambda meta: meta.pop("base_fingerprint"))
    with pytest.warns(AdapterFilesWarning, match="record no base_fingerprint"):
        same_base = load_mcl_model(copy.deepcopy(pristine), folder)
    saved = dict(mcl.mcl_layers())
    for name, layer in same_base.mcl_layers():
        assert torch.equal(layer.lora_A, saved[name].lora_A) and torch.equal(layer.lora_B, saved[name].lora_B)
    with torch.no_grad():
        expected = mcl(**inputs).logits  # [B, K, T, V]
        torch.testing.assert_close(same_base.eval()(**inputs).logits, expected, rtol=0, atol=0)
        assert not torch.allclose(pristine(**inputs).logits, expected[:, 0])  # the adapters change the logits
    torch.manual_seed(2)
    other = build_model("llama")
    with pytest.warns(AdapterFilesWarning, match=r"record no base_fingerprint .* are not verified"):
        loaded = load_mcl_model(copy.deepcopy(other), folder)
    with pytest.warns(AdapterFilesWarning, match="record no base_fingerprint"):
        loaded.load_adapters(folder)  # the resume path
    with pytest.raises(ValueError, match="record no base_fingerprint"):
        load_mcl_model(other, folder, strict=True)


def test_the_fingerprint_sums_are_exact_whatever_the_chunks_and_reused_when_wrapping(tmp_path, monkeypatch):
    """Every value rounded to bfloat16, then exact integer block sums: equal to a sum in Python integers, the same
    for a bfloat16 copy, for any chunk size (as on another device, where the additions run in another order), and
    computed once per load (wrapping reuses the value just checked)."""
    from loramcl.mcl import fingerprint

    model = build_model("llama")
    value = fingerprint.base_fingerprint(model)
    assert value.startswith("sha256-bf16-all:")
    assert fingerprint.base_fingerprint(copy.deepcopy(model).to(torch.bfloat16)) == value
    if torch.cuda.is_available():
        assert fingerprint.base_fingerprint(copy.deepcopy(model).cuda()) == value
    monkeypatch.setattr(fingerprint, "BLOCK", 64)  # the tiny tensors span many blocks and chunks, with a tail
    embedding = model.get_input_embeddings().weight  # [96, 32]: 48 blocks of 64
    bits = embedding.detach().to(torch.bfloat16).view(torch.int16).reshape(-1).tolist()
    weights = [int(w) for w in fingerprint._block_weights(torch.device("cpu")).tolist()]
    expected = [sum(b * w for b, w in zip(bits[i:i + 64], weights, strict=False)) for i in range(0, len(bits), 64)]
    assert fingerprint._block_sums(embedding, {}).tolist() == expected
    fingerprints = set()
    for chunk in (64, 192, 1 << 22):
        monkeypatch.setattr(fingerprint, "CHUNK", chunk)
        fingerprints.add(fingerprint.base_fingerprint(model))
    assert len(fingerprints) == 1 and value not in fingerprints  # another BLOCK, another scheme
    monkeypatch.undo()
    calls = []
    monkeypatch.setattr(fingerprint, "_block_sums", lambda *args: calls.append(1) or torch.zeros(1))
    mcl = get_mcl_model(copy.deepcopy(model), MCLConfig(target_modules=["q_proj"]))
    wrapped = len(calls)
    mcl.save_pretrained(tmp_path)
    calls.clear()
    load_mcl_model(copy.deepcopy(model), tmp_path)
    assert len(calls) == wrapped  # once, not once for the check and once more for wrapping


def test_a_folder_of_an_earlier_version_loads_with_a_warning_and_a_second_save_upgrades_it(tmp_path):
    """tests/fixtures/saved_run was written before the settings checksum and the full fingerprint: it loads (its
    legacy, sampled base fingerprint is still compared) with one warning that its settings are not verified, strict
    refuses it, and saving it again records everything: the new folder loads strictly, silently."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    saved = Path(__file__).resolve().parents[1] / "fixtures" / "saved_run"
    base = AutoModelForCausalLM.from_pretrained(saved / "base")
    with pytest.warns(AdapterFilesWarning) as caught:
        mcl = load_mcl_model(copy.deepcopy(base), saved / "adapters")
    said = [str(w.message) for w in caught if issubclass(w.category, AdapterFilesWarning)]
    assert len(said) == 1 and "records no settings_sha256" in said[0], said
    with pytest.raises(ValueError, match="records no settings_sha256"):
        load_mcl_model(copy.deepcopy(base), saved / "adapters", strict=True)
    torch.manual_seed(3)
    with pytest.warns(AdapterFilesWarning) as caught:  # the legacy fingerprint is still compared
        load_mcl_model(AutoModelForCausalLM.from_config(base.config), saved / "adapters")
    assert any(w.category is BaseWeightsMismatch and "8 rows x 64 values per tensor, as an earlier loramcl" in
               str(w.message) for w in caught)
    mcl.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "mcl_config.json").read_text())
    assert meta["base_fingerprint"].startswith("sha256-bf16-all:") and meta["weights_dtypes"] == ["float32"]
    _silent_load(base, tmp_path, strict=True)


def test_loramcl_generate_refuses_an_edited_folder_and_says_an_unverified_one(tmp_path, capsys):
    """The command line the issue ran: `loramcl generate` on a folder with alpha edited exited 0 with other
    candidates; now one error line naming the field, and nothing written. Without weights_sha256: one warning line,
    and --strict true refuses."""
    from tiny_models import word_tokenizer

    from loramcl.cli import main

    base = build_model("llama")
    base.save_pretrained(tmp_path / "base")
    word_tokenizer().save_pretrained(tmp_path / "base")
    get_mcl_model(base, MCLConfig(num_hypotheses=2, r=4, alpha=8, target_modules=["q_proj"])).save_pretrained(
        tmp_path / "run")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"id": "p0", "prompt": "w5 w6"}) + "\n")
    original = (tmp_path / "run" / "mcl_config.json").read_text()

    def generate(out, *extra):
        main(["generate", "--model", str(tmp_path / "base"), "--adapters", str(tmp_path / "run"), "--input",
              str(tmp_path / "prompts.jsonl"), "--max_new_tokens", "2", "--progress", "false", "--out",
              str(tmp_path / out), *extra])

    _edit_json(tmp_path / "run", lambda meta: meta["mcl_config"].update(alpha=16))
    with pytest.raises(SystemExit) as stopped:
        generate("edited.jsonl")
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("loramcl ")]
    assert stopped.value.code == 1 and len(error) == 1, error
    assert error[0].startswith("loramcl generate: error: ") and "mcl_config.alpha is 16, saved as 8" in error[0]
    assert not (tmp_path / "edited.jsonl").exists()
    (tmp_path / "run" / "mcl_config.json").write_text(original)
    _edit_json(tmp_path / "run", lambda meta: meta.pop("weights_sha256"))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        generate("unverified.jsonl")
    said = [line for line in capsys.readouterr().err.splitlines() if ": warning: " in line]
    assert len(said) == 1 and said[0].startswith("loramcl generate: warning: ") and "records no weights_sha256" in \
        said[0], said
    with pytest.raises(SystemExit):
        generate("strict.jsonl", "--strict", "true")
    assert "records no weights_sha256" in capsys.readouterr().err and not (tmp_path / "strict.jsonl").exists()


def test_the_fault_injection_file_families_end_refused_or_said(tmp_path):
    """benchmarks/checks/fault_injection.py's file families, one trial of each random family: no trial loads silently
    with other outputs, strict=True refuses whatever was said, and the training settings load silently."""
    from benchmarks.checks.fault_files import file_table, file_trials

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        records = file_trials(tmp_path, trials=1, seed=0)
    rows = {row["family"]: row for row in file_table(records)}
    assert sum(row["silent, other outputs"] for row in rows.values()) == 0, records
    assert all(r["strict_refused"] for r in records if r["outcome"] == "said")
    assert rows["edited training settings (allowed)"]["silent, same outputs"] == len(
        [r for r in records if r["family"] == "edited training settings (allowed)"]) > 0
    assert rows["edited output settings"]["refused"] >= 10
