"""Model classes the library was not written against (issue 12), each through everything a user does: wrap, forward
with labels, one MCLTrainer step, batched greedy and beam decoding, PEFT export, merge, save and load."""

import copy

import pytest
import torch
from conftest import randomize_adapters
from tiny_models import CASES, HELD_OUT, build_batch, build_model
from transformers import TrainingArguments

from loramcl import MCLConfig, MCLTrainer, get_mcl_model, load_mcl_model
from loramcl.decoding import generate_hypotheses
from loramcl.mcl.model import decoder_input_ids_from_labels

K = 2


def _generation_inputs(name: str, inputs: dict) -> dict:
    """What generate continues: the source of an encoder-decoder, else a batch without right padding."""
    if CASES[name].causal and "pixel_values" not in inputs:  # text: left-padded prompts of different lengths
        input_ids = inputs["input_ids"][:, :6].clone()
        attention_mask = torch.ones_like(input_ids)
        input_ids[1, :2], attention_mask[1, :2] = 0, 0
        return {"input_ids": input_ids, "attention_mask": attention_mask}
    return inputs


def _with_decoder_inputs(model, inputs: dict, labels: torch.Tensor) -> dict:
    if model.config.is_encoder_decoder:
        return {**inputs, "decoder_input_ids": decoder_input_ids_from_labels(model, labels)}
    return inputs


@pytest.mark.parametrize("name", list(HELD_OUT))
@pytest.mark.filterwarnings("ignore:one hypothesis per example cannot be routed")  # Qwen2.5-VL's tower: exact, slower
def test_held_out_model_class(name, tmp_path):
    base = build_model(name).eval()
    pristine = copy.deepcopy(base)
    inputs, labels = build_batch(name, pristine)
    mcl = get_mcl_model(base, MCLConfig(num_hypotheses=K, r=4, alpha=8, target_modules=CASES[name].targets)).eval()
    assert mcl.expansion_module_name == CASES[name].expansion_module or CASES[name].targets == "all-linear"
    randomize_adapters(mcl, std=0.5)

    # forward with labels (decoder inputs derived from them): all K at once == one hypothesis at a time
    with torch.no_grad():
        nll = mcl(**inputs, labels=labels).nll  # [B, K]
        for k in range(K):
            torch.testing.assert_close(mcl(**inputs, labels=labels, hypotheses=k).nll, nll[:, k], atol=1e-5, rtol=0)
        index = torch.tensor([1, 0])  # one hypothesis per example
        torch.testing.assert_close(mcl(**inputs, labels=labels, hypotheses=index).nll, nll[torch.arange(2), index],
                                   atol=1e-5, rtol=0)
    assert not torch.allclose(nll[:, 0], nll[:, 1])  # the hypotheses differ: the equalities are not vacuous

    # the exported hypothesis in PEFT, the merged hypothesis, the saved and loaded model: the same logits
    k = 1
    model_inputs = _with_decoder_inputs(pristine, inputs, labels)
    with torch.no_grad():
        ours = mcl(**model_inputs, hypotheses=k).logits
    from peft import PeftModel

    mcl.export_hypothesis(k, tmp_path / "peft")
    peft = PeftModel.from_pretrained(copy.deepcopy(pristine), tmp_path / "peft").eval()
    merged = mcl.merge_hypothesis(k)
    mcl.save_pretrained(tmp_path / "mcl")
    loaded = load_mcl_model(copy.deepcopy(pristine), tmp_path / "mcl").eval()
    with torch.no_grad():
        torch.testing.assert_close(peft(**model_inputs).logits, ours, atol=1e-4, rtol=0)
        torch.testing.assert_close(merged(**model_inputs).logits, ours, atol=1e-4, rtol=0)
        assert torch.equal(loaded(**inputs, labels=labels).nll, nll)

    # batched K-hypothesis decoding == each hypothesis decoded alone, greedy and beam, tokens and log-probs
    generation_inputs = _generation_inputs(name, inputs)
    for strategy, num_beams in (("greedy", 1), ("beam", 2)):
        settings = dict(strategy=strategy, num_beams=num_beams, max_new_tokens=3, min_new_tokens=3)
        batched = generate_hypotheses(mcl, None, generation_inputs, **settings)
        for k in range(K):
            alone = generate_hypotheses(mcl, None, generation_inputs, hypotheses=[k], **settings)
            for i in range(len(alone)):
                assert batched[i][k].token_ids == alone[i][0].token_ids, (strategy, i, k)
                assert batched[i][k].log_prob == pytest.approx(alone[i][0].log_prob, abs=1e-4)

    # one MCLTrainer step (vanilla WTA, two passes): only adapter tensors change
    mcl.train()
    before = {n: p.detach().clone() for n, p in mcl.named_parameters()}
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=1, max_steps=1,
                             learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    MCLTrainer(mcl, args=args, train_dataset=[{**inputs, "labels": labels}],
               data_collator=lambda rows: rows[0]).train()  # one prepared batch: items of any shape
    changed = {n for n, p in mcl.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.endswith(("lora_A", "lora_B")) for n in changed)
