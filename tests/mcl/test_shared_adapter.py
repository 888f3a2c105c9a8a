"""The shared adapter (``MCLConfig.shared_r``): one LoRA pair of rank s on every adapted layer, run by every row, so
that hypothesis k with it is ONE LoRA of rank s + r (scaling alpha / (s + r)). Off (s = 0) the model is today's
exactly; on, it equals PEFT LoRAs of rank s + r, exports to them, saves, loads and decodes."""

import copy
import json

import pytest
import safetensors.torch
import torch
from conftest import wrapped_model
from tiny_models import CASES, build_batch, build_model

from loramcl import MCLConfig, get_mcl_model, load_mcl_model
from loramcl.decoding import generate_hypotheses
from loramcl.mcl.export import export_all, to_peft
from loramcl.mcl.layers import HypothesisRouting, MCLLoraLinear
from loramcl.mcl.nll import sequence_nll
from loramcl.mcl.routing import set_routing

K, SHARED = 3, 2


def _randomize(mcl, std: float = 0.3, seed: int = 0) -> None:
    """Every B (and the shared pair) non-zero, so that the hypotheses and the shared adapter differ from the base."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in mcl.mcl_layers():
            for part, param in layer.adapter_tensors().items():
                if part.endswith("_B") or part == "shared_A":
                    param.copy_(torch.randn(param.shape, generator=g) * std)


def _shared_model(name: str = "llama", num_hypotheses: int = K, **config):
    mcl, pristine, inputs, labels = wrapped_model(name, num_hypotheses=num_hypotheses, shared_r=SHARED, **config)
    _randomize(mcl)
    return mcl, pristine, inputs, labels


def _peft_of_rank_s_plus_r(model, mcl, hypotheses=None):
    """A PEFT model on ``model`` with one standard LoRA 'h{k}' of rank s + r per hypothesis: lora_A = [shared_A | A_k],
    lora_B = [shared_B ; B_k], lora_alpha = alpha (PEFT scales by alpha / (s + r), as the shared model does)."""
    from peft import LoraConfig, get_peft_model

    cfg = mcl.mcl_config
    hypotheses = range(cfg.num_hypotheses) if hypotheses is None else hypotheses

    def lora_config():
        return LoraConfig(r=cfg.r + cfg.shared_r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                          use_rslora=cfg.use_rslora, target_modules=mcl.layer_names)

    peft = None
    for k in hypotheses:
        if peft is None:
            peft = get_peft_model(model, lora_config(), adapter_name=f"h{k}")
        else:
            peft.add_adapter(f"h{k}", lora_config())
    with torch.no_grad():
        for name, layer in mcl.mcl_layers():
            module = peft.base_model.model.get_submodule(name)
            for k in hypotheses:
                module.lora_A[f"h{k}"].weight.copy_(torch.cat([layer.shared_A, layer.lora_A[k]], dim=1).T)
                module.lora_B[f"h{k}"].weight.copy_(torch.cat([layer.shared_B, layer.lora_B[k]], dim=0).T)
    return peft


def _decoder_inputs(mcl, inputs, labels):
    if mcl.config.is_encoder_decoder:
        return {**inputs, "decoder_input_ids": mcl.base_model.prepare_decoder_input_ids_from_labels(labels=labels)}
    return inputs


# ---- off: today's model exactly --------------------------------------------------------------------------------------


def test_shared_rank_zero_is_todays_layer_and_files_exactly(tmp_path):
    """shared_r = 0 makes no tensor and no attribute; the layer's state_dict keys and its forward are those of the
    layer without the option (the explicit stacked formula, bit for bit); the files written have no shared_r."""
    torch.manual_seed(0)
    layer = MCLLoraLinear(torch.nn.Linear(16, 8).requires_grad_(False), HypothesisRouting(), num_hypotheses=K, r=4,
                          alpha=8, shared_r=0)
    assert not hasattr(layer, "shared_A") and not hasattr(layer, "shared_B")
    assert set(layer.state_dict()) == {"base_layer.weight", "base_layer.bias", "lora_A", "lora_B"}
    assert set(layer.adapter_tensors()) == {"lora_A", "lora_B"} and layer.scaling == 8 / 4
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(K * 2, 5, 16)
    set_routing(layer.routing, None, K, rows=2)
    expected = layer.base_layer(x) + (torch.bmm(torch.bmm(x.reshape(K, -1, 16), layer.lora_A), layer.lora_B)
                                      .reshape(K * 2, 5, 8) * layer.scaling)
    assert torch.equal(layer(x), expected)
    assert "shared_r" not in MCLConfig().to_dict() and MCLConfig(shared_r=SHARED).to_dict()["shared_r"] == SHARED

    mcl, _, inputs, labels = wrapped_model("llama")
    assert mcl.shared_parameter_count() == 0
    assert all("shared" not in name for name in mcl.adapter_state_dict())
    mcl.save_pretrained(tmp_path)
    assert "shared_r" not in json.loads((tmp_path / "mcl_config.json").read_text())["mcl_config"]


# ---- on: one LoRA of rank s + r --------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_rslora", [False, True])
def test_one_hypothesis_with_a_shared_adapter_is_one_peft_lora_of_rank_s_plus_r(use_rslora):
    """K = 1 with shared rank s: the logits, the gradients (dropout on: both pairs read the one dropped input, as
    PEFT's LoRA of rank s + r does) and the weights after AdamW steps are PEFT's LoRA of rank s + r."""
    mcl, pristine, inputs, labels = _shared_model(num_hypotheses=1, dropout=0.1, use_rslora=use_rslora)
    peft = _peft_of_rank_s_plus_r(pristine, mcl).eval()
    mcl.eval()
    assert next(layer for _, layer in mcl.mcl_layers()).scaling == pytest.approx(
        8 / ((4 + SHARED) ** 0.5 if use_rslora else 4 + SHARED))
    with torch.no_grad():
        torch.testing.assert_close(mcl(**inputs).logits[:, 0], peft(**inputs).logits, rtol=0, atol=1e-6)
    mcl.train(), peft.train()
    adapters = [p for p in mcl.parameters() if p.requires_grad]
    theirs = [p for p in peft.parameters() if p.requires_grad]
    ours_opt, theirs_opt = torch.optim.AdamW(adapters, lr=1e-2), torch.optim.AdamW(theirs, lr=1e-2)
    for step in range(3):
        torch.manual_seed(step)  # the same dropout masks: one per layer, drawn in the same order
        mcl(**inputs, labels=labels).loss.backward()
        torch.manual_seed(step)
        sequence_nll(peft(**inputs).logits, labels, causal=True).mean().backward()
        for name, layer in mcl.mcl_layers():
            module = peft.base_model.model.get_submodule(name)
            grad_a, grad_b = module.lora_A["h0"].weight.grad.T, module.lora_B["h0"].weight.grad.T  # [d_in, s+r], ...
            # float32 sums in another order (one rank-(s+r) matmul against two): measured at most 1e-6 on gradients
            # up to 0.3 (rsLoRA's step 1); a wrong scaling or a second dropout mask is off by orders more
            close = dict(rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(layer.shared_A.grad, grad_a[:, :SHARED], **close)
            torch.testing.assert_close(layer.lora_A.grad[0], grad_a[:, SHARED:], **close)
            torch.testing.assert_close(layer.shared_B.grad, grad_b[:SHARED], **close)
            torch.testing.assert_close(layer.lora_B.grad[0], grad_b[SHARED:], **close)
        for optimizer in (ours_opt, theirs_opt):
            optimizer.step(), optimizer.zero_grad()
    mcl.eval(), peft.eval()
    with torch.no_grad():
        torch.testing.assert_close(mcl(**inputs).logits[:, 0], peft(**inputs).logits, rtol=0, atol=1e-5)
    assert any(layer.shared_B.abs().sum() > 0 for _, layer in mcl.mcl_layers())


@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
def test_stacked_forward_equals_k_separate_peft_loras_of_rank_s_plus_r(name):
    mcl, pristine, inputs, labels = _shared_model(name)
    out = mcl(**inputs, labels=labels)
    all_logits = mcl(**_decoder_inputs(mcl, inputs, labels)).logits  # [B, K, T, V]
    peft = _peft_of_rank_s_plus_r(pristine, mcl).eval()
    for k in range(K):
        peft.set_adapter(f"h{k}")
        with torch.no_grad():
            logits = peft(**_decoder_inputs(mcl, inputs, labels)).logits
        torch.testing.assert_close(out.nll[:, k], sequence_nll(logits, labels, CASES[name].causal), rtol=0, atol=1e-5)
        torch.testing.assert_close(all_logits[:, k], logits, rtol=0, atol=1e-5)
        with torch.no_grad():  # one hypothesis for the whole batch, and per example
            torch.testing.assert_close(mcl(**inputs, labels=labels, hypotheses=k).nll, out.nll[:, k], rtol=0,
                                       atol=1e-5)


def test_every_example_trains_the_shared_adapter_with_weights_summing_to_one():
    """WTA: each hypothesis' B gets gradient from the examples it wins only; the shared pair's gradient is the sum over
    hypotheses of each one's, weighted by q (summing to 1 per example): the gradient of PEFT's first s rank
    components summed over the K LoRAs of rank s + r."""
    mcl, pristine, inputs, labels = _shared_model(loss="wta", tie_break="lowest")
    out = mcl(**inputs, labels=labels)
    out.loss.backward()
    assert torch.equal(out.weights.sum(dim=1), torch.ones(2))
    peft = _peft_of_rank_s_plus_r(pristine, mcl).eval()
    for k in range(K):
        peft.set_adapter(f"h{k}")
        (out.weights[:, k] * sequence_nll(peft(**inputs).logits, labels, causal=True)).mean().backward()
    for name, layer in mcl.mcl_layers():
        module = peft.base_model.model.get_submodule(name)
        shared_a = sum(module.lora_A[f"h{k}"].weight.grad.T[:, :SHARED] for k in range(K))
        shared_b = sum(module.lora_B[f"h{k}"].weight.grad.T[:SHARED] for k in range(K))
        torch.testing.assert_close(layer.shared_A.grad, shared_a, rtol=0, atol=1e-6)
        torch.testing.assert_close(layer.shared_B.grad, shared_b, rtol=0, atol=1e-6)
        for k in range(K):
            torch.testing.assert_close(layer.lora_B.grad[k], module.lora_B[f"h{k}"].weight.grad.T[SHARED:], rtol=0,
                                       atol=1e-6)
    assert any(layer.shared_B.grad.abs().sum() > 0 for _, layer in mcl.mcl_layers())


def _trained(name: str = "llama", steps: int = 2, **config):
    """A K = 3 model with a shared adapter after a few AdamW steps from PEFT's init (B = 0 at first, then not)."""
    base = build_model(name).eval()
    pristine = copy.deepcopy(base)
    torch.manual_seed(0)
    mcl = get_mcl_model(base, MCLConfig(num_hypotheses=K, r=4, alpha=8, shared_r=SHARED, loss="relaxed", epsilon=0.2,
                                        target_modules=CASES[name].targets, **config))
    inputs, labels = build_batch(name, pristine)
    optimizer = torch.optim.AdamW([p for p in mcl.parameters() if p.requires_grad], lr=5e-2)
    for _ in range(steps):
        mcl(**inputs, labels=labels).loss.backward()
        optimizer.step(), optimizer.zero_grad()
    assert all(layer.shared_B.abs().sum() > 0 and layer.lora_B.abs().sum() > 0 for _, layer in mcl.mcl_layers())
    return mcl.eval(), pristine, inputs, labels


def _hypothesis_logits(mcl, inputs, k):
    with torch.no_grad(), mcl.use_hypotheses(k):
        return mcl(**inputs).logits


@pytest.mark.parametrize("fold_scaling", [False, True])
def test_an_exported_hypothesis_gives_loramcls_logits_in_peft(fold_scaling, tmp_path):
    from peft import PeftModel

    mcl, pristine, inputs, _ = _trained()
    folders = export_all(mcl, tmp_path, fold_scaling=fold_scaling)
    for k, folder in enumerate(folders):
        saved = json.loads((tmp_path / folder / "adapter_config.json").read_text())
        assert saved["r"] == 4 + SHARED and saved["lora_alpha"] == (4 + SHARED if fold_scaling else 8)
        peft = PeftModel.from_pretrained(copy.deepcopy(pristine), tmp_path / folder).eval()
        with torch.no_grad():
            torch.testing.assert_close(peft(**inputs).logits, _hypothesis_logits(mcl, inputs, k), rtol=0, atol=1e-5)


def test_merge_and_to_peft_keep_the_shared_adapter():
    mcl, pristine, inputs, _ = _trained()
    expected = [_hypothesis_logits(mcl, inputs, k) for k in range(K)]
    for k in range(K):
        with torch.no_grad():
            merged = mcl.merge_hypothesis(k)(**inputs).logits
        torch.testing.assert_close(merged, expected[k], rtol=0, atol=1e-5)
    peft = to_peft(mcl)
    for k in range(K):
        peft.set_adapter(f"h{k}")
        with torch.no_grad():
            torch.testing.assert_close(peft(**inputs).logits, expected[k], rtol=0, atol=1e-5)


def test_save_and_load_round_trip_with_the_shared_tensors(tmp_path):
    mcl, pristine, inputs, _ = _trained()
    mcl.save_pretrained(tmp_path)
    saved = safetensors.torch.load_file(tmp_path / "mcl_adapters.safetensors")
    layer = mcl.layer_names[0]
    assert saved[f"{layer}.shared_A"].shape == (32, SHARED) and saved[f"{layer}.shared_B"].shape[0] == SHARED
    assert json.loads((tmp_path / "mcl_config.json").read_text())["mcl_config"]["shared_r"] == SHARED
    loaded = load_mcl_model(copy.deepcopy(pristine), tmp_path, is_trainable=True)
    assert loaded.mcl_config.shared_r == SHARED
    for (_, ours), (_, theirs) in zip(mcl.mcl_layers(), loaded.mcl_layers(), strict=True):
        for part, param in ours.adapter_tensors().items():
            assert torch.equal(theirs.adapter_tensors()[part], param) and theirs.adapter_tensors()[part].requires_grad
    assert loaded.shared_parameter_count() == mcl.shared_parameter_count() > 0
    for k in range(K):
        assert torch.equal(_hypothesis_logits(loaded.eval(), inputs, k), _hypothesis_logits(mcl, inputs, k))
    frozen = load_mcl_model(copy.deepcopy(pristine), tmp_path)
    assert frozen.shared_parameter_count() == 0  # loaded for inference: nothing trains
    # into a model built with shared_r 2: load_adapters takes them
    other = get_mcl_model(copy.deepcopy(pristine), mcl.mcl_config)
    other.load_adapters(tmp_path)
    assert torch.equal(_hypothesis_logits(other, inputs, 1), _hypothesis_logits(mcl, inputs, 1))


def test_a_shared_tensor_of_the_wrong_shape_is_refused(tmp_path):
    mcl, *_ = _trained()
    mcl.save_pretrained(tmp_path)
    weights = tmp_path / "mcl_adapters.safetensors"
    tensors = safetensors.torch.load_file(weights)
    layer = mcl.layer_names[0]
    tensors[f"{layer}.shared_A"] = tensors[f"{layer}.shared_A"][:, :1].contiguous()  # rank 1, not 2
    safetensors.torch.save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{layer} has shared_A \(32, 1\).*shared_r=2.*needs \[32, 2\]"):
        load_mcl_model(build_model("llama"), tmp_path, verify=False)
    del tensors[f"{layer}.shared_A"]
    safetensors.torch.save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \[.*shared_A"):
        load_mcl_model(build_model("llama"), tmp_path, verify=False)


def test_adapters_with_a_shared_rank_load_only_into_a_model_built_with_it(tmp_path):
    mcl, pristine, *_ = _trained()
    mcl.save_pretrained(tmp_path)
    plain = get_mcl_model(copy.deepcopy(pristine), MCLConfig(num_hypotheses=K, r=4, alpha=8,
                                                             target_modules=CASES["llama"].targets))
    with pytest.raises(ValueError, match="shared_r=2.*this model has shared_r=0"):
        plain.load_adapters(tmp_path)
    plain.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="shared_r=0.*this model has shared_r=2"):
        mcl.load_adapters(tmp_path / "plain")
    # an edited mcl_config.json (shared_r removed) is refused, naming the field
    config = json.loads((tmp_path / "mcl_config.json").read_text())
    del config["mcl_config"]["shared_r"]
    (tmp_path / "mcl_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="shared_r was removed"):
        load_mcl_model(copy.deepcopy(pristine), tmp_path)


def test_bad_shared_ranks_are_refused_saying_what_to_change():
    with pytest.raises(ValueError, match="shared_r .*must be an integer >= 0"):
        MCLConfig(shared_r=-1)
    with pytest.raises(ValueError, match="shared_r .*must be an integer >= 0"):
        MCLConfig(shared_r=1.5)
    with pytest.raises(ValueError, match=r"alpha/\(shared_r \+ r\)"):
        MCLConfig(r=1, shared_r=1, alpha=300)
    with pytest.raises(ValueError, match="shared_r 30 \\+ r 4 is more than the rank"):
        get_mcl_model(build_model("llama"), MCLConfig(r=4, shared_r=30, target_modules=["q_proj"]))


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_decoding_all_hypotheses_at_once_gives_each_hypothesis_alones_tokens(name):
    """generate_hypotheses' fast path (the shared pair on every copy, un-gathered) against each hypothesis alone."""
    mcl, pristine, inputs, _ = _shared_model(name)
    _randomize(mcl, std=0.8)
    if name == "llama":
        inputs = {"input_ids": inputs["input_ids"][:, :5], "attention_mask": inputs["attention_mask"][:, :5]}
    settings = dict(max_new_tokens=5, min_new_tokens=5, pad_token_id=0)
    for strategy, beams in (("greedy", 1), ("beam", 2)):
        together = generate_hypotheses(mcl, None, inputs, strategy=strategy, num_beams=beams, **settings)
        start = 1 if mcl.config.is_encoder_decoder else inputs["input_ids"].shape[1]
        for k in range(K):
            with torch.no_grad(), mcl.use_hypotheses(k):
                alone = mcl.generate(**inputs, num_beams=beams, do_sample=False, **settings)[:, start:]
            assert [candidates[k].token_ids for candidates in together] == alone.tolist(), (strategy, k)
        assert any(len({tuple(c.token_ids) for c in candidates}) > 1 for candidates in together)


def test_context_once_masks_the_shared_adapter_on_the_context_too():
    """adapt_context=False: the shared pair is part of each hypothesis' LoRA, so it acts from the first target position
    on as the hypotheses do: the context run once equals the full sequence with the adapters masked."""
    from tiny_models import uneven_batch

    mcl, _, inputs, labels = _shared_model(adapt_context=False, loss="relaxed", epsilon=0.1)
    inputs, labels = uneven_batch(inputs, labels)
    results = []
    for context_once in (False, True):
        mcl.context_once = context_once
        mcl.zero_grad()
        out = mcl(**inputs, labels=labels)
        out.loss.backward()
        results.append((out.nll.detach(), {n: p.grad.clone() for n, p in mcl.named_parameters() if p.grad is not None}))
    (full, full_grads), (once, once_grads) = results
    torch.testing.assert_close(once, full, rtol=0, atol=1e-6)
    assert any("shared_A" in name for name in full_grads) and full_grads.keys() == once_grads.keys()
    for key, grad in full_grads.items():
        torch.testing.assert_close(once_grads[key], grad, rtol=0, atol=1e-6, msg=key)
    # and the masked context is not the unmasked one: the shared pair really is masked there
    mcl.mcl_config.adapt_context = True
    assert (mcl(**inputs, labels=labels).nll - full).abs().max() > 1e-3


def test_counts_say_how_many_parameters_are_shared(capsys):
    mcl, *_ = _shared_model()
    per_layer = [(layer.in_features + layer.out_features) for _, layer in mcl.mcl_layers()]
    assert mcl.shared_parameter_count() == SHARED * sum(per_layer)
    trainable, _ = mcl.parameter_counts()
    assert trainable == (K * 4 + SHARED) * sum(per_layer)  # = a LoRA-MLE of rank K*r + s
    mcl.print_trainable_parameters()
    assert f"shared adapter: {SHARED * sum(per_layer):,}" in capsys.readouterr().out


def test_assembling_runs_with_a_shared_adapter_is_refused(tmp_path):
    from loramcl.mcl.ensemble import assemble_hypotheses

    for seed in (0, 1):
        mcl, *_ = _trained()
        _randomize(mcl, seed=seed)
        mcl.save_pretrained(tmp_path / str(seed))
    with pytest.raises(ValueError, match="has a shared adapter"):
        assemble_hypotheses(build_model("llama"), [tmp_path / "0", tmp_path / "1"])


def test_activation_checkpointing_gives_the_same_gradients_with_a_shared_adapter():
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        mcl, *_, inputs, labels = _shared_model(dropout=0.1)
        mcl.train()
        if checkpointing:
            mcl.activation_checkpointing_enable({"use_reentrant": False})
        torch.manual_seed(1)
        mcl(**inputs, labels=labels).loss.backward()
        grads.append({n: p.grad.clone() for n, p in mcl.named_parameters() if p.requires_grad})
    assert any("shared_A" in name and grad.abs().sum() > 0 for name, grad in grads[0].items())
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=0, msg=name)
