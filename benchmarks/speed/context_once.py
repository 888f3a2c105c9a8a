"""Speed-up of the context computed once (MCLConfig(adapt_context=False)) as the context grows, as ratios to the
K=1 step measured in the same run.

For each context length (the prompt, no labels) followed by a target of --target tokens, and K in {1, 3, 5}:
  full   adapt_context=True, the paper's method: all K hypotheses over the whole sequence (K*B rows)
  once   adapt_context=False: the context once on B rows without adapters (kept as a KV cache, no gradient), the
         target positions on K*B rows attending to it
  masked adapt_context=False computed naively (the full K*B forward with the adapters masked on the context): the
         same model as `once`, at the cost of `full` (shown with --masked)
Every step is forward + backward + AdamW of the relaxed loss (epsilon=0.05), so every hypothesis gets a gradient.
Before timing, `once` is checked to give the NLLs of `masked` (float32).

    python -m benchmarks.speed.context_once                          # CPU, small Llama (a few minutes)
    python -m benchmarks.speed.context_once --device cuda --layers 8 --hidden 1024 --contexts 256 1024 2048
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import (
    TARGETS,
    build_model,
    interleaved_medians,
    perturb_adapters,
    small_llama_arguments,
    small_llama_config,
    start,
    train_step,
)
from loramcl import MCLConfig, get_mcl_model


def build(args, context: int, variant: str, k: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    length = context + args.target
    config = small_llama_config(args.layers, args.hidden, args.vocab, length)
    base = build_model(LlamaForCausalLM, config, args.device, getattr(torch, args.dtype))
    mcl = get_mcl_model(base, MCLConfig(num_hypotheses=k, r=8, alpha=8, loss="relaxed", epsilon=0.05 if k > 1 else 0.0,
                                        adapt_context=variant == "full", target_modules=TARGETS))
    mcl.context_once = variant == "once"
    perturb_adapters(mcl)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, length), generator=g).to(args.device)
    labels = ids.clone()
    labels[:, :context] = -100  # the context: the last context token's output predicts the first target token
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    optimizer = torch.optim.AdamW([p for p in mcl.parameters() if p.requires_grad], lr=1e-4)
    return mcl.train(), batch, optimizer


def check_once_matches_masked(args, context: int) -> None:
    once, batch, _ = build(args, context, "once", 3)
    masked, _, _ = build(args, context, "masked", 3)
    with torch.no_grad():
        torch.testing.assert_close(once(**batch).nll, masked(**batch).nll, atol=1e-4, rtol=1e-4)


def time_context(args, context: int, variants: list[tuple[str, int]]) -> dict[tuple[str, int], float]:
    """Median seconds per step at one context length; variants interleaved round by round."""
    runs = {key: build(args, context, *key) for key in variants}
    return interleaved_medians({key: lambda mcl=mcl, batch=batch, optimizer=optimizer: train_step(
        "stacked", mcl, batch, optimizer) for key, (mcl, batch, optimizer) in runs.items()}, args.steps, args.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    small_llama_arguments(parser)
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--target", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 5])
    parser.add_argument("--masked", action="store_true", help="also time the naive masked computation")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (after one warm-up)")
    args = parser.parse_args()
    start(args)
    check_once_matches_masked(args, args.contexts[0])
    print(f"Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; batch {args.batch}, target "
          f"{args.target} tokens; LoRA r=8 on q,k,v,up,down; relaxed WTA; {args.device} {args.dtype}, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; median of {args.steps} steps\n")
    kinds = ["full", "once", *(["masked"] if args.masked else [])]
    variants = [(kind, k) for k in (1, *args.ks) for kind in kinds]
    columns = [f"{kind} K={k}" for kind, k in variants if (kind, k) != ("full", 1)]
    print("| context:target | K=1 full step (ms) | " + " | ".join(columns) + " | once speed-up at K=" +
          ", ".join(str(k) for k in args.ks) + " |")
    print("|---" * (len(columns) + 3) + "|")
    for context in args.contexts:
        seconds = time_context(args, context, variants)
        reference = seconds[("full", 1)]
        ratios = [f"{seconds[key] / reference:.2f}" for key in variants if key != ("full", 1)]
        speedups = ", ".join(f"{seconds[('full', k)] / seconds[('once', k)]:.2f}x" for k in args.ks)
        print(f"| {context}:{args.target} | {reference * 1000:.0f} | " + " | ".join(ratios) + f" | {speedups} |",
              flush=True)


if __name__ == "__main__":
    main()
