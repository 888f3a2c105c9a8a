"""Kernels a decoding step adds per adapted layer (issue 54): on a GPU eager decoding is host-bound, so each kernel
an adapted layer launches beyond its base layer's costs time. The aten calls that compute (views and metadata left
out) are counted with a TorchDispatchMode over generate_hypotheses on a bfloat16 base with float32 masters, with the
adapters on and off; docs/benchmarks.md lists the numbers (3.4 before the cast-once copies, 2 after: one ``bmm``,
one ``baddbmm``)."""

import collections
import copy

import torch
from conftest import randomize_adapters
from tiny_models import build_model
from torch.utils._python_dispatch import TorchDispatchMode

from loramcl import MCLConfig, get_mcl_model

# aten calls that move no data, though their schemas do not say they alias
NOT_COMPUTE = {torch.ops.aten._unsafe_view.default, torch.ops.aten.lift_fresh.default}


class ComputeCalls(TorchDispatchMode):
    """Counts the aten calls that compute (``counts``, by name): views, metadata and allocations left out."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func not in NOT_COMPUTE and torch.Tag.nondeterministic_seeded not in func.tags and (
                func.name().split("::")[-1].split(".")[0] not in ("empty", "empty_like", "empty_strided")):
            self.counts[func.name()] += 1
        return func(*args, **(kwargs or {}))


def compute_calls(generate, new_tokens: int) -> collections.Counter:
    calls = ComputeCalls()
    with torch.no_grad(), calls:
        generate(max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=7, pad_token_id=0)
    return calls.counts


def calls_per_layer_and_step(mcl, base, inputs: dict) -> tuple[float, collections.Counter]:
    """(compute calls per adapted layer per decoding step beyond the base layer's, those calls by name): ``mcl``'s K
    hypotheses decoding ``inputs`` in one generate (as generate_hypotheses runs them) against ``base`` (the bare base
    model) decoding the same K copies; the difference between 6 and 2 new tokens (the prefill and the call's own
    work cancel)."""
    k = mcl.num_hypotheses
    copies = {name: value.repeat(k, 1) for name, value in inputs.items()}  # [K*B, T], hypothesis-major

    def decode(**options):
        with mcl.use_hypotheses(torch.arange(k), copies=True):
            return mcl.generate(**copies, **options)

    def per_step(generate) -> collections.Counter:
        compute_calls(generate, 2)  # a warm-up: the kept copies are made at the first call
        return compute_calls(generate, 6) - compute_calls(generate, 2)

    extra = per_step(decode)
    extra.subtract(per_step(lambda **options: base.generate(**copies, **options)))
    return sum(extra.values()) / (len(list(mcl.mcl_layers())) * 4), +extra  # 4 decoding steps


def test_a_decoding_step_adds_at_most_two_kernels_per_adapted_layer():
    """bfloat16 base, float32 masters, K = 3, greedy: the adapters' term is one bmm and one baddbmm per layer and
    step; the masters' casts are made once (``MCLLoraLinear._kept``), not at every step."""
    torch.manual_seed(0)
    base = build_model("llama").to(torch.bfloat16).eval()
    mcl = get_mcl_model(copy.deepcopy(base), MCLConfig(
        num_hypotheses=3, r=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])).eval()
    randomize_adapters(mcl)
    assert mcl.mcl_layers() and all(layer.lora_A.dtype == torch.float32 for _, layer in mcl.mcl_layers())
    prompts = torch.randint(3, 80, (2, 5), generator=torch.Generator().manual_seed(0))
    per_layer, extra = calls_per_layer_and_step(mcl, base, {"input_ids": prompts, "attention_mask": torch.ones_like(prompts)})
    print(f"compute calls per adapted layer per decoding step: {per_layer:.2f} {dict(extra)}")
    assert per_layer <= 2, (per_layer, extra)
    assert not any("_to_copy" in name for name in extra), extra
