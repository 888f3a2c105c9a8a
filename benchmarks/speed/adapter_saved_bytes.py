"""Bytes autograd saves per token for the backward pass of a bf16 Llama with float32 adapters: the adapters' matmuls
in the activations' dtype (now) against the input cast to the adapters' float32 first (before issue 41), which
saved a float32 copy of every adapted layer's input (q, k and v: three copies of one input).

Both run side by side on the same model and batch; every saved storage counted once (views share it), parameters
left out.

    python -m benchmarks.speed.adapter_saved_bytes                   # CPU, seconds
    python -m benchmarks.speed.adapter_saved_bytes --hidden 1024 --layers 4 --tokens 256
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

import torch

from benchmarks.common import TARGETS, small_llama_config, start
from benchmarks.studies.memory_plan import saved_bytes
from loramcl import MCLConfig, MCLLoraLinear, get_mcl_model


@contextmanager
def float32_adapter_inputs():
    """MCLLoraLinear.forward as it was before: the input cast to the adapters' dtype, the output cast back."""
    forward = MCLLoraLinear.forward

    def upcast(self, x, *args, **kwargs):
        result = self.base_layer(x, *args, **kwargs)
        delta = self._adapter_delta(self.dropout(x).to(self.lora_A.dtype))
        return result + (delta * self.scaling).to(result.dtype)

    MCLLoraLinear.forward = upcast
    try:
        yield
    finally:
        MCLLoraLinear.forward = forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("hidden", 576), ("layers", 2), ("tokens", 64), ("batch", 2), ("hypotheses", 3),
                          ("threads", 0)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    start(args)
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = small_llama_config(args.layers, args.hidden, 1024, args.tokens)
    config._attn_implementation = "sdpa"
    base = LlamaForCausalLM(config).to(torch.bfloat16)
    mcl = get_mcl_model(base, MCLConfig(num_hypotheses=args.hypotheses, r=8, alpha=16, loss="relaxed", epsilon=0.1,
                                        target_modules=TARGETS)).train()
    ids = torch.randint(3, 1000, (args.batch, args.tokens))
    labels = ids.clone()
    labels[:, : args.tokens // 2] = -100
    tokens = args.hypotheses * args.batch * args.tokens  # the K copies' tokens

    def step():
        mcl(input_ids=ids, labels=labels).loss.backward()

    with float32_adapter_inputs():
        before = saved_bytes(mcl, step)
    now = saved_bytes(mcl, step)
    print(f"Llama hidden {args.hidden}, {args.layers} layers, bf16, float32 adapters on {', '.join(TARGETS)} (K = "
          f"{args.hypotheses}, r = 8), {args.batch} x {args.tokens} tokens, relaxed WTA (all K copies with gradient)")
    print("| adapters' matmuls | saved bytes per token | per token and layer | / now |\n|---|---|---|---|")
    for name, value in (("float32 (the input cast up, before)", before), ("bf16, the activations' dtype (now)", now)):
        print(f"| {name} | {value / tokens:,.0f} | {value / tokens / args.layers:,.0f} | {value / now:.2f} |")


if __name__ == "__main__":
    main()
