"""What PEFT users reach for: disable_adapters, get_base_model, unload, rsLoRA, exclude_modules, layers_to_transform
(each against PEFT), clear errors for what is not supported (PEFT-only options, quantized base layers)."""

import copy
import json

import pytest
import torch
from conftest import randomize_adapters, wrapped_model
from tiny_models import build_batch, build_model
from torch import nn

from loramcl import MCLConfig, get_mcl_model
from loramcl.mcl.config import PEFT_ONLY_OPTIONS

TARGETS = ["q_proj", "v_proj", "down_proj"]


def test_disable_adapters_runs_the_frozen_base_model():
    mcl, pristine, inputs, labels = wrapped_model("llama")
    with torch.no_grad():
        expected = pristine(**inputs).logits
        adapted = mcl(**inputs, hypotheses=0).logits
        routing_before = vars(mcl.routing).copy()
        with mcl.disable_adapters():
            logits = mcl(**inputs).logits  # [B, T, V], no K copies
            nll = mcl(**inputs, labels=labels).nll  # [B]
            generated = mcl.generate(input_ids=inputs["input_ids"][:1, :4], max_new_tokens=4, do_sample=False)
            with pytest.raises(ValueError, match="adapters are disabled"):
                mcl(**inputs, labels=labels, hypotheses=1)
        assert torch.equal(logits, expected) and not torch.allclose(adapted, expected)
        reference = pristine.generate(input_ids=inputs["input_ids"][:1, :4], max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, reference)
    from loramcl.mcl.nll import sequence_nll

    torch.testing.assert_close(nll, sequence_nll(expected, labels, causal=True), atol=1e-6, rtol=0)
    assert vars(mcl.routing) == routing_before and mcl(**inputs, labels=labels).nll.shape == (2, 3)  # restored


def test_unload_returns_the_untouched_base_model():
    mcl, pristine, inputs, _ = wrapped_model("gpt2")
    assert mcl.get_base_model() is mcl.base_model
    base = mcl.unload()
    assert base.state_dict().keys() == pristine.state_dict().keys()
    assert all(torch.equal(value, pristine.state_dict()[key]) for key, value in base.state_dict().items())
    assert [type(m) for m in base.modules()] == [type(m) for m in pristine.modules()]
    assert all(p.requires_grad for p in base.parameters())  # as before get_mcl_model froze them
    with torch.no_grad():
        assert torch.equal(base(**inputs).logits, pristine(**inputs).logits)
    with pytest.raises(RuntimeError, match="unloaded"):
        mcl(**inputs)


@pytest.mark.parametrize("method", ["moe", "multihead"])
def test_disable_and_unload_work_for_the_baselines_too(method):
    from loramcl.baselines import MoEConfig, MultiHeadConfig, get_moe_model, get_multihead_model

    base = build_model("llama").eval()
    pristine = copy.deepcopy(base)
    inputs, _ = build_batch("llama", pristine)
    if method == "moe":
        model = get_moe_model(base, MoEConfig(num_experts=2, r=4, target_modules=["q_proj", "v_proj"]))
        randomize_adapters(model)
    else:  # random copies: the heads differ from the original module, so disabling them is visible
        model = get_multihead_model(base, MultiHeadConfig(num_hypotheses=2, module="lm_head", init="random"))
    with torch.no_grad():
        expected = pristine(**inputs).logits
        with model.disable_adapters():
            assert torch.equal(model(**inputs).logits, expected)
        assert not torch.allclose(model(**inputs, hypotheses=model.num_hypotheses - 1).logits, expected)
        unloaded = model.unload()
        assert torch.equal(unloaded(**inputs).logits, expected)
    assert [type(m) for m in unloaded.modules()] == [type(m) for m in pristine.modules()]


def _peft_with_hypothesis(model, mcl, k, **options):
    """PEFT's own LoRA on ``model`` with the same selection options, holding hypothesis k's weights."""
    from peft import LoraConfig, get_peft_model

    cfg = mcl.mcl_config
    peft = get_peft_model(model, LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, target_modules=cfg.target_modules,
                                            **options))
    wrapped = {n.removeprefix("base_model.model.") for n, m in peft.named_modules() if hasattr(m, "lora_A")
               and isinstance(getattr(m, "lora_A", None), nn.ModuleDict)}
    assert wrapped == set(mcl.layer_names)  # PEFT selects exactly our layers
    with torch.no_grad():
        for name, layer in mcl.mcl_layers():
            module = peft.base_model.model.get_submodule(name)
            module.lora_A["default"].weight.copy_(layer.lora_A[k].T)
            module.lora_B["default"].weight.copy_(layer.lora_B[k].T)
    return peft.eval()


@pytest.mark.parametrize("options", [
    dict(use_rslora=True),
    dict(exclude_modules=["model.layers.0.mlp.down_proj"]),
    dict(layers_to_transform=[1]),
    dict(layers_to_transform=0, layers_pattern="layers"),
])
def test_peft_options_give_peft_logits_and_travel_in_the_export(options, tmp_path):
    from peft import PeftModel

    mcl, pristine, inputs, _ = wrapped_model("llama", targets=TARGETS, **options)
    assert len(mcl.layer_names) < 6 or options.get("use_rslora")
    k = 2
    with torch.no_grad():
        ours = mcl(**inputs, hypotheses=k).logits
        theirs = _peft_with_hypothesis(copy.deepcopy(pristine), mcl, k, **options)(**inputs).logits
        assert not torch.allclose(ours, pristine(**inputs).logits)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    mcl.export_hypothesis(k, tmp_path)
    exported = json.loads((tmp_path / "adapter_config.json").read_text())
    assert sorted(exported["target_modules"]) == sorted(TARGETS)  # short names: the options must travel with them
    for name, value in options.items():
        assert exported[name] == value
    with torch.no_grad():
        loaded = PeftModel.from_pretrained(copy.deepcopy(pristine), tmp_path).eval()(**inputs).logits
    torch.testing.assert_close(loaded, ours, atol=1e-5, rtol=0)


def test_rslora_scales_by_alpha_over_sqrt_r_and_merges():
    mcl, _, inputs, _ = wrapped_model("llama", targets=TARGETS, use_rslora=True)
    layer = next(layer for _, layer in mcl.mcl_layers())
    assert layer.scaling == mcl.mcl_config.scaling == 8 / 2  # alpha=8, r=4
    with torch.no_grad():
        expected = mcl(**inputs, hypotheses=1).logits
        torch.testing.assert_close(mcl.merge_hypothesis(1)(**inputs).logits, expected, atol=1e-5, rtol=0)


def test_selection_options_with_all_linear():
    names = get_mcl_model(build_model("llama"), MCLConfig(
        target_modules="all-linear", exclude_modules=["o_proj", "gate_proj"], layers_to_transform=[0])).layer_names
    assert names and all(".layers.0." in n and not n.endswith(("o_proj", "gate_proj")) for n in names)
    assert len(names) == 5  # q, k, v, up, down of block 0


@pytest.mark.parametrize("option", sorted(PEFT_ONLY_OPTIONS))
def test_peft_only_options_get_a_clear_answer(option):
    with pytest.raises(ValueError, match=f"PEFT LoraConfig options: '{option}'"):
        MCLConfig(**{option: True})
    with pytest.raises(ValueError, match=f"'{option}'"):
        MCLConfig.from_dict({"r": 4, option: True})


def test_selection_options_round_trip():
    config = MCLConfig(use_rslora=True, exclude_modules=("o_proj", "k_proj"), layers_to_transform=(1, 0),
                       layers_pattern="layers")
    assert config.exclude_modules == ["k_proj", "o_proj"] and config.layers_to_transform == [0, 1]
    assert MCLConfig.from_dict(config.to_dict()) == config


def test_embedding_lora_is_refused_clearly():
    with pytest.raises(ValueError, match="embedding LoRA is not supported"):
        get_mcl_model(build_model("llama"), MCLConfig(target_modules=["embed_tokens", "q_proj"]))


class PackedInt8Linear(nn.Linear):
    """How bitsandbytes' 8-bit layers look from outside: an nn.Linear whose weight holds int8 codes."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=False)
        scale = linear.weight.abs().amax() / 127
        self.weight = nn.Parameter((linear.weight / scale).round().to(torch.int8), requires_grad=False)
        self.register_buffer("scale", scale)

    def forward(self, x):
        return x @ (self.weight.float() * self.scale).T


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_quantized_base_layers_are_refused():
    dynamic = torch.ao.quantization.quantize_dynamic(build_model("llama"), {nn.Linear}, dtype=torch.qint8)
    for targets in (TARGETS, "all-linear"):
        with pytest.raises(ValueError, match=r"quantized layers .*torch quantized module.*floating-point"):
            get_mcl_model(dynamic, MCLConfig(target_modules=targets))
    packed = build_model("llama")
    packed.model.layers[1].self_attn.v_proj = PackedInt8Linear(packed.model.layers[1].self_attn.v_proj)
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.v_proj': PackedInt8Linear with torch.int8"):
        get_mcl_model(packed, MCLConfig(target_modules=TARGETS))
    inputs, _ = build_batch("llama", packed)
    mcl = get_mcl_model(packed, MCLConfig(target_modules=["q_proj"]))  # the quantized layer left alone: fine
    randomize_adapters(mcl)
    assert mcl(**inputs).logits.shape[1] == mcl.num_hypotheses
