"""MCLLoraLinear under a bfloat16 input: float32 master weights, the matmuls in the activations' dtype (issue 41)."""

import pytest
import torch
from tiny_models import build_model, token_rows
from torch import nn

from loramcl import MCLConfig, get_mcl_model
from loramcl.mcl.layers import HypothesisRouting, MCLLoraLinear


def _saved_tensors(run) -> list[torch.Tensor]:
    """The tensors autograd saves for the backward pass while ``run()`` runs."""
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = run()
    return saved, output


@pytest.mark.parametrize("mode", ["stacked", "single", "indexed"])
def test_bf16_input_saves_no_float32_copy_and_trains_float32_weights(mode):
    torch.manual_seed(0)
    routing = HypothesisRouting(mode=mode, hypothesis=1, index=torch.tensor([1, 0]))
    layer = MCLLoraLinear(nn.Linear(16, 8).bfloat16().requires_grad_(False), routing, num_hypotheses=2, r=4,
                          alpha=8, adapter_dtype=torch.float32)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(4, 3, 16, dtype=torch.bfloat16, requires_grad=True)  # [K*B, T, d_in]
    saved, output = _saved_tensors(lambda: layer(x))
    inputs = [t for t in saved if t.shape[-1] == 16 and t.numel() == x.numel()]
    assert inputs and all(t.dtype == torch.bfloat16 for t in inputs)  # a float32 copy of x would be one of them
    assert output.dtype == torch.bfloat16
    output.float().square().sum().backward()
    assert layer.lora_A.dtype == layer.lora_A.grad.dtype == torch.float32
    assert layer.lora_B.grad.abs().sum() > 0
    reference = MCLLoraLinear(nn.Linear(16, 8).requires_grad_(False), routing, 2, 4, 8)  # all float32
    reference.load_state_dict({name: value.float() for name, value in layer.state_dict().items()})
    torch.testing.assert_close(output.float(), reference(x.float()), atol=0.05, rtol=0.02)  # bf16 rounding


def test_a_bf16_llama_keeps_its_adapter_inputs_in_bf16_and_trains_float32_weights():
    """The whole model: with the adapters' matmuls in bfloat16, every adapted layer's saved input is the bfloat16
    tensor the model holds anyway (a view, shared by the layers reading it), not a float32 copy of its own."""
    torch.manual_seed(0)
    mcl = get_mcl_model(build_model("llama").to(torch.bfloat16),
                        MCLConfig(num_hypotheses=2, r=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj"]))
    rows = token_rows(2, 8)
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    saved, output = _saved_tensors(lambda: mcl(**batch))
    grouped = [t for t in saved if tuple(t.shape) == (2, 2 * 8, 32)]  # q, k, v's [K, B*T, hidden] adapter inputs
    assert len(grouped) >= 3 and all(t.dtype == torch.bfloat16 for t in grouped)
    # q, k and v read one input: without dropout they save views of it, one storage per decoder layer (of 2)
    assert len({t.untyped_storage().data_ptr() for t in grouped}) == 2
    output.loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in mcl.parameters() if p.requires_grad)


@pytest.mark.parametrize("mode", ["indexed", "stacked"])
def test_routing_tensors_follow_the_layer_to_its_device(mode):
    """Under device_map="auto" each layer sits on its own device while MCLModel makes the routing's index and position
    mask once, on the input's device. transformers cannot split a model over two devices on a CPU-only machine, so
    the layer runs on the meta device with the routing tensors on the CPU: a position mask not moved to the layer's
    device raises ("Tensor on device cpu is not on the expected device meta"); a CPU index on meta adapters does not
    (index_select accepts it), so the index's move is read, not caught, here."""
    routing = HypothesisRouting(mode=mode, index=torch.tensor([1, 0]), positions=torch.ones(4, 3, 1))  # on the CPU
    with torch.device("meta"):
        layer = MCLLoraLinear(nn.Linear(16, 8), routing, num_hypotheses=2, r=4, alpha=8)
        x = torch.randn(4, 3, 16)
    output = layer(x)
    assert output.device.type == "meta" and output.shape == (4, 3, 8)


def test_gathered_adapters_sum_their_gradients_in_the_masters_dtype():
    """Indexed routing on a bfloat16 input, a hypothesis repeated over 301 index entries (two-pass WTA's winners'
    pass: each example's rows gather its winner's A and B): each entry's gradient of B is 1 here, and their sum must be
    301, as the float32 masters keep it. Cast to bfloat16 before the gather, the backward summed in bfloat16 and gave
    300 (301 is no bfloat16): what moved FSDP2's two-rank bfloat16 run off the one-process run."""
    entries = 602
    routing = HypothesisRouting(mode="indexed", index=torch.arange(entries) % 2)  # 0, 1, 0, 1, ...: gathered
    layer = MCLLoraLinear(nn.Linear(4, 2).bfloat16().requires_grad_(False), routing, num_hypotheses=2, r=1,
                          alpha=1, adapter_dtype=torch.float32)
    with torch.no_grad():
        layer.lora_A.zero_()
        layer.lora_A[:, 0, :] = 1.0  # h A = x_0 = 1 for every row
    x = torch.zeros(entries, 1, 4, dtype=torch.bfloat16)
    x[..., 0] = 1.0
    layer(x).float().sum().backward()  # d out / d B[k] = sum over k's entries of (h A) = 301
    assert layer.lora_B.grad.tolist() == [[[301.0, 301.0]], [[301.0, 301.0]]]
