"""get_mcl_model on every architecture family: equivalence with PEFT, routing, inputs passing through."""

import pytest
import torch
from conftest import peft_reference, wrapped_model
from tiny_models import ARCHITECTURES, CASES, build_batch, build_model

from loramcl import MCLConfig, get_mcl_model
from loramcl.mcl.nll import sequence_nll


def _decoder_inputs(mcl, inputs, labels):
    if mcl.config.is_encoder_decoder:
        return {**inputs, "decoder_input_ids": mcl.base_model.prepare_decoder_input_ids_from_labels(labels=labels)}
    return inputs


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_stacked_forward_equals_k_separate_peft_adapters(name):
    mcl, reference, inputs, labels = wrapped_model(name)
    assert mcl.expansion_module_name == CASES[name].expansion_module
    out = mcl(**inputs, labels=labels)
    all_logits = mcl(**_decoder_inputs(mcl, inputs, labels)).logits  # [B, K, T, V]
    peft = peft_reference(reference, mcl).eval()
    causal = CASES[name].causal
    for k in range(mcl.num_hypotheses):
        peft.set_adapter(f"h{k}")
        with torch.no_grad():
            logits = peft(**_decoder_inputs(mcl, inputs, labels)).logits
        torch.testing.assert_close(out.nll[:, k], sequence_nll(logits, labels, causal), rtol=0, atol=1e-5)
        torch.testing.assert_close(all_logits[:, k], logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5", "llava_next"])
def test_one_hypothesis_equals_peft_lora(name):
    mcl, reference, inputs, labels = wrapped_model(name, num_hypotheses=1)
    peft = peft_reference(reference, mcl).eval()
    with torch.no_grad():
        expected = sequence_nll(peft(**_decoder_inputs(mcl, inputs, labels)).logits, labels, CASES[name].causal)
        out = mcl(**inputs, labels=labels)
    torch.testing.assert_close(out.nll[:, 0], expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.loss, expected.mean(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "t5", "qwen2_audio"])
def test_one_hypothesis_per_row_equals_the_stacked_columns(name):
    mcl, _, inputs, labels = wrapped_model(name)
    with torch.no_grad():
        nll = mcl(**inputs, labels=labels).nll  # [B, K]
        for k in range(mcl.num_hypotheses):
            torch.testing.assert_close(mcl(**inputs, labels=labels, hypotheses=k).nll, nll[:, k], atol=1e-5, rtol=0)
        index = torch.tensor([2, 0])
        chosen = mcl(**inputs, labels=labels, hypotheses=index).nll
    torch.testing.assert_close(chosen, nll[torch.arange(2), index], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["qwen2_audio", "llava_next"])
def test_encoders_without_adapters_run_once(name):
    """Decision 6: rows are duplicated where hypotheses start to differ, so a frozen encoder sees B rows."""
    mcl, _, inputs, labels = wrapped_model(name, targets=CASES[name].language_model_targets)
    assert mcl.expansion_module_name == "model.language_model"
    tower = mcl.base_model.model.audio_tower if name == "qwen2_audio" else mcl.base_model.model.vision_tower
    seen = []
    tower.register_forward_pre_hook(lambda module, args, kwargs: seen.append(
        next(v for v in [*args, *kwargs.values()] if torch.is_tensor(v)).shape[0]), with_kwargs=True)
    with torch.no_grad():
        with mcl.use_hypotheses(0):
            mcl.base_model(**inputs)  # one hypothesis, no duplication: the rows the encoder sees for this batch
        out = mcl(**inputs, labels=labels)
    assert len(seen) == 2 and seen[1] == seen[0]  # not K times as many
    assert out.nll.shape == (2, 3)


def test_only_adapters_are_trainable_and_counts_match():
    mcl, _, _, _ = wrapped_model("llama")
    trainable = {n for n, p in mcl.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    # 2 layers x (q, k, v: 32 -> 32/16/16, up: 32 -> 48, down: 48 -> 32), each K * r * (d_in + d_out)
    per_layer = sum(3 * 4 * (d_in + d_out) for d_in, d_out in [(32, 32), (32, 16), (32, 16), (32, 48), (48, 32)])
    assert mcl.parameter_counts()[0] == 2 * per_layer


def test_no_matching_target_lists_the_candidate_layer_names():
    with pytest.raises(ValueError, match=r"matched no layer.*down_proj.*q_proj"):
        get_mcl_model(build_model("llama"), MCLConfig(target_modules=["query"]))


def test_bad_targets_are_refused():
    with pytest.raises(ValueError, match="output layer"):
        get_mcl_model(build_model("llama"), MCLConfig(target_modules=["lm_head"]))
    with pytest.raises(ValueError, match="Embedding.*nn.Linear"):
        get_mcl_model(build_model("llama"), MCLConfig(target_modules=["embed_tokens"]))
    with pytest.raises(ValueError, match="no default target modules"):
        get_mcl_model(build_model("llava_next"), MCLConfig())
    mcl = get_mcl_model(build_model("llama"), MCLConfig())  # PEFT's default for llama: q_proj, v_proj
    assert {n.rsplit(".", 1)[-1] for n in mcl.layer_names} == {"q_proj", "v_proj"}
    with pytest.raises(ValueError, match="already has MCL adapters"):
        get_mcl_model(mcl, MCLConfig())


def test_all_linear_skips_the_output_layer():
    mcl = get_mcl_model(build_model("gpt2"), MCLConfig(target_modules="all-linear"))
    assert "lm_head" not in mcl.layer_names and len(mcl.layer_names) == 2 * 4


def test_example_without_label_token_is_an_error():
    mcl, _, inputs, labels = wrapped_model("llama")
    labels[1, :] = -100
    labels[1, 0] = 5  # a causal LM never predicts the first token: still no target
    with pytest.raises(ValueError, match=r"examples \[1\] of the batch have no label token"):
        mcl(**inputs, labels=labels)


def test_bad_hypothesis_choices_are_errors():
    mcl, _, inputs, labels = wrapped_model("llama")
    with pytest.raises(ValueError, match="hypothesis 3 does not exist"):
        mcl(**inputs, labels=labels, hypotheses=3)
    with pytest.raises(ValueError, match="one hypothesis per example"):
        mcl(**inputs, labels=labels, hypotheses=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"in \[0, 2\]"):
        mcl(**inputs, labels=labels, hypotheses=torch.tensor([0, 5]))
    with pytest.raises(RuntimeError, match="use_hypotheses"):
        mcl.generate(input_ids=inputs["input_ids"])


def test_use_hypotheses_routes_generate_and_restores():
    mcl, reference, inputs, _ = wrapped_model("llama")
    peft = peft_reference(reference, mcl).eval()
    prompt = inputs["input_ids"][:1, :4]
    for k in range(mcl.num_hypotheses):
        with mcl.use_hypotheses(k):
            ours = mcl.generate(input_ids=prompt, max_new_tokens=5, do_sample=False)
        peft.set_adapter(f"h{k}")
        assert torch.equal(ours, peft.generate(input_ids=prompt, max_new_tokens=5, do_sample=False))
    assert mcl.routing.mode == "stacked"


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_a_forward_inside_use_hypotheses_runs_the_chosen_hypotheses(name):
    """As PEFT's set_adapter then forward: hypothesis k's logits [B, T, V] and nll [B], not all K stacked."""
    mcl, reference, inputs, labels = wrapped_model(name)
    peft = peft_reference(reference, mcl).eval()
    decoder_inputs = _decoder_inputs(mcl, inputs, labels)
    with torch.no_grad():
        stacked = mcl(**decoder_inputs).logits  # [B, K, T, V]
        for k in range(mcl.num_hypotheses):
            with mcl.use_hypotheses(k):
                logits = mcl(**decoder_inputs).logits
                nll = mcl(**inputs, labels=labels).nll
            peft.set_adapter(f"h{k}")
            expected = peft(**decoder_inputs).logits
            assert logits.shape == expected.shape == stacked[:, k].shape
            torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
            torch.testing.assert_close(logits, mcl(**decoder_inputs, hypotheses=k).logits, rtol=0, atol=0)
            torch.testing.assert_close(nll, mcl(**inputs, labels=labels, hypotheses=k).nll, rtol=0, atol=0)
        index = torch.tensor([2, 0])  # one hypothesis per example
        with mcl.use_hypotheses(index):
            logits = mcl(**decoder_inputs).logits
            nll = mcl(**inputs, labels=labels).nll
        torch.testing.assert_close(logits, stacked[torch.arange(2), index], rtol=0, atol=1e-5)
        torch.testing.assert_close(nll, mcl(**inputs, labels=labels, hypotheses=index).nll, rtol=0, atol=0)
        copies = {name: torch.cat([value, value]) for name, value in decoder_inputs.items()}  # two copies
        with mcl.use_hypotheses(torch.tensor([1, 2]), copies=True):
            logits = mcl(**copies).logits  # [2B, T, V]: copy c through hypothesis 1 + c
        torch.testing.assert_close(logits, torch.cat([stacked[:, 1], stacked[:, 2]]), rtol=0, atol=1e-5)
        with mcl.use_hypotheses(index), pytest.raises(ValueError, match=r"one hypothesis per example \(4\)"):
            mcl(**copies)
    assert mcl(**inputs, labels=labels).nll.shape == (2, 3)  # outside the block: all K again


def test_packed_logits_equal_the_full_logits_path():
    """Decision 5: the LM head sees label positions only; the NLL must not change."""
    mcl, _, inputs, labels = wrapped_model("qwen2")
    with torch.no_grad():
        packed = mcl(**inputs, labels=labels).nll  # [B, K]
        full = mcl(**inputs).logits  # [B, K, T, V]
    for k in range(mcl.num_hypotheses):
        torch.testing.assert_close(packed[:, k], sequence_nll(full[:, k], labels, causal=True), atol=1e-6, rtol=0)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_gives_the_same_gradients(use_reentrant):
    """Checkpointed layers are recomputed during backward: the routing must still be the forward's."""
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        mcl, _, inputs, labels = wrapped_model("llama")
        mcl.train()
        if checkpointing:
            mcl.activation_checkpointing_enable({"use_reentrant": use_reentrant})
            assert mcl.is_activation_checkpointing
        mcl(**inputs, labels=labels, hypotheses=torch.tensor([1, 2])).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in mcl.parameters() if p.requires_grad]))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=0)


def test_low_precision_base_keeps_float32_adapters():
    base = build_model("llama").to(torch.bfloat16)
    mcl = get_mcl_model(base, MCLConfig(num_hypotheses=2, target_modules=["q_proj"], loss="annealed",
                                        temperature_decay=0.999))
    inputs, labels = build_batch("llama", base)
    out = mcl(**inputs, labels=labels)
    layer = next(layer for _, layer in mcl.mcl_layers())
    assert layer.lora_A.dtype == torch.float32 and layer.weight.dtype == torch.bfloat16
    assert out.nll.dtype == torch.float32 and torch.isfinite(out.loss)
    out.loss.backward()
    assert layer.lora_A.grad is not None


@pytest.mark.parametrize("num_hypotheses", [1, 3])
def test_gradients_equal_those_of_separate_peft_adapters(num_hypotheses):
    """sum_k q[b,k] nll[b,k] (q detached) gives each hypothesis the gradient PEFT gives its own adapter."""
    mcl, reference, inputs, labels = wrapped_model("llama", num_hypotheses=num_hypotheses, loss="relaxed",
                                              epsilon=0.2 if num_hypotheses > 1 else 0.0)
    out = mcl(**inputs, labels=labels)
    out.loss.backward()
    peft = peft_reference(reference, mcl).eval()
    for k in range(num_hypotheses):
        peft.set_adapter(f"h{k}")  # PEFT trains the active adapter only
        nll = sequence_nll(peft(**inputs).logits, labels, causal=True)  # [B]
        (out.weights[:, k] * nll).mean().backward()
        for name, layer in mcl.mcl_layers():
            module = peft.base_model.model.get_submodule(name)
            torch.testing.assert_close(layer.lora_A.grad[k], module.lora_A[f"h{k}"].weight.grad.T, atol=1e-6, rtol=0)
            torch.testing.assert_close(layer.lora_B.grad[k], module.lora_B[f"h{k}"].weight.grad.T, atol=1e-6, rtol=0)
    assert any(layer.lora_B.grad.abs().sum() > 0 for _, layer in mcl.mcl_layers())


def test_the_model_is_built_from_components_not_mixins():
    """Issue 37: at most two bases besides nn.Module; the hooks' state lives in components made with explicit
    arguments, and the baselines extend the model through its declared contract, never a private method of it."""
    from torch import nn

    from loramcl.baselines.moe import MoEModel
    from loramcl.baselines.multihead import MultiHeadModel
    from loramcl.mcl.model import MCLModel

    assert len([b for b in MCLModel.__bases__ if b is not nn.Module]) <= 2
    private = {name for cls in MCLModel.__mro__ for name in vars(cls)
               if name.startswith("_") and not name.startswith("__")}
    for baseline in (MoEModel, MultiHeadModel):
        overridden = {name for cls in baseline.__mro__[:baseline.__mro__.index(MCLModel)] for name in vars(cls)}
        assert not overridden & private, f"{baseline.__name__} overrides {sorted(overridden & private)}"
    mcl, _, inputs, labels = wrapped_model("llama")
    assert not hasattr(mcl, "_pending")
    assert mcl.copy_hooks.scope is mcl.label_logits.scope is mcl.scope
    assert mcl.scope.call.expand_batch is None  # idle between calls: the scope is armed for one call only
    out = mcl(**inputs, labels=labels)
    assert out.nll.shape == (labels.shape[0], mcl.num_hypotheses)
    assert mcl.scope.call.expand_batch is None and mcl.scope.call.logit_positions is None
