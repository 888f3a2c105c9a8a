"""Cost of one LoRA-MCL training step, as ratios to the K=1 step measured in the same run.

Compares, for K in {1, 3, 5}:
  stacked      ours: one bmm per layer for all K hypotheses (hypothesis-major rows)
  loop         K forwards, one hypothesis each, then one backward (the straightforward implementation)
  grouped-conv the paper's layer (App. G): a 1x1 Conv1d with K groups over [B, K*d, T], with its permutes
and, for vanilla WTA, the one-pass loss (backward through all K) against the two-pass scheme (score all K
without grad, then forward + backward of the winners only), its scoring pass on the whole batch at once
(wta-two-pass) or in blocks of examples as MCLTrainer runs it (wta-two-pass-blocks). Relaxed WTA (epsilon=0.05)
is used for the first three so that every hypothesis gets a gradient. Every variant runs twice: with the
vocabulary logits and their cross-entropy computed in chunks of --chunk label tokens (MCLConfig.logits_chunk_size,
the default), and whole ([N, V] logits at once, logits_chunk_size=None).

    python -m benchmarks.speed.training_step                  # CPU, small Llama (a few minutes)
    python -m benchmarks.speed.training_step --vocab 151936   # Qwen2's vocabulary: the logits dominate
    python -m benchmarks.speed.training_step --device cuda --layers 8 --hidden 1024 --seq 512 --batch 8

Peak memory: on CUDA, torch.cuda.max_memory_allocated during the steps; on CPU, in a fresh process running only
that variant, the peak of the resident set sampled during two steps minus the resident set before them (glibc is
told to map every allocation of 64 KiB or more, so freed tensors leave the resident set at once).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import torch

from benchmarks.common import (
    RELEASE_FREED_MEMORY,
    TARGETS,
    build_model,
    in_fresh_process,
    interleaved_medians,
    peak_mib,
    perturb_adapters,
    small_llama_arguments,
    small_llama_config,
    start,
    train_step,
    use_grouped_conv,
)
from loramcl import MCLConfig, get_mcl_model

STEPS = [(variant, k) for k in (1, 3, 5) for variant in ("stacked", "loop", "grouped-conv")]
STEPS += [(variant, k) for k in (3, 5) for variant in ("wta-one-pass", "wta-two-pass", "wta-two-pass-blocks")]
LOGITS = ("chunks", "whole")


def steps(args) -> list[tuple[str, int]]:
    """The (variant, K) pairs asked for (--only), always with the K=1 reference."""
    return [(variant, k) for variant, k in STEPS if not args.only or variant in args.only or (variant, k) == (
        "stacked", 1)]


def variants(args) -> list[tuple[str, int, str]]:
    return [(variant, k, logits) for variant, k in steps(args) for logits in LOGITS]


_SHARED: dict[tuple[int, int], tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}


def build(args, variant: str, k: int, logits: str = "chunks"):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = small_llama_config(args.layers, args.hidden, args.vocab, args.seq)
    base = build_model(LlamaForCausalLM, config, args.device, getattr(torch, args.dtype))
    # Every variant has the same frozen embeddings and output layer (seed 0): one copy of them for all the variants
    # built in a process, which a large vocabulary needs.
    shared = _SHARED.setdefault((args.vocab, args.hidden), (base.model.embed_tokens.weight, base.lm_head.weight))
    base.model.embed_tokens.weight, base.lm_head.weight = shared
    loss = "wta" if variant.startswith("wta") else "relaxed"
    mcl = get_mcl_model(base, MCLConfig(num_hypotheses=k, r=8, alpha=8, loss=loss, epsilon=0.05 if k > 1 else 0.0,
                                        target_modules=TARGETS,
                                        logits_chunk_size=args.chunk if logits == "chunks" else None))
    if variant == "grouped-conv":
        use_grouped_conv(mcl)
    perturb_adapters(mcl)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(args.device)
    labels = ids.clone()
    labels[:, : args.seq // 4] = -100  # a prompt
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    optimizer = torch.optim.AdamW([p for p in mcl.parameters() if p.requires_grad], lr=1e-4)
    return mcl.train(), batch, optimizer


def check_grouped_conv_matches(args) -> None:
    ours, batch, _ = build(args, "stacked", 3)
    paper, _, _ = build(args, "grouped-conv", 3)
    with torch.no_grad():
        torch.testing.assert_close(ours(**batch).nll, paper(**batch).nll, atol=1e-4, rtol=1e-4)


def time_all(args) -> dict[tuple[str, int, str], float]:
    """Median seconds per step; variants are interleaved round by round so that drifts hit all alike."""
    runs = {key: build(args, *key) for key in variants(args)}
    return interleaved_medians({key: lambda key=key, run=run: train_step(key[0], *run) for key, run in runs.items()},
                               args.steps, args.device)


def peak_memory_mib(args, variant: str, k: int, logits: str) -> float:
    """Peak memory of the steps of one variant, measured in a fresh process (see the module docstring)."""
    arguments = ["--memory-of", variant, str(k), logits, *sys.argv[1:]]
    return in_fresh_process(__spec__.name, arguments, RELEASE_FREED_MEMORY)["peak_mib"]


def measure_memory_here(args, variant: str, k: int, logits: str) -> None:
    mcl, batch, optimizer = build(args, variant, k, logits)
    train_step(variant, mcl, batch, optimizer)  # warm-up: optimizer state, allocator pools
    gc.collect()
    print(json.dumps({"peak_mib": peak_mib(args.device, lambda: [train_step(variant, mcl, batch, optimizer)
                                                                 for _ in range(2)])}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    small_llama_arguments(parser)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (after one warm-up)")
    parser.add_argument("--chunk", type=int, default=MCLConfig.logits_chunk_size,
                        help="label tokens per chunk of logits in the 'chunks' variants")
    parser.add_argument("--only", nargs="+", choices=sorted({variant for variant, _ in STEPS}),
                        help="these variants only (and the K=1 stacked step, the reference)")
    parser.add_argument("--memory-of", nargs=3, metavar=("VARIANT", "K", "LOGITS"), help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    start(args)
    if args.memory_of:
        measure_memory_here(args, args.memory_of[0], int(args.memory_of[1]), args.memory_of[2])
        return
    check_grouped_conv_matches(args)
    label_tokens = args.batch * (args.seq - args.seq // 4)
    print(f"Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}; batch {args.batch} x {args.seq} "
          f"tokens ({label_tokens} label tokens); LoRA r=8 on q,k,v,up,down; {args.device} {args.dtype}, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; median of {args.steps} steps; logits in chunks of "
          f"{args.chunk} label tokens or whole")
    seconds = time_all(args)
    memory = {key: peak_memory_mib(args, *key) for key in variants(args)}
    for logits in LOGITS:
        reference = ("stacked", 1, logits)
        print(f"K=1 step, logits {logits}: {seconds[reference] * 1000:.0f} ms, peak memory {memory[reference]:.0f} MiB")
    print("\n| variant | K | step time / K=1 step | peak memory / K=1 | whole logits: time / K=1 | peak / K=1 "
          "| chunks / whole: time | peak |")
    print("|---|---|---|---|---|---|---|---|")
    for variant, k in steps(args):
        chunks, whole = (variant, k, "chunks"), (variant, k, "whole")
        one_chunks, one_whole = ("stacked", 1, "chunks"), ("stacked", 1, "whole")
        ratios = [seconds[chunks] / seconds[one_chunks], memory[chunks] / memory[one_chunks],
                  seconds[whole] / seconds[one_whole], memory[whole] / memory[one_whole],
                  seconds[chunks] / seconds[whole], memory[chunks] / memory[whole]]
        print(f"| {variant} | {k} | " + " | ".join(f"{ratio:.2f}" for ratio in ratios) + " |")


if __name__ == "__main__":
    main()
