"""MCLLoraLinear decoding (without gradient, the batch as copies, one per hypothesis): result + scaling * (h A) B in
one batched matmul, A read through a kept transposed copy on the CPU; the same output as the training forward, and
never a stale copy of A (issue 40). Every other forward without gradient keeps the training arithmetic bit for bit."""

import types

import pytest
import torch
from torch import nn

from loramcl.mcl.compat import UpstreamChanged, tensor_version
from loramcl.mcl.layers import HypothesisRouting, MCLLoraLinear
from loramcl.mcl.routing import set_routing

K = 3


def _layer(dtype=torch.float32, shared_r: int = 0) -> MCLLoraLinear:
    torch.manual_seed(0)
    layer = MCLLoraLinear(nn.Linear(16, 8).to(dtype).requires_grad_(False), HypothesisRouting(), num_hypotheses=K,
                          r=4, alpha=8, adapter_dtype=torch.float32, shared_r=shared_r)
    with torch.no_grad():
        layer.lora_B.normal_()
        if shared_r:  # a shared adapter (MCLConfig.shared_r) that changes every row
            layer.shared_B.normal_()
    return layer


def _each_alone(layer: MCLLoraLinear, x: torch.Tensor, hypotheses: list[int]) -> torch.Tensor:
    """Row group i through hypothesis hypotheses[i] alone (single routing), with gradient enabled."""
    groups = x.chunk(len(hypotheses))
    outputs = []
    for k, group in zip(hypotheses, groups, strict=True):
        set_routing(layer.routing, k, K, rows=None)
        outputs.append(layer(group))
    return torch.cat(outputs)


@pytest.mark.parametrize("shared_r", [0, 2])
@pytest.mark.parametrize("hypotheses", [None, [0, 1, 2], [2, 0]])
def test_the_decoding_forward_equals_each_hypothesis_alone(hypotheses, shared_r):
    """Stacked (the training arithmetic), indexed copies 0 ... K-1 (no gather) and [2, 0] (a gather of the kept
    copy), on [rows, T, d] and [rows, d] inputs, fewer and more than 16 rows per hypothesis (two ways of h A); with a
    shared adapter too (one un-gathered matmul on every row)."""
    layer = _layer(shared_r=shared_r)
    for shape in [(6, 5, 16), (6, 9, 16), (6, 16)]:
        x = torch.randn(*shape[:-1], 16)
        order = list(range(K)) if hypotheses is None else hypotheses
        x = x[: len(order) * 2]
        expected = _each_alone(layer, x, order)
        set_routing(layer.routing, None if hypotheses is None else torch.tensor(hypotheses), K, rows=None,
                    copies=True)
        assert layer.routing.ordered == (hypotheses == [0, 1, 2])
        with torch.no_grad():
            decoded = layer(x)
        assert torch.allclose(decoded, expected, atol=1e-6)


@pytest.mark.parametrize("hypotheses", [None, [2, 0, 1, 1, 0, 2]])
def test_other_forwards_without_gradient_keep_the_training_arithmetic_bit_for_bit(hypotheses):
    """Two-pass WTA's scoring pass (stacked) and evaluation (one hypothesis per example) give the forward with
    gradient's outputs exactly, so the scoring pass picks the winners the backward pass trains (and `loramcl markov`
    keeps its numbers): only decoding's copies take the fast path."""
    layer = _layer()
    x = torch.randn(6, 5, 16)
    set_routing(layer.routing, None if hypotheses is None else torch.tensor(hypotheses), K, rows=6)
    with torch.no_grad():
        scored = layer(x)
    assert torch.equal(scored, layer(x)) and not any(transposed for *_, transposed in layer._kept_copies)


def test_the_kept_transposed_a_follows_every_change_of_a():
    """An optimizer step (in place), a copy_ under no_grad, a new Parameter and new .data all reach the next
    decoding forward."""
    layer = _layer()
    x = torch.randn(6, 16)
    set_routing(layer.routing, torch.tensor([0, 1, 2]), K, rows=None, copies=True)

    def decoded_equals_training_forward():
        with torch.no_grad():
            decoded = layer(x)
        return torch.allclose(decoded, layer(x), atol=1e-6)

    assert decoded_equals_training_forward()
    kept = layer._kept_copies["lora_A", torch.float32, True][3]
    optimizer = torch.optim.SGD([layer.lora_A], lr=1.0)
    layer(x).square().sum().backward()
    optimizer.step()
    assert decoded_equals_training_forward()
    assert layer._kept_copies["lora_A", torch.float32, True][3] is not kept
    with torch.no_grad():
        layer.lora_A.copy_(torch.randn_like(layer.lora_A))
    assert decoded_equals_training_forward()
    layer.lora_A = nn.Parameter(torch.randn_like(layer.lora_A))
    assert decoded_equals_training_forward()
    layer.lora_A.data = torch.randn_like(layer.lora_A)
    assert decoded_equals_training_forward()


def test_the_cast_once_copies_follow_the_weights_and_are_not_used_under_grad():
    """bfloat16 activations on float32 masters: without gradient A and B are cast once and kept (a second forward
    casts nothing), an optimizer step reaches the next forward, and a forward with gradient casts through autograd
    (its gradient reaches the masters) and keeps nothing."""
    layer = _layer(torch.bfloat16)
    x = torch.randn(6, 16, dtype=torch.bfloat16)
    set_routing(layer.routing, torch.tensor([0, 1, 2]), K, rows=None, copies=True)
    trained = layer(x)  # with gradient
    assert layer._kept_copies == {}
    trained.float().square().sum().backward()
    assert layer.lora_A.grad is not None and layer.lora_B.grad.dtype == torch.float32
    with torch.no_grad():
        first = layer(x)
        kept = {key: value[3] for key, value in layer._kept_copies.items()}
        assert {(name, dtype) for name, dtype, _ in kept} == {("lora_A", torch.bfloat16), ("lora_B", torch.bfloat16)}
        assert torch.equal(layer(x), first)
        assert all(layer._kept_copies[key][3] is copy for key, copy in kept.items())  # nothing cast again
    torch.optim.SGD([layer.lora_A, layer.lora_B], lr=1.0).step()
    with torch.no_grad():
        stepped = layer(x)
    assert all(layer._kept_copies[key][3] is not copy for key, copy in kept.items())
    layer._kept_copies.clear()
    with torch.no_grad():
        assert torch.equal(stepped, layer(x)) and not torch.equal(stepped, first)  # as freshly cast copies give


def test_a_bf16_decoding_forward_keeps_its_dtype_and_matches_the_training_forward():
    layer = _layer(torch.bfloat16)
    x = torch.randn(6, 5, 16, dtype=torch.bfloat16)
    set_routing(layer.routing, torch.tensor([0, 1, 2]), K, rows=None, copies=True)
    expected = layer(x)
    with torch.no_grad():
        decoded = layer(x)
    assert decoded.dtype == torch.bfloat16
    assert torch.allclose(decoded.float(), expected.float(), atol=3e-2, rtol=2e-2), (decoded - expected).abs().max()


def test_a_hook_on_the_base_layer_keeps_the_base_output_it_was_handed():
    """The adapters' term is added into a new tensor, never into the base layer's output: what a hook of the base
    layer was handed stays the base output."""
    layer = _layer()
    x = torch.randn(6, 4, 16)
    set_routing(layer.routing, torch.tensor([0, 1, 2]), K, rows=None, copies=True)
    handed = []
    layer.base_layer.register_forward_hook(lambda module, args, output: handed.append(output))
    with torch.no_grad():
        decoded = layer(x)
        base = layer.base_layer.forward(x)
    assert torch.equal(handed[0], base) and not torch.allclose(decoded, base)
    assert torch.allclose(decoded, layer(x), atol=1e-6)


def test_a_torch_without_the_in_place_counter_is_refused_naming_it():
    """The kept copy of A is checked against torch's in-place counter: where it is gone, decoding stops with the
    package and what moved, never reuses a stale copy."""
    with pytest.raises(UpstreamChanged, match=r"^torch .*Tensor\._version"):
        tensor_version(types.SimpleNamespace())
