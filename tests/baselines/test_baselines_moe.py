"""LoRA-MoE (paper App. F): the soft router's equation, its reductions, training, stochastic-router decoding, files."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import peft_reference
from scipy.stats import chisquare
from tiny_models import CASES, build_batch, build_model
from torch import nn

import loramcl
from loramcl import MCLConfig, MCLTrainer, get_mcl_model, load_mcl_model
from loramcl.baselines import MoEConfig, get_moe_model, get_multihead_model, parameter_parity
from loramcl.baselines.moe import MoELoraLinear, RouterState
from loramcl.baselines.multihead import MultiHeadConfig
from loramcl.decoding import generate_hypotheses
from loramcl.mcl.layers import HypothesisRouting
from loramcl.mcl.methods import register_method

TARGETS = CASES["llama"].targets


def moe_model(num_experts=3, name="llama", expert_std=0.1, router_std=None, seed=0):
    """(MoE model with random experts, pristine base, inputs, labels); router zero unless router_std is given."""
    torch.manual_seed(seed)
    base = build_model(name).eval()
    pristine = copy.deepcopy(base)
    config = MoEConfig(num_experts=num_experts, r=4, alpha=8, target_modules=CASES[name].targets,
                       **({"router_init": "normal", "router_std": router_std} if router_std else {}))
    moe = get_moe_model(base, config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in moe.mcl_layers():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * expert_std)
    inputs, labels = build_batch(name, pristine)
    return moe, pristine, inputs, labels


def layer(in_features=6, out_features=5, num_experts=3, r=2, alpha=4.0, state=None) -> MoELoraLinear:
    torch.manual_seed(1)
    moe = MoELoraLinear(nn.Linear(in_features, out_features), HypothesisRouting(), state or RouterState(),
                        MoEConfig(num_experts=num_experts, r=r, alpha=alpha))
    with torch.no_grad():
        moe.lora_B.normal_()
    return moe


def expert_deltas(moe: MoELoraLinear, x: torch.Tensor) -> torch.Tensor:
    """(alpha/r) x A_e B_e for every expert, one at a time: [E, ..., d_out]."""
    return torch.stack([x @ moe.lora_A[e] @ moe.lora_B[e] * moe.scaling for e in range(moe.num_experts)])


# ---- the equation --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_one_expert_equals_peft_lora(name):
    """E = 1: gamma = 1 whatever the router, so the MoE is plain LoRA (PEFT's, weights copied)."""
    moe, pristine, inputs, _ = moe_model(num_experts=1, name=name, router_std=1.0)
    mle = get_mcl_model(copy.deepcopy(pristine), MCLConfig(num_hypotheses=1, r=4, alpha=8,
                                                           target_modules=CASES[name].targets))
    with torch.no_grad():
        for (_, ours), (_, theirs) in zip(moe.mcl_layers(), mle.mcl_layers(), strict=True):
            theirs.lora_A.copy_(ours.lora_A)
            theirs.lora_B.copy_(ours.lora_B)
    peft = peft_reference(copy.deepcopy(pristine), mle).eval()
    with torch.no_grad():
        expected = peft(**inputs).logits
        got = moe(**inputs, hypotheses=0).logits
        assert (got - expected).abs().max() < 1e-5
        assert (expected - pristine.eval()(**inputs).logits).abs().max() > 1e-3  # the experts do something


def test_zero_router_gives_the_mean_of_the_experts():
    moe = layer()
    x = torch.randn(2, 4, 6)
    expected = moe.base_layer(x) + expert_deltas(moe, x).mean(dim=0)
    assert torch.allclose(moe(x), expected, atol=1e-6)


def test_zero_router_model_equals_peft_lora_of_the_concatenated_experts():
    """With a zero router the MoE is one LoRA of rank E*r: A = [A_1 ... A_E], B = [B_1; ...; B_E] / E."""
    moe, pristine, inputs, _ = moe_model(num_experts=3)
    mle = get_mcl_model(copy.deepcopy(pristine), MCLConfig(num_hypotheses=1, r=12, alpha=24, target_modules=TARGETS))
    with torch.no_grad():
        for (_, ours), (_, theirs) in zip(moe.mcl_layers(), mle.mcl_layers(), strict=True):
            theirs.lora_A[0].copy_(torch.cat(list(ours.lora_A), dim=1))  # [d_in, E*r]
            theirs.lora_B[0].copy_(torch.cat(list(ours.lora_B), dim=0) / 3)  # [E*r, d_out]
    peft = peft_reference(pristine, mle).eval()
    with torch.no_grad():
        assert (moe(**inputs, hypotheses=0).logits - peft(**inputs).logits).abs().max() < 1e-5


def test_router_softmax_is_per_token():
    """Two tokens routed to different experts by a hand-set router: each token's output uses its own gamma."""
    moe = layer(in_features=4, num_experts=2)
    with torch.no_grad():
        moe.router.copy_(torch.tensor([[4.0, -4.0], [-4.0, 4.0], [0.0, 0.0], [0.0, 0.0]]))
    a, b = torch.tensor([1.0, 0.0, 0.5, 0.0]), torch.tensor([0.0, 1.0, 0.0, -0.5])
    x = torch.stack([a, b]).unsqueeze(0)  # [1, 2 tokens, 4]
    gamma = torch.stack([torch.softmax(t @ moe.router, dim=0) for t in (a, b)])  # [2 tokens, E], one at a time
    assert gamma[0, 0] > 0.99 and gamma[1, 1] > 0.99
    deltas = expert_deltas(moe, x)[:, 0]  # [E, 2 tokens, d_out]
    expected = moe.base_layer(x)[0] + torch.einsum("te,eto->to", gamma, deltas)
    out = moe(x)[0]
    assert torch.allclose(out, expected, atol=1e-6)
    # a router pooled over the sequence would give token a another output beside b than beside itself
    assert torch.allclose(moe(torch.stack([a, a]).unsqueeze(0))[0, 0], out[0], atol=1e-6)


def test_gradients_reach_routers_and_experts_only():
    moe, _, inputs, labels = moe_model(router_std=0.5)
    moe.train()
    moe(**inputs, labels=labels).loss.backward()
    for name, moe_layer in moe.mcl_layers():
        for part, param in moe_layer.adapter_tensors().items():
            assert param.grad is not None and param.grad.abs().sum() > 0, (name, part)
    assert all(p.grad is None for n, p in moe.named_parameters() if not n.endswith(("lora_A", "lora_B", "router")))


def test_a_saved_baseline_loads_in_a_process_that_never_imported_the_baselines(tmp_path):
    """mcl/ names no baseline: LoRA-MoE registers its loader when loramcl.baselines is imported, which the room of
    load_mcl_model does (loramcl.models.mcl, a floor above the baselines), so a fresh process importing only it loads a
    MoE folder (issue 62). The MoE module itself is imported only by the load."""
    moe, pristine, inputs, labels = moe_model()
    pristine.save_pretrained(tmp_path / "base")
    moe.save_pretrained(tmp_path / "moe")
    script = ("import sys\nfrom transformers import AutoModelForCausalLM\n"
              "from loramcl.models.mcl import load_mcl_model\n"
              "before = [name for name in sys.modules if name.startswith('loramcl.baselines.')]\n"
              f"model = load_mcl_model(AutoModelForCausalLM.from_pretrained({str(tmp_path / 'base')!r}), "
              f"{str(tmp_path / 'moe')!r})\n"
              "print(before, type(model).__module__, type(model).__name__, model.moe_config.num_experts)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(loramcl.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "loramcl.baselines.moe", "MoEModel", "3"]


def test_a_folder_of_an_unregistered_method_names_it_and_the_registration(tmp_path):
    moe, pristine, _, _ = moe_model()
    moe.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "mcl_config.json").read_text())
    saved["method"] = "mine"
    (tmp_path / "mcl_config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"holds a 'mine' model, and no loader.*\(registered: moe, multihead\)"
                                         r".*\(import loramcl.baselines\)"):
        load_mcl_model(pristine, tmp_path, verify=False)
    with pytest.raises(ValueError, match="'mcl' is LoRA-MCL itself"):
        register_method("mcl", lambda *args: None)


def test_trains_through_mcl_trainer_and_reloads(tmp_path):
    """MCLTrainer trains it as an MLE model (nll [B, 1]): one step changes experts and routers only; the saved
    folder (safetensors + JSON) reloads through load_mcl_model to the same logits."""
    from transformers import TrainingArguments

    moe, pristine, inputs, labels = moe_model()
    rows = [{"input_ids": inputs["input_ids"][i], "attention_mask": inputs["attention_mask"][i],
             "labels": labels[i]} for i in range(2)]
    before = {n: p.detach().clone() for n, p in moe.named_parameters()}
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, learning_rate=1e-2,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    MCLTrainer(moe, args=args, train_dataset=rows).train()
    changed = {n for n, p in moe.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {n for n in before if n.endswith(("lora_A", "lora_B", "router"))}
    moe.eval().save_pretrained(tmp_path / "moe")
    loaded = load_mcl_model(pristine, tmp_path / "moe")
    assert type(loaded) is type(moe) and loaded.moe_config == moe.moe_config
    with torch.no_grad():
        assert torch.equal(loaded(**inputs, labels=labels).nll, moe(**inputs, labels=labels).nll)


def test_merge_and_export_are_refused(tmp_path):
    moe, _, _, _ = moe_model()
    with pytest.raises(ValueError, match="merge is not defined for LoRA-MoE"):
        moe.merge_hypothesis(0)
    with pytest.raises(ValueError, match="router"):
        moe.export_hypothesis(0, tmp_path)


def test_config_errors():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_experts"):
            MoEConfig(num_experts=bad)
    with pytest.raises(ValueError, match="router_init"):
        MoEConfig(router_init="uniform")
    with pytest.raises(ValueError, match="r \\(LoRA rank\\)"):
        MoEConfig(r=0)
    with pytest.raises(TypeError, match="MoEConfig"):
        get_moe_model(build_model("llama"), MCLConfig())


# ---- stochastic-router decoding ------------------------------------------------------------------------------


def test_sampled_experts_follow_the_router_probabilities():
    """Per (layer, token), the experts drawn match gamma (chi-square), and two layers draw independently.

    Each expert writes its own number (e + 1) * scale, so the output tells which expert a token used."""
    state = RouterState(mode="sampled", generators=[torch.Generator().manual_seed(0)])
    probabilities = {  # layer -> [token a, token b] -> gamma over 3 experts
        0: torch.tensor([[0.2, 0.3, 0.5], [0.6, 0.3, 0.1]]),
        1: torch.tensor([[0.7, 0.1, 0.2], [0.1, 0.45, 0.45]]),
    }
    layers = []
    for li in range(2):
        moe = layer(in_features=2, out_features=1, num_experts=3, r=1, state=state)
        with torch.no_grad():
            moe.base_layer.weight.zero_()
            moe.base_layer.bias.zero_()
            moe.lora_A.fill_(1.0)  # x A_e = 1 for a one-hot token
            moe.lora_B.copy_(torch.arange(1.0, 4.0).view(3, 1, 1))
            moe.router.copy_(probabilities[li].log())  # one-hot token t -> logits log gamma_t
        layers.append(moe)
    n = 6000
    x = torch.eye(2).repeat(n, 1).view(n, 2, 2)  # [n rows, tokens a and b, 2]
    with torch.no_grad():
        experts = [(moe(x)[..., 0] / moe.scaling).round().long() - 1 for moe in layers]  # each [n, 2]
    for li, chosen in enumerate(experts):
        for t in range(2):
            counts = torch.bincount(chosen[:, t], minlength=3)
            assert chi_square_p(counts, probabilities[li][t]) > 1e-3, (li, t, counts)
            # the test can fail: another layer's gamma for this token is rejected
            assert chi_square_p(counts, probabilities[1 - li][t]) < 1e-6
    joint = torch.bincount(experts[0][:, 0] * 3 + experts[1][:, 0], minlength=9)
    assert chi_square_p(joint, torch.outer(probabilities[0][0], probabilities[1][0]).flatten()) > 1e-3


def chi_square_p(counts: torch.Tensor, probabilities: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of ``counts`` against the distribution ``probabilities``."""
    observed = counts.double().numpy()
    expected = probabilities.double().numpy()
    return chisquare(observed, expected / expected.sum() * observed.sum()).pvalue


def test_stochastic_router_decoding_is_seeded_and_batched_equals_separate_passes():
    """K candidates in one generate equal K one-candidate calls with seeds seed + c, token for token; the same seed
    gives the same candidates; the candidates differ (the router matters), beams included."""
    moe, _, _, _ = moe_model(expert_std=1.0, router_std=2.0)
    prompts = torch.randint(3, 80, (2, 4), generator=torch.Generator().manual_seed(2))
    inputs = {"input_ids": prompts, "attention_mask": torch.ones_like(prompts)}
    settings = dict(strategy="stochastic_router", num_beams=2, max_new_tokens=6, pad_token_id=0)
    outs = generate_hypotheses(moe, None, inputs, num_sequences=3, seed=5, **settings)
    again = generate_hypotheses(moe, None, inputs, num_sequences=3, seed=5, **settings)
    assert [[c.token_ids for c in o] for o in outs] == [[c.token_ids for c in o] for o in again]
    for c in range(3):
        alone = generate_hypotheses(moe, None, inputs, num_sequences=1, seed=5 + c, **settings)
        for i in range(2):
            assert outs[i][c].token_ids == alone[i][0].token_ids, (i, c)
            assert outs[i][c].log_prob == pytest.approx(alone[i][0].log_prob, abs=1e-4)
    assert any(len({tuple(c.token_ids) for c in o}) > 1 for o in outs)
    # MLE decoding of the same model: one model, beam search (or diverse beam search) returning K sequences
    for strategy, extra in (("beam", {}), ("diverse_beam", {"diversity_penalty": 1.0})):
        mle = generate_hypotheses(moe, None, inputs, strategy=strategy, num_beams=3, num_sequences=3,
                                  max_new_tokens=6, pad_token_id=0, **extra)
        assert all(len({tuple(c.token_ids) for c in o}) == 3 for o in mle)  # K different sequences


def test_stochastic_router_needs_a_moe_model():
    mcl = get_mcl_model(build_model("llama"), MCLConfig(num_hypotheses=2, target_modules=TARGETS))
    for model in (mcl, mcl.base_model):
        with pytest.raises(ValueError, match="LoRA-MoE"):
            generate_hypotheses(model, None, {"input_ids": torch.tensor([[5, 6]])}, strategy="stochastic_router",
                                num_sequences=2)


# ---- parameter parity ----------------------------------------------------------------------------------------


def test_parameter_parity_matches_the_built_models():
    base = build_model("llama")
    parity = parameter_parity(base, num_hypotheses=3, r=4, target_modules=TARGETS, multihead_module="lm_head")

    def trainable(model):
        return model.parameter_counts()[0]

    mcl = get_mcl_model(copy.deepcopy(base), MCLConfig(num_hypotheses=3, r=4, target_modules=TARGETS))
    mle = get_mcl_model(copy.deepcopy(base), MCLConfig(num_hypotheses=1, r=parity.mle_rank, target_modules=TARGETS))
    moe = get_moe_model(copy.deepcopy(base), MoEConfig(num_experts=parity.moe_num_experts, r=parity.moe_rank,
                                                       target_modules=TARGETS))
    heads = get_multihead_model(copy.deepcopy(base), MultiHeadConfig(num_hypotheses=3))
    assert trainable(mcl) == parity.mcl == trainable(mle) == parity.mle
    assert trainable(moe) == parity.moe and moe.router_parameter_count() == parity.moe_routers > 0
    assert trainable(heads) == parity.multihead
    assert "routers" in parity.summary()


def test_moe_and_multihead_files_check_the_base_weights(tmp_path):
    """The baselines write and check the base-weights fingerprint as LoRA-MCL does (load_mcl_model and the resume
    path, load_adapters): silent on the right base, a warning on another seed's, an error with strict=True."""
    import warnings

    from loramcl.utils.inputs import BaseWeightsMismatch

    moe, pristine, _, _ = moe_model()
    torch.manual_seed(0)
    multi = get_multihead_model(copy.deepcopy(pristine), MultiHeadConfig(num_hypotheses=2, module="lm_head"))
    for name, model in (("moe", moe), ("multihead", multi)):
        model.save_pretrained(tmp_path / name)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            load_mcl_model(copy.deepcopy(pristine), tmp_path / name).load_adapters(tmp_path / name)
        torch.manual_seed(5)
        other = build_model("llama")
        with pytest.raises(ValueError, match="trained on other base weights"):
            load_mcl_model(other, tmp_path / name, strict=True)
        with pytest.warns(BaseWeightsMismatch, match="trained on other base weights"):
            loaded = load_mcl_model(other, tmp_path / name)
        with pytest.warns(BaseWeightsMismatch, match="trained on other base weights"):
            loaded.load_adapters(tmp_path / name)


def test_parameter_parity_counts_a_shared_adapter():
    """A shared adapter of rank s: LoRA-MCL trains (K*r + s) ranks' worth, matched by LoRA-MLE of rank K*r + s."""
    base = build_model("llama")
    parity = parameter_parity(base, num_hypotheses=3, r=4, target_modules=TARGETS, shared_r=2)
    mcl = get_mcl_model(copy.deepcopy(base), MCLConfig(num_hypotheses=3, r=4, shared_r=2, target_modules=TARGETS))
    mle = get_mcl_model(copy.deepcopy(base), MCLConfig(num_hypotheses=1, r=parity.mle_rank, target_modules=TARGETS))
    assert parity.mle_rank == 14 and parity.mcl == mcl.parameter_counts()[0] == mle.parameter_counts()[0] == parity.mle
    assert "LoRA-MCL  K=3 r=4 shared_r=2" in parity.summary()
