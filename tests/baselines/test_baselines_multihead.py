"""Multi-head MCL (paper App. H.1): K copies of one module equal K separate models, train through MCLTrainer (only the
copies change), decode through generate_hypotheses, and behave on a two-mode task as the paper says."""

import copy

import pytest
import torch
from tiny_models import build_batch, build_model
from torch import nn
from transformers import TrainingArguments

from loramcl import MCLTrainer, load_mcl_model
from loramcl.baselines import HypothesisHeads, MultiHeadConfig, get_multihead_model
from loramcl.decoding import generate_hypotheses

K = 3
PROJECTOR = "model.multi_modal_projector"
CASES = [("llama", "lm_head"), ("gpt2", "lm_head"), ("t5", "lm_head"), ("llava_next", PROJECTOR),
         ("qwen2_audio", PROJECTOR)]


def multihead(name, module, init="random", num_hypotheses=K, **config):
    """(multi-head model, pristine base, inputs, labels)."""
    torch.manual_seed(0)
    base = build_model(name).eval()
    pristine = copy.deepcopy(base)
    model = get_multihead_model(base, MultiHeadConfig(num_hypotheses=num_hypotheses, module=module, init=init,
                                                      **config)).eval()
    inputs, labels = build_batch(name, pristine)
    return model, pristine, inputs, labels


def separate_model(pristine, module: str, parameters: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of the base model whose ``module`` is its own (untied) module holding ``parameters``."""
    model = copy.deepcopy(pristine)
    own = copy.deepcopy(pristine.get_submodule(module))  # a deep copy of the module alone unties a tied LM head
    with torch.no_grad():
        for name, param in own.named_parameters():
            param.copy_(parameters[name])
    model.set_submodule(module, own)
    return model.eval()


def separate_models(model, pristine, module):
    heads = model.base_model.get_submodule(module)
    return [separate_model(pristine, module, {n: p[k] for n, p in heads.heads.named_parameters()})
            for k in range(model.num_hypotheses)]


def reference_nll(model, inputs, labels) -> torch.Tensor:
    """Mean NLL over the label tokens of each example under a plain transformers model: [B]."""
    logits = model(**inputs, labels=labels).logits.float()  # [B, T, V]
    if not model.config.is_encoder_decoder:  # position t predicts token t + 1
        logits, labels = logits[:, :-1], labels[:, 1:]
    mask = labels != -100
    token_nll = nn.functional.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none")
    return (token_nll * mask).sum(1) / mask.sum(1)


# ---- the K copies ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,module", CASES)
def test_heads_equal_separate_models_each_with_its_own_module(name, module):
    """nll [B, K], logits [B, K, T, V] and one hypothesis per example equal K separate models (forward and the
    per-example routing of two-pass WTA), for the LM head (tied for GPT-2) and the multimodal projectors."""
    model, pristine, inputs, labels = multihead(name, module)
    references = separate_models(model, pristine, module)
    with torch.no_grad():
        nll = model(**inputs, labels=labels).nll  # [B, K]
        expected = torch.stack([reference_nll(ref, inputs, labels) for ref in references], dim=1)
        assert (nll - expected).abs().max() < 1e-5
        assert (expected[:, 0] - expected[:, 1]).abs().max() > 1e-3  # the random copies differ
        winners = torch.tensor([2, 0][:labels.shape[0]])
        assert torch.allclose(model(**inputs, labels=labels, hypotheses=winners).nll,
                              expected.gather(1, winners[:, None]).squeeze(1), atol=1e-5)
        if name != "t5":  # without labels: all logits of all K
            logits = model(**inputs).logits  # [B, K, T, V]
            for k, ref in enumerate(references):
                assert (logits[:, k] - ref(**inputs).logits).abs().max() < 1e-5


def test_lm_head_sees_label_positions_only_and_the_network_before_it_runs_once():
    model, _, inputs, labels = multihead("llama", "lm_head")
    rows = {}

    def record(key, tensor):
        rows[key] = tensor.shape  # returns None: the hook changes nothing

    hooks = [model.base_model.lm_head.register_forward_pre_hook(lambda m, a: record("head", a[0])),
             model.base_model.model.register_forward_pre_hook(lambda m, a, kw: record("body", kw["input_ids"]),
                                                              with_kwargs=True)]
    with torch.no_grad():
        model(**inputs, labels=labels)
    for hook in hooks:
        hook.remove()
    labelled = int((labels[:, 1:] != -100).sum())
    assert rows["head"] == (K * labelled, 32)  # [K * N_labels, d]: no [K, B, T, V] logits
    assert rows["body"][0] == labels.shape[0]  # B rows before the heads


def test_copy_init_gives_identical_heads_and_random_init_does_not():
    model, pristine, _, _ = multihead("llava_next", PROJECTOR, init="copy")
    original = dict(pristine.get_submodule(PROJECTOR).named_parameters())
    for name, stacked in model.base_model.get_submodule(PROJECTOR).heads.named_parameters():
        assert all(torch.equal(stacked[k], original[name]) for k in range(K))
    model, _, _, _ = multihead("llava_next", PROJECTOR, init="random")
    for name, stacked in model.base_model.get_submodule(PROJECTOR).heads.named_parameters():
        if name.endswith("weight"):
            assert not any(torch.equal(stacked[k], original[name]) for k in range(K))
            assert not torch.equal(stacked[0], stacked[1])


# ---- training ----------------------------------------------------------------------------------------------


def _args(tmp_path, steps=1, batch=2, learning_rate=1e-2):
    return TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=batch, max_steps=steps,
                             learning_rate=learning_rate, weight_decay=0.0, report_to=[], use_cpu=True,
                             save_strategy="no", logging_steps=10, disable_tqdm=True, seed=0, data_seed=0,
                             lr_scheduler_type="constant")


@pytest.mark.parametrize("name,module", [("llama", "lm_head"), ("qwen2_audio", PROJECTOR)])
def test_one_step_changes_only_the_copies_and_two_pass_equals_one_pass(tmp_path, name, module):
    model, _, inputs, labels = multihead(name, module, loss="relaxed", epsilon=0.1)
    rows = [{**{k: v[i] for k, v in inputs.items()}, "labels": labels[i]} for i in range(labels.shape[0])]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    MCLTrainer(model.train(), args=_args(tmp_path), train_dataset=rows).train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {f"base_model.{module}.heads.{n}" for n, _ in model.heads().heads.named_parameters()}

    wta, _, _, _ = multihead(name, module, loss="wta")
    gradients = {}
    for two_pass in (True, False):
        wta.zero_grad()
        trainer = MCLTrainer(wta.train(), args=_args(tmp_path), two_pass_wta=two_pass)
        trainer.compute_loss(wta, {**inputs, "labels": labels}).backward()
        gradients[two_pass] = torch.cat([p.grad.flatten() for p in wta.parameters() if p.requires_grad])
    assert gradients[False].abs().sum() > 0
    assert torch.allclose(gradients[True], gradients[False], atol=1e-6)


def _two_modes(n, seed):
    """One prompt, two equally likely answers (token 10 or 11): an ambiguous task with two modes."""
    g = torch.Generator().manual_seed(seed)
    answers = torch.where(torch.rand(n, generator=g) < 0.5, 10, 11)
    ids = torch.cat([torch.tensor([3, 4, 5, 6, 7]).repeat(n, 1), answers[:, None]], dim=1)  # [n, 6]
    labels = ids.clone()
    labels[:, :5] = -100
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": y}
            for i, y in zip(ids, labels, strict=True)]


@pytest.mark.parametrize("loss,specialises", [("relaxed", True), ("wta", False)])
def test_copy_init_on_a_two_mode_task(tmp_path, loss, specialises):
    """Copy init starts with K identical heads. Relaxed WTA breaks the tie and the two heads take one mode each;
    vanilla WTA gives every tie to head 0, so head 1 never trains and never wins (the collapse of App. H.1)."""
    model, _, _, _ = multihead("llama", "lm_head", init="copy", num_hypotheses=2, loss=loss,
                               epsilon=0.1 if loss == "relaxed" else 0.0)
    stacked = model.heads().heads.weight
    assert torch.equal(stacked[0], stacked[1])
    MCLTrainer(model.train(), args=_args(tmp_path, steps=30, batch=16, learning_rate=5e-2),
               train_dataset=_two_modes(480, 0)).train()
    test = _two_modes(200, 1)
    batch = {key: torch.stack([row[key] for row in test]) for key in test[0]}
    with torch.no_grad():
        winners = model.eval()(**batch).nll.argmin(dim=1)  # [N]
    mode = batch["labels"][:, 5] == 11
    if specialises:
        assert winners[~mode].float().mean() < 0.1 or winners[~mode].float().mean() > 0.9
        assert (winners[mode] != winners[~mode][0]).all() and (winners[~mode] == winners[~mode][0]).all()
    else:
        assert (winners == 0).all() and torch.equal(stacked[1], model.heads().heads.weight[1])


# ---- decoding, files, errors -------------------------------------------------------------------------------


def _generated(model, output, inputs) -> list[list[int]]:
    start = 1 if model.config.is_encoder_decoder else inputs["input_ids"].shape[1]
    return output[:, start:].tolist()


@pytest.mark.parametrize("name,module", [("llama", "lm_head"), ("llava_next", PROJECTOR), ("qwen2_audio", PROJECTOR)])
@pytest.mark.parametrize("strategy,num_beams", [("greedy", 1), ("beam", 2)])
def test_decoding_all_heads_in_one_generate_equals_each_separate_model(name, module, strategy, num_beams):
    """LLaVA-NeXT's two images have different patch counts: the projector's rows are not split per example."""
    model, pristine, inputs, _ = multihead(name, module)
    if name == "llama":
        inputs = {"input_ids": inputs["input_ids"][:, :4], "attention_mask": inputs["attention_mask"][:, :4]}
    settings = dict(max_new_tokens=5, min_new_tokens=5, pad_token_id=0)
    outs = generate_hypotheses(model, None, inputs, strategy=strategy, num_beams=num_beams, **settings)
    for k, ref in enumerate(separate_models(model, pristine, module)):
        with torch.no_grad():
            alone = _generated(ref, ref.generate(**inputs, num_beams=num_beams, do_sample=False, **settings), inputs)
        assert [o[k].token_ids for o in outs] == alone, k
    assert any(len({tuple(c.token_ids) for c in o}) > 1 for o in outs)


def test_save_and_load_keep_the_copies_and_the_config(tmp_path):
    model, pristine, inputs, labels = multihead("llama", "lm_head", loss="relaxed", epsilon=0.1)
    model.save_pretrained(tmp_path)
    loaded = load_mcl_model(pristine, tmp_path)
    assert loaded.multihead_config == model.multihead_config  # init stays 'random'
    assert isinstance(loaded.heads(), HypothesisHeads)
    with torch.no_grad():
        assert torch.equal(loaded(**inputs, labels=labels).nll, model(**inputs, labels=labels).nll)
    with pytest.raises(ValueError, match="module_for"):
        model.merge_hypothesis(0)
    with pytest.raises(ValueError, match="not LoRA adapters"):
        model.export_hypothesis(0, tmp_path / "peft")
    standalone = model.heads().module_for(1)
    assert torch.equal(standalone.weight, model.heads().heads.weight[1]) and isinstance(standalone, nn.Linear)


def test_config_and_module_errors():
    with pytest.raises(ValueError, match="init"):
        MultiHeadConfig(init="zeros")
    with pytest.raises(ValueError, match="epsilon"):
        MultiHeadConfig(num_hypotheses=2, loss="relaxed", epsilon=0.9)
    with pytest.raises(ValueError, match="num_hypotheses"):
        MultiHeadConfig(num_hypotheses=0)
    with pytest.raises(ValueError, match="no module 'multi_modal_projector'.*model.multi_modal_projector"):
        get_multihead_model(build_model("llava_next"), MultiHeadConfig(module="multi_modal_projector"))
    with pytest.raises(ValueError, match="has no parameters"):
        get_multihead_model(build_model("llama"), MultiHeadConfig(module="model.layers.0.mlp.act_fn"))


def test_copies_train_in_float32_on_a_half_precision_model(tmp_path):
    """dtype='float32' (default): bfloat16/float16 bases get float32 copies and outputs in the input's dtype;
    dtype='base' keeps float16 copies, which MCLTrainer refuses (Adam's moments underflow in float16)."""
    base = build_model("llama").to(torch.bfloat16)
    inputs, labels = build_batch("llama", base)
    model = get_multihead_model(base, MultiHeadConfig())
    assert model.heads().heads.weight.dtype == torch.float32
    assert model(**inputs).logits.dtype == torch.bfloat16 and torch.isfinite(model(**inputs, labels=labels).loss)
    half = get_multihead_model(build_model("llama").to(torch.float16), MultiHeadConfig(dtype="base"))
    with pytest.raises(ValueError, match="float16"):
        MCLTrainer(half, args=_args(tmp_path))
