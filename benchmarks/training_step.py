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

    python benchmarks/training_step.py                  # CPU, small Llama (a few minutes)
    python benchmarks/training_step.py --vocab 151936   # Qwen2's vocabulary: the logits dominate
    python benchmarks/training_step.py --device cuda --layers 8 --hidden 1024 --seq 512 --batch 8

Peak memory: on CUDA, torch.cuda.max_memory_allocated during the steps; on CPU, in a fresh process running only
that variant, the peak of the resident set sampled during two steps minus the resident set before them (glibc is
told to map every allocation of 64 KiB or more, so freed tensors leave the resident set at once).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.nn.functional as F

from loramcl import MCLConfig, MCLLoraLinear, get_mcl_model, mcl_loss
from loramcl.trainer import scoring_block

STEPS = [(variant, k) for k in (1, 3, 5) for variant in ("stacked", "loop", "grouped-conv")]
STEPS += [(variant, k) for k in (3, 5) for variant in ("wta-one-pass", "wta-two-pass", "wta-two-pass-blocks")]
LOGITS = ("chunks", "whole")


def steps(args) -> list[tuple[str, int]]:
    """The (variant, K) pairs asked for (--only), always with the K=1 reference."""
    return [(variant, k) for variant, k in STEPS if not args.only or variant in args.only or (variant, k) == (
        "stacked", 1)]


def variants(args) -> list[tuple[str, int, str]]:
    return [(variant, k, logits) for variant, k in steps(args) for logits in LOGITS]


class GroupedConvLoraLinear(MCLLoraLinear):
    """The paper's grouped-convolution LoRA (App. G footnote), on our hypothesis-major rows."""

    def _adapter_delta(self, h: torch.Tensor) -> torch.Tensor:
        if self.routing.mode != "stacked":
            return super()._adapter_delta(h)
        k, (rows, length, d_in), r, d_out = self.num_hypotheses, h.shape, self.r, self.out_features
        batch = rows // k
        x = h.view(k, batch, length, d_in).permute(1, 0, 3, 2).reshape(batch, k * d_in, length)  # copy
        weight_a = self.lora_A.transpose(1, 2).reshape(k * r, d_in, 1)  # group g: A_g^T
        weight_b = self.lora_B.transpose(1, 2).reshape(k * d_out, r, 1)
        y = F.conv1d(F.conv1d(x, weight_a, groups=k), weight_b, groups=k)  # [B, K*d_out, T]
        return y.view(batch, k, d_out, length).permute(1, 0, 3, 2).reshape(rows, length, d_out)  # copy


_SHARED: dict[tuple[int, int], tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}


def build(args, variant: str, k: int, logits: str = "chunks"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(args.hidden // 192, 1), max_position_embeddings=args.seq)
    base = LlamaForCausalLM(config).to(args.device, getattr(torch, args.dtype))
    # Every variant has the same frozen embeddings and output layer (seed 0): one copy of them for all the variants
    # built in a process, which a large vocabulary needs.
    shared = _SHARED.setdefault((args.vocab, args.hidden), (base.model.embed_tokens.weight, base.lm_head.weight))
    base.model.embed_tokens.weight, base.lm_head.weight = shared
    loss = "wta" if variant.startswith("wta") else "relaxed"
    mcl = get_mcl_model(base, MCLConfig(num_hypotheses=k, r=8, alpha=8, loss=loss, epsilon=0.05 if k > 1 else 0.0,
                                        target_modules=["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"],
                                        logits_chunk_size=args.chunk if logits == "chunks" else None))
    if variant == "grouped-conv":
        for _, layer in mcl.mcl_layers():
            layer.__class__ = GroupedConvLoraLinear
    with torch.no_grad():  # non-zero B, so that the hypotheses differ as they do after some training
        for _, layer in mcl.mcl_layers():
            layer.lora_B.normal_(std=0.02)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(args.device)
    labels = ids.clone()
    labels[:, : args.seq // 4] = -100  # a prompt
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    optimizer = torch.optim.AdamW([p for p in mcl.parameters() if p.requires_grad], lr=1e-4)
    return mcl.train(), batch, optimizer


def step(variant: str, mcl, batch: dict, optimizer) -> None:
    k = mcl.num_hypotheses
    if variant == "loop":
        nll = torch.stack([mcl(**batch, hypotheses=h).nll for h in range(k)], dim=1)  # [B, K]
        loss = mcl_loss(nll, mcl.mcl_config)[0]
    elif variant.startswith("wta-two-pass"):  # -blocks: the scoring pass in blocks of examples, as MCLTrainer's
        per_block = scoring_block(len(batch["labels"]), k) if variant.endswith("blocks") else None
        with torch.no_grad():
            winners = mcl(**batch, examples_per_block=per_block).nll.argmin(dim=1)
        loss = mcl(**batch, hypotheses=winners).loss
    else:  # stacked, grouped-conv, wta-one-pass
        loss = mcl(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def check_grouped_conv_matches(args) -> None:
    ours, batch, _ = build(args, "stacked", 3)
    paper, _, _ = build(args, "grouped-conv", 3)
    with torch.no_grad():
        torch.testing.assert_close(ours(**batch).nll, paper(**batch).nll, atol=1e-4, rtol=1e-4)


def time_all(args) -> dict[tuple[str, int, str], float]:
    """Median seconds per step; variants are interleaved round by round so that drifts hit all alike."""
    runs = {key: build(args, *key) for key in variants(args)}
    for key, (mcl, batch, optimizer) in runs.items():
        step(key[0], mcl, batch, optimizer)  # warm-up
    times = {key: [] for key in variants(args)}
    for _ in range(args.steps):
        for key, (mcl, batch, optimizer) in runs.items():
            synchronize(args.device)
            started = time.perf_counter()
            step(key[0], mcl, batch, optimizer)
            synchronize(args.device)
            times[key].append(time.perf_counter() - started)
    return {key: statistics.median(values) for key, values in times.items()}


def peak_memory_mib(args, variant: str, k: int, logits: str) -> float:
    """Peak memory of the steps of one variant, measured in a fresh process (see the module docstring)."""
    command = [sys.executable, __file__, "--memory-of", variant, str(k), logits, *sys.argv[1:]]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    output = subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(output.strip().splitlines()[-1])["peak_mib"]


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class ResidentPeak(threading.Thread):
    """Samples the resident set every half millisecond until stopped (torch ops release the GIL)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self._done = resident_bytes(), threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.0005):
            self.peak = max(self.peak, resident_bytes())

    def stop(self) -> int:
        self._done.set()
        self.join()
        return max(self.peak, resident_bytes())


def measure_memory_here(args, variant: str, k: int, logits: str) -> None:
    mcl, batch, optimizer = build(args, variant, k, logits)
    step(variant, mcl, batch, optimizer)  # warm-up: optimizer state, allocator pools
    gc.collect()
    print(json.dumps({"peak_mib": peak_mib(args.device, lambda: [step(variant, mcl, batch, optimizer)
                                                                 for _ in range(2)])}))


def peak_mib(device: str, run) -> float:
    """Peak memory of ``run()`` above what was in use before it: CUDA's allocated memory, or the resident set."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    before = resident_bytes()
    sampler = ResidentPeak()
    sampler.start()
    run()
    return (sampler.stop() - before) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=576)  # SmolLM2-135M's width
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (after one warm-up)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--chunk", type=int, default=MCLConfig.logits_chunk_size,
                        help="label tokens per chunk of logits in the 'chunks' variants")
    parser.add_argument("--only", nargs="+", choices=sorted({variant for variant, _ in STEPS}),
                        help="these variants only (and the K=1 stacked step, the reference)")
    parser.add_argument("--memory-of", nargs=3, metavar=("VARIANT", "K", "LOGITS"), help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging

    logging.set_verbosity_error()
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
