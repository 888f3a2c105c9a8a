"""Decoding K hypotheses: one batched generate (K*B rows, hypothesis-major) against a loop of K generates.

For K in {3, 5} and greedy / beam search, both through ``generate_hypotheses`` (``hypotheses=[k]`` for one
hypothesis), on the same prompts, with every candidate forced to the same length (min_new_tokens) so that both
sides decode the same number of steps. The two are interleaved repeat by repeat and the median is kept; the
headline is their ratio, measured side by side. Before timing, the script checks that both give the same tokens.

    python -m benchmarks.speed.generation_speed                        # CPU, small Llama (a few minutes)
    python -m benchmarks.speed.generation_speed --threads 1            # when other processes share the CPU
    python -m benchmarks.speed.generation_speed --device cuda --layers 8 --hidden 1024 --batch 8
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import (
    TARGETS,
    build_model,
    decoding_sides,
    interleaved_medians,
    perturb_adapters,
    same_tokens,
    small_llama_arguments,
    small_llama_config,
    start,
)
from loramcl import MCLConfig, get_mcl_model

SETTINGS = [(k, strategy, beams) for k in (3, 5) for strategy, beams in (("greedy", 1), ("beam", 2))]


def build(args, k: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = small_llama_config(args.layers, args.hidden, args.vocab, args.prompt + args.new_tokens)
    base = build_model(LlamaForCausalLM, config, args.device, getattr(torch, args.dtype))
    mcl = get_mcl_model(base, MCLConfig(num_hypotheses=k, r=8, alpha=8, target_modules=TARGETS))
    perturb_adapters(mcl)
    return mcl.eval()


def prompts(args) -> dict:
    """B prompts of different lengths (between prompt/2 and prompt tokens), left-padded."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.zeros(args.batch, args.prompt, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row in range(args.batch):
        n = args.prompt - (row * args.prompt // 2) // max(args.batch - 1, 1)
        input_ids[row, -n:] = torch.randint(3, args.vocab, (n,), generator=g)
        attention_mask[row, -n:] = 1
    return {"input_ids": input_ids.to(args.device), "attention_mask": attention_mask.to(args.device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    small_llama_arguments(parser)
    parser.add_argument("--batch", type=int, default=4, help="prompts per call (B)")
    parser.add_argument("--prompt", type=int, default=32, help="longest prompt, in tokens")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per candidate")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of each side (after one warm-up)")
    args = parser.parse_args()
    start(args)
    inputs = prompts(args)
    print(f"Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; B={args.batch} prompts of "
          f"{args.prompt // 2}-{args.prompt} tokens, {args.new_tokens} new tokens per candidate, repetition penalty "
          f"1.1; LoRA r=8 on q,k,v,up,down; {args.device} {args.dtype}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.repeats} repeats\n")
    print("| K | decoding | batched (ms) | loop of K (ms) | loop / batched | batched tokens/s |")
    print("|---|---|---|---|---|---|")
    for k, strategy, beams in SETTINGS:
        mcl = build(args, k)
        sides = decoding_sides(mcl, inputs, strategy, beams, args.new_tokens)
        one, many = sides["batched"](), sides["loop"]()  # also the warm-up
        if same_tokens(one, many) < 1:
            raise RuntimeError(f"K={k} {strategy}: the batched and the looped hypotheses decoded different tokens")
        seconds = interleaved_medians(sides, args.repeats, args.device, warmup=0)
        fused, looped = seconds["batched"], seconds["loop"]
        label = "greedy" if beams == 1 else f"beam {beams}/hypothesis"
        tokens = k * args.batch * args.new_tokens
        print(f"| {k} | {label} | {fused * 1000:.0f} | {looped * 1000:.0f} | {looped / fused:.2f} | "
              f"{tokens / fused:.0f} |", flush=True)


if __name__ == "__main__":
    main()
