"""MCLLoraLinear against a hand-written LoRA, per-example NLL against cross-entropy, config validation."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from loramcl import DataConfig, MCLConfig, MCLLoraLinear, TrainConfig
from loramcl.mcl.layers import HypothesisRouting
from loramcl.mcl.nll import aligned_targets, sequence_nll

K, B, T, D_IN, D_OUT, R = 3, 2, 5, 12, 7, 4


def _layer(base=None, dropout=0.0):
    base = base or nn.Linear(D_IN, D_OUT)
    layer = MCLLoraLinear(base, HypothesisRouting(), K, R, alpha=8, dropout=dropout)
    with torch.no_grad():
        layer.lora_B.normal_()
    return layer


def _lora(layer, x, k):  # one LoRA adapter, written out: W x + b + alpha/r * (x A_k) B_k
    return layer.base_layer(x) + (x @ layer.lora_A[k] @ layer.lora_B[k]) * (8 / R)


def test_stacked_rows_are_hypothesis_major_and_each_uses_its_adapter():
    layer = _layer()
    x = torch.randn(K * B, T, D_IN)
    out = layer(x)  # [K*B, T, D_OUT]
    for k in range(K):
        rows = slice(k * B, (k + 1) * B)
        torch.testing.assert_close(out[rows], _lora(layer, x[rows], k))


def test_single_and_indexed_routing():
    layer = _layer()
    x = torch.randn(4, T, D_IN)
    layer.routing.mode, layer.routing.hypothesis = "single", 2
    torch.testing.assert_close(layer(x), _lora(layer, x, 2))
    index = torch.tensor([1, 0, 2, 1])
    layer.routing.mode, layer.routing.index = "indexed", index
    out = layer(x)
    flat = layer(x.reshape(4 * T, D_IN)).reshape(4, T, D_OUT)  # rows of [B*T, d]: T consecutive rows per index
    for b, k in enumerate(index.tolist()):
        torch.testing.assert_close(out[b], _lora(layer, x[b], k))
        torch.testing.assert_close(flat[b], out[b])
    with pytest.raises(RuntimeError, match="cannot be split"):
        layer(torch.randn(5, D_IN))


def test_indexed_routing_gives_each_entry_a_block_of_consecutive_rows():
    """n index entries over n*m rows (e.g. m beams per example): entry i routes rows i*m ... (i+1)*m - 1, on a
    [rows, T, d] input and on the same rows flattened to [rows*T, d]."""
    layer = _layer()
    index, m = torch.tensor([2, 0, 2]), 3
    x = torch.randn(len(index) * m, T, D_IN)
    layer.routing.mode, layer.routing.index = "indexed", index
    out = layer(x)
    flat = layer(x.reshape(-1, D_IN)).reshape(out.shape)
    for i, k in enumerate(index.tolist()):
        rows = slice(i * m, (i + 1) * m)
        torch.testing.assert_close(out[rows], _lora(layer, x[rows], k))
        torch.testing.assert_close(flat[rows], out[rows])


def test_conv1d_base_layer():
    conv = Conv1D(D_OUT, D_IN)  # GPT-2 layout: weight [d_in, d_out]
    layer = _layer(conv)
    x = torch.randn(K * B, T, D_IN)
    for k in range(K):
        torch.testing.assert_close(layer(x)[k * B:(k + 1) * B], _lora(layer, x[k * B:(k + 1) * B], k))


@pytest.mark.parametrize("base", [nn.Linear(D_IN, D_OUT), Conv1D(D_OUT, D_IN)])
def test_delta_weight_merges_into_the_base_layer(base):
    layer = _layer(base)
    x = torch.randn(B, D_IN)
    expected = _lora(layer, x, 1).detach()
    with torch.no_grad():
        layer.base_layer.weight.add_(layer.delta_weight(1))
    torch.testing.assert_close(layer.base_layer(x), expected, atol=1e-5, rtol=0)


def test_init_matches_peft_lora():
    layer = MCLLoraLinear(nn.Linear(256, 8), HypothesisRouting(), K, 16, alpha=16)
    bound = 1 / math.sqrt(256)  # kaiming_uniform(a=sqrt(5)) on a [r, d_in] weight
    assert layer.lora_A.abs().max() <= bound and layer.lora_A.abs().max() > 0.95 * bound
    assert torch.all(layer.lora_B == 0)
    assert not torch.allclose(layer.lora_A[0], layer.lora_A[1])  # each hypothesis draws its own A


def test_dropout_only_in_training():
    """Eval: exactly the LoRA of the undropped input. Training: the LoRA of the input with dropout's mask, the same
    mask torch draws from the same seed (entries zeroed, the rest scaled by 1/(1-p)), on the adapter input only."""
    layer = _layer(dropout=0.5)
    x = torch.randn(K * B, T, D_IN)
    expected = torch.cat([_lora(layer, x[k * B:(k + 1) * B], k) for k in range(K)])
    layer.eval()
    torch.testing.assert_close(layer(x), expected)  # fails if dropout ran in eval
    layer.train()
    torch.manual_seed(3)
    trained = layer(x)
    torch.manual_seed(3)
    dropped = F.dropout(x, p=0.5, training=True)
    assert (dropped == 0).any() and not torch.equal(dropped, x)
    with torch.no_grad():
        delta = torch.cat([dropped[k * B:(k + 1) * B] @ layer.lora_A[k] @ layer.lora_B[k] for k in range(K)])
    torch.testing.assert_close(trained, layer.base_layer(x) + delta * (8 / R))  # fails if it did not run
    assert not torch.allclose(trained, expected)


def test_sequence_nll_is_the_mean_cross_entropy_of_each_example():
    logits = torch.randn(2, 6, 11)
    labels = torch.randint(0, 11, (2, 6))
    labels[0, :2] = -100
    labels[1, 4:] = -100
    nll = sequence_nll(logits, labels, causal=True)
    for b in range(2):
        keep = labels[b, 1:] != -100
        expected = F.cross_entropy(logits[b, :-1][keep], labels[b, 1:][keep])
        torch.testing.assert_close(nll[b], expected)
    seq2seq = sequence_nll(logits, labels, causal=False)
    torch.testing.assert_close(seq2seq[1], F.cross_entropy(logits[1, :4], labels[1, :4]))
    assert aligned_targets(labels, causal=True)[0, -1] == -100


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_hypotheses=0), "num_hypotheses must be an integer >= 1"),
    (dict(r=0), "r .LoRA rank. must be an integer >= 1"),
    (dict(alpha=0), r"alpha must be a finite number in \(0, inf\)"),
    (dict(alpha=float("inf")), r"alpha must be a finite number in \(0, inf\).*got inf"),
    (dict(alpha=float("nan")), "alpha must be a finite number.*got nan"),
    (dict(alpha="8"), "alpha must be a finite number.*got '8'"),
    (dict(num_hypotheses=True), "num_hypotheses must be an integer >= 1, got True"),  # not taken as K = 1
    (dict(r=True), r"r \(LoRA rank\) must be an integer >= 1, got True"),
    (dict(dropout=1.0), r"dropout must be a finite number in \[0, 1\)"),
    (dict(loss="hard"), "loss must be one of"),
    (dict(loss="relaxed", epsilon=0.6, num_hypotheses=2), r"epsilon must be in \[0, \(K-1\)/K\] = \[0, 1/2\]"),
    # the largest accepted value is printed in full, so the message never shows a bound that is itself rejected
    (dict(loss="relaxed", epsilon=0.6667, num_hypotheses=3), r"\[0, 2/3\] for K=3 \(at most 0.6666666666666666\)"),
    (dict(loss="relaxed", epsilon=0.05, num_hypotheses=1), "With one hypothesis"),
    (dict(epsilon=-0.1), r"epsilon must be a finite number in \[0, inf\)"),
    (dict(epsilon=float("nan")), "epsilon must be a finite number.*got nan"),
    (dict(temperature0=0), r"temperature0 must be a finite number in \(0, inf\)"),
    (dict(temperature0=float("inf")), "temperature0 must be a finite number.*got inf"),
    (dict(temperature_decay=1.5), r"temperature_decay must be a finite number in \(0, 1\]"),
    (dict(temperature_min=-1), r"temperature_min must be a finite number in \[0, inf\)"),
    (dict(target_modules=[]), "target_modules must be"),
    (dict(adapter_dtype="fp8"), "adapter_dtype must be one of"),
    (dict(layers_to_transform=[-1]), "layers_to_transform must be"),
    (dict(layers_to_transform=True), "layers_to_transform must be"),
    (dict(layers_pattern="layers"), "set layers_to_transform too"),
    (dict(target_modules=r".*q_proj", layers_to_transform=[0]), "regular expression"),
    (dict(exclude_modules=[]), "exclude_modules must be"),
    (dict(use_rslora="yes"), "use_rslora must be True or False"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MCLConfig(**kwargs)


def test_config_round_trip_and_unknown_fields():
    config = MCLConfig(num_hypotheses=5, r=8, alpha=32, loss="relaxed", epsilon=0.05, target_modules=("v", "q"))
    assert config.target_modules == ["q", "v"] and config.scaling == 4.0
    assert MCLConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"unknown MCLConfig fields \['rank'\]"):
        MCLConfig.from_dict({"rank": 4})


@pytest.mark.parametrize("make, message", [
    (lambda: TrainConfig(steps=0), "steps must be an integer >= 1, got 0"),
    (lambda: TrainConfig(batch_size=True), "batch_size must be an integer >= 1, got True"),
    (lambda: TrainConfig(learning_rate=float("nan")), "learning_rate must be a finite number"),
    (lambda: TrainConfig(save_every=-1), "save_every must be an integer >= 0"),
    (lambda: TrainConfig(keep_checkpoints=0), "keep_checkpoints must be an integer >= 1"),
    (lambda: DataConfig(train_file=""), "train_file must be a non-empty string"),
    (lambda: DataConfig(train_file="a.jsonl", max_length=1), "max_length must be an integer >= 2"),
    (lambda: DataConfig(train_file="a.jsonl", chat_template="yes"), "chat_template must be true or false"),
])
def test_run_settings_validation(make, message):
    with pytest.raises(ValueError, match=message):
        make()
