"""The K hypotheses in PEFT's hands: export_all's folders, to_peft's named adapters, fold_scaling, activated LoRA for
context-once hypotheses, the serving warnings and the refusals (loramcl.mcl.export)."""

import copy
import json

import pytest
import torch
from conftest import randomize_adapters, wrapped_model
from tiny_models import CASES, build_batch, build_model

from loramcl import MCLConfig, get_mcl_model
from loramcl.decoding import generate_hypotheses
from loramcl.mcl.copies import repeat_examples
from loramcl.mcl.export import ServingWarning, export_all, to_peft
from loramcl.mcl.nll import sequence_nll

K = 3
INVOCATION = 85  # inside the tiny vocabulary, never drawn as an ordinary token (< 80)


def _prompts(name, pristine):
    """Generation inputs for ``name``: a causal LM's prompts left-padded (row 1 one token shorter)."""
    inputs, _ = build_batch(name, pristine)
    if CASES[name].causal and name != "llava_next":
        ids = inputs["input_ids"][:, :5].clone()
        mask = torch.ones_like(ids)
        ids[1, 0], mask[1, 0] = 0, 0
        return {"input_ids": ids, "attention_mask": mask}
    return inputs


def _load_folders(pristine, folders):
    from peft import PeftModel

    peft = PeftModel.from_pretrained(copy.deepcopy(pristine), folders[0], adapter_name="h0")
    for k, folder in enumerate(folders[1:], start=1):
        peft.load_adapter(folder, adapter_name=f"h{k}")
    return peft.eval()


def _new_tokens(model, sequences, prompt_length: int) -> list[list[int]]:
    """The generated tokens of each row, as a Candidate holds them (no prompt, no end-of-sequence or padding)."""
    config = model.generation_config
    stop = {config.pad_token_id, *([config.eos_token_id] if isinstance(config.eos_token_id, int)
                                   else config.eos_token_id or [])}
    start = 1 if model.config.is_encoder_decoder else prompt_length
    rows = []
    for row in sequences.tolist():
        tokens = row[start:]
        while tokens and tokens[-1] in stop:
            tokens.pop()
        rows.append(tokens)
    return rows


@pytest.mark.parametrize("name", ["llama", "marian", "llava_next"])
@pytest.mark.parametrize("beams", [1, 2])
def test_exported_folders_decode_in_peft_mixed_batches_as_generate_hypotheses(name, beams, tmp_path):
    mcl, pristine, _, _ = wrapped_model(name, num_hypotheses=K)
    randomize_adapters(mcl, std=0.5)  # hypotheses far enough apart to decode differently
    inputs = _prompts(name, pristine)
    batch = inputs["input_ids"].shape[0]
    mcl.config._name_or_path = f"models/tiny-{name}"  # as from_pretrained records the folder it read
    with pytest.warns(ServingWarning, match="rank 4 is not one of vLLM's"):
        folders = export_all(mcl, tmp_path)
    assert folders == [str(tmp_path / f"h{k}") for k in range(K)]
    for folder in folders:
        config = json.loads((tmp_path / folder / "adapter_config.json").read_text())
        assert (tmp_path / folder / "adapter_model.safetensors").is_file() and config["peft_type"] == "LORA"
        assert config["base_model_name_or_path"] == f"models/tiny-{name}"
    settings = dict(max_new_tokens=4, min_new_tokens=4)
    ours = generate_hypotheses(mcl, None, inputs, strategy="beam" if beams > 1 else "greedy", num_beams=beams,
                               **settings)
    peft = _load_folders(pristine, folders)
    rows = repeat_examples(dict(inputs), K, batch)  # hypothesis-major, as generate_hypotheses lays them out
    with torch.no_grad():
        sequences = peft.generate(**rows, adapter_names=[f"h{k}" for k in range(K) for _ in range(batch)],
                                  num_beams=beams, do_sample=False, **settings)
    theirs = _new_tokens(pristine, sequences, inputs["input_ids"].shape[1])
    assert [[c.token_ids for c in row] for row in ours] == [[theirs[k * batch + i] for k in range(K)]
                                                           for i in range(batch)]
    assert any(len({tuple(c.token_ids) for c in row}) > 1 for row in ours)  # the hypotheses differ


def test_to_peft_holds_every_hypothesis_as_a_named_adapter():
    mcl, pristine, inputs, _ = wrapped_model("llama", num_hypotheses=K)
    import loramcl

    peft = loramcl.to_peft(mcl)
    assert loramcl.to_peft is to_peft and sorted(peft.peft_config) == ["h0", "h1", "h2"] and peft.active_adapter == "h0"
    with torch.no_grad():
        for k in range(K):
            peft.set_adapter(f"h{k}")
            torch.testing.assert_close(peft(**inputs).logits, mcl(**inputs, hypotheses=k).logits, atol=1e-5, rtol=0)
        with peft.disable_adapter():
            assert torch.equal(peft(**inputs).logits, pristine(**inputs).logits)
        expected = mcl(**inputs, hypotheses=2).logits  # the MCL model stays usable
    chosen = to_peft(mcl, hypotheses=[2], inplace=True)
    assert list(chosen.peft_config) == ["h2"]
    with torch.no_grad():
        torch.testing.assert_close(chosen(**inputs).logits, expected, atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match=r"to_peft\(\.\.\., inplace=True\)"):
        mcl(**inputs)


def test_fold_scaling_writes_alpha_equal_to_r_with_the_same_logits(tmp_path):
    mcl, pristine, inputs, _ = wrapped_model("llama", num_hypotheses=2, use_rslora=True)
    with pytest.warns(ServingWarning, match="rsLoRA .* llama.cpp"):
        plain = export_all(mcl, tmp_path / "plain")
    with pytest.warns(ServingWarning) as seen:
        folded = export_all(mcl, tmp_path / "folded", fold_scaling=True)
    assert not any("rsLoRA" in str(w.message) for w in seen)
    config = json.loads((tmp_path / "folded" / "h1" / "adapter_config.json").read_text())
    assert config["lora_alpha"] == config["r"] == 4 and config["use_rslora"] is False
    assert json.loads((tmp_path / "plain" / "h1" / "adapter_config.json").read_text())["use_rslora"] is True
    unfolded, refolded = _load_folders(pristine, plain), _load_folders(pristine, folded)
    with torch.no_grad():
        for k in range(2):
            unfolded.set_adapter(f"h{k}")
            refolded.set_adapter(f"h{k}")
            expected = mcl(**inputs, hypotheses=k).logits
            torch.testing.assert_close(unfolded(**inputs).logits, expected, atol=1e-5, rtol=0)
            torch.testing.assert_close(refolded(**inputs).logits, expected, atol=1e-5, rtol=0)
    peft = to_peft(mcl, fold_scaling=True)
    assert peft.peft_config["h0"].lora_alpha == 4 and not peft.peft_config["h0"].use_rslora


@pytest.mark.parametrize(("name", "config", "expected"), [
    ("llama", dict(r=8, target_modules=["q_proj", "v_proj"]), []),
    ("llama", dict(r=4, target_modules=["q_proj", "v_proj"]), ["rank 4 is not one of vLLM's.*--max-lora-rank 8"]),
    ("gpt2", dict(r=8, target_modules=["c_attn"]), [r"target modules \['c_attn'\] are not among the projections"]),
    ("bart", dict(r=8, target_modules=["q_proj"]), ["is an encoder-decoder: vLLM and llama.cpp"]),
    ("llava_next", dict(r=8, target_modules="all-linear"), ["outside the language model.*vision_tower"]),
])
def test_serving_warnings_name_what_an_engine_would_refuse_or_leave_out(name, config, expected, tmp_path):
    import warnings

    mcl = get_mcl_model(build_model(name), MCLConfig(num_hypotheses=2, alpha=16, **config))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        export_all(mcl, tmp_path, hypotheses=[1])
    messages = [str(w.message) for w in seen if issubclass(w.category, ServingWarning)]
    assert len(messages) == len(expected)
    for pattern, message in zip(expected, messages, strict=True):
        assert __import__("re").search(pattern, message), message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h1"]


def test_refusals_say_why_and_write_nothing(tmp_path):
    from loramcl.baselines import MoEConfig, MultiHeadConfig, get_moe_model, get_multihead_model

    moe = get_moe_model(build_model("llama"), MoEConfig(num_experts=2, r=4, target_modules=["q_proj"]))
    heads = get_multihead_model(build_model("llama"), MultiHeadConfig(num_hypotheses=2, module="lm_head"))
    context_once = get_mcl_model(build_model("llama"), MCLConfig(num_hypotheses=2, r=8, adapt_context=False))
    seq2seq_once = get_mcl_model(build_model("bart"), MCLConfig(num_hypotheses=2, r=8, adapt_context=False))
    plain = get_mcl_model(build_model("llama"), MCLConfig(num_hypotheses=2, r=8))
    for model, options, match in [
        (moe, {}, "LoRA-MoE model is not K LoRA adapters"),
        (heads, {}, "multi-head hypotheses are copies of a module"),
        (context_once, {}, "adapt_context=False.*export them as activated LoRA"),
        (context_once, dict(alora_invocation_tokens=[5, 6]), "must be one token id.*longer invocation"),
        (seq2seq_once, dict(alora_invocation_tokens=[5]), "activated LoRA is for causal LMs"),
        (plain, dict(alora_invocation_tokens=[5]), "adapt_context=True: they act at every position"),
        (plain, dict(hypotheses=[2]), "2 is no hypothesis of this model; it has 2, numbered 0 to 1"),
        (plain, dict(hypotheses=[1, 1]), r"hypotheses \[1, 1\] names a hypothesis twice"),
    ]:
        with pytest.raises(ValueError, match=match):
            export_all(model, tmp_path, **options)
    assert not list(tmp_path.iterdir())
    for model, match in [(moe, "LoRA-MoE"), (context_once, "act only from the last prompt token")]:
        with pytest.raises(ValueError, match=match):
            to_peft(model)


def _context_once_batch(pristine):
    """Prompts that all end with the invocation token, nowhere else (nor in the targets): [B, T] right-padded."""
    inputs, labels = build_batch("llama", pristine)
    ids = inputs["input_ids"].clone()
    ids[:, 3] = INVOCATION  # prompt = positions 0-3, target from 4
    labels = ids.clone()
    labels[:, :4] = -100
    labels[inputs["attention_mask"] == 0] = -100
    return {"input_ids": ids, "attention_mask": inputs["attention_mask"]}, labels


def test_context_once_hypotheses_export_as_activated_lora_with_the_same_logits_and_tokens(tmp_path):
    mcl, pristine, _, _ = wrapped_model("llama", num_hypotheses=K, adapt_context=False)
    inputs, labels = _context_once_batch(pristine)
    with pytest.warns(ServingWarning):
        folders = export_all(mcl, tmp_path, alora_invocation_tokens=[INVOCATION])
    assert json.loads((tmp_path / "h0" / "adapter_config.json").read_text())["alora_invocation_tokens"] == [INVOCATION]
    peft = _load_folders(pristine, folders)
    with torch.no_grad():
        ours = mcl(**inputs, labels=labels).nll  # [B, K]
        for k in range(K):
            peft.set_adapter(f"h{k}")
            logits = peft(**inputs).logits
            torch.testing.assert_close(sequence_nll(logits, labels, causal=True), ours[:, k], atol=1e-5, rtol=0)
    prompts = {"input_ids": inputs["input_ids"][:, :4], "attention_mask": torch.ones(2, 4, dtype=torch.long)}
    settings = dict(max_new_tokens=5, min_new_tokens=5)
    decoded = generate_hypotheses(mcl, None, prompts, strategy="greedy", **settings)
    with torch.no_grad():
        for k in range(K):
            peft.set_adapter(f"h{k}")
            sequences = peft.generate(**prompts, do_sample=False, output_logits=True, return_dict_in_generate=True,
                                      **settings)
            assert _new_tokens(pristine, sequences.sequences, 4) == [row[k].token_ids for row in decoded]
            steps = torch.stack(sequences.logits, dim=1).log_softmax(-1)  # [B, steps, V]
            chosen = steps.gather(2, sequences.sequences[:, 4:, None]).sum((1, 2))
            torch.testing.assert_close(chosen, torch.tensor([row[k].log_prob for row in decoded]), atol=1e-4, rtol=0)
        mcl.mcl_config.adapt_context = True  # the same weights on the prompt too: another model
        assert not torch.allclose(mcl(**inputs, labels=labels).nll, ours, atol=1e-3)


def test_export_hypothesis_takes_the_export_options(tmp_path):
    mcl, *_ = wrapped_model("llama", num_hypotheses=2)
    randomize_adapters(mcl)
    mcl.export_hypothesis(1, tmp_path, fold_scaling=True)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["lora_alpha"] == 4
