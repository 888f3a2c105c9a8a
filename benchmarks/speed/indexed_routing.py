"""One decoding step of an adapted layer under indexed routing (``use_hypotheses(index)``, what K-hypothesis
decoding uses): the adapters gathered once per index entry, for its block of consecutive rows, against the way
loramcl did it before issue 41 (the index repeated to one entry per row and the adapters gathered per row).

The K hypotheses decode one batch of B examples with ``beams`` beams each: the layer sees K*B*beams rows of one new
token, hypothesis-major, with an index of K entries. Both computations run side by side on the same layer and input
(interleaved, median of the repeats); the script first checks that they agree.

    python -m benchmarks.speed.indexed_routing                         # CPU, a few seconds
    python -m benchmarks.speed.indexed_routing --device cuda --width 4096 --batch 16 --beams 5 --dtype bfloat16
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from benchmarks.common import interleaved_medians, start
from loramcl import MCLLoraLinear
from loramcl.mcl.layers import INDEXED, HypothesisRouting


def per_row(layer: MCLLoraLinear, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The adapters' output as computed before: one gathered copy of A and B per row."""
    rows = x.shape[0]
    index = index.repeat_interleave(rows // index.numel())  # [rows]
    h = x.reshape(rows, -1, layer.in_features).to(layer.lora_A.dtype)
    a, b = layer.lora_A.index_select(0, index), layer.lora_B.index_select(0, index)  # [rows, d_in, r], [rows, r, d]
    delta = torch.bmm(torch.bmm(h, a), b).reshape(*x.shape[:-1], layer.out_features)
    return layer.base_layer(x) + (delta * layer.scaling).to(x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # the layer (width: d_in = d_out), K, the batch decoded and the timing repeats
    for name, default in (("width", 2048), ("r", 8), ("hypotheses", 5), ("batch", 8), ("beams", 2), ("repeats", 50),
                          ("threads", 0)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    start(args)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    routing = HypothesisRouting()
    layer = MCLLoraLinear(nn.Linear(args.width, args.width), routing, args.hypotheses, args.r, alpha=2 * args.r)
    layer = layer.to(args.device, dtype=dtype).eval()
    with torch.no_grad():
        layer.lora_B.normal_()
    rows = args.hypotheses * args.batch * args.beams
    x = torch.randn(rows, 1, args.width, device=args.device, dtype=dtype)  # one new token per row
    index = torch.arange(args.hypotheses, device=args.device)
    routing.mode, routing.index = INDEXED, index
    with torch.no_grad():
        torch.testing.assert_close(layer(x), per_row(layer, x, index), rtol=1e-4, atol=1e-4)
        seconds = interleaved_medians({"per entry (now)": lambda: layer(x), "per row (before)": lambda: per_row(
            layer, x, index)}, args.repeats, args.device, warmup=3)
    gathered = {"per entry (now)": args.hypotheses, "per row (before)": rows}
    fastest = min(seconds.values())
    print(f"K={args.hypotheses}, {args.batch} examples x {args.beams} beams = {rows} rows, width {args.width}, "
          f"r {args.r}, {args.dtype} on {args.device}")
    print("| adapters gathered | copies of A and B | ms per step | / fastest |\n|---|---|---|---|")
    for name, value in seconds.items():
        print(f"| {name} | {gathered[name]} | {value * 1e3:.3f} | {value / fastest:.2f} |")


if __name__ == "__main__":
    main()
